// The one-pass top-k against the reference's sort-based one (lower index first among ties), on the
// orders that stress it: scores that rise along the row (every one enters the running top k and the
// candidate list is cut many times), falling ones (almost none enters), ties everywhere, rows whose
// later part is not visible yet (-inf), zeros of both signs, and k from 1 to the whole row.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/reference.h"
#include "kernels/topk_threshold.h"

namespace {

using namespace dsv41;

void expect_same_topk(const std::vector<float>& s, const std::string& what) {
  const int64_t n = static_cast<int64_t>(s.size());
  for (const int64_t k : {int64_t{1}, int64_t{7}, int64_t{64}, int64_t{512}, n / 2, n}) {
    if (k > n) continue;
    EXPECT_EQ(topk_by_threshold(s.data(), n, k), reference::topk_ascending(s.data(), n, k)) << what << " k " << k;
  }
}

TEST(TopkByThreshold, MatchesTheSortOnEveryOrder) {
  std::mt19937 rng(41);
  std::uniform_int_distribution<int> level(-30, 30);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int64_t n : {int64_t{1}, int64_t{15}, int64_t{17}, int64_t{1000}, int64_t{20011}}) {
    std::vector<float> rising(static_cast<size_t>(n)), falling(rising.size()), ties(rising.size()),
        noisy(rising.size());
    for (int64_t i = 0; i < n; ++i) {
      rising[i] = static_cast<float>(i) * 0.01f;
      falling[i] = -rising[i];
      ties[i] = static_cast<float>(level(rng)) / 8.0f;
      noisy[i] = static_cast<float>(i) * 1e-3f + normal(rng);  // rising with noise: many cuts
    }
    const std::string at = " n " + std::to_string(n);
    expect_same_topk(rising, "rising" + at);
    expect_same_topk(falling, "falling" + at);
    expect_same_topk(ties, "ties" + at);
    expect_same_topk(noisy, "noisy" + at);
    std::vector<float> half = ties;  // the later half not visible yet
    std::fill(half.begin() + n / 2, half.end(), -std::numeric_limits<float>::infinity());
    expect_same_topk(half, "half visible" + at);
    expect_same_topk(std::vector<float>(static_cast<size_t>(n), 0.5f), "all equal" + at);
    std::vector<float> zeros(static_cast<size_t>(n), 0.0f);  // -0 and +0 compare equal: index decides
    for (int64_t i = 0; i < n; i += 3) zeros[i] = -0.0f;
    expect_same_topk(zeros, "signed zeros" + at);
  }
}

}  // namespace
