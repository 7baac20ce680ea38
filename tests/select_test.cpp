// Top-k selection with TopkTies::Torch against torch.topk itself (tests/tools/topk_expected.py): on
// rows full of ties, in both regimes of torch's CPU kernel, the same entries as torch, so the engine
// can pick the reference's rows where scores are equal (kernels/select.cpp). The serving order
// (TopkTies::LowerIndexFirst) on every backend level equals the reference's nth_element selection.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <random>

#include "kernels/reference.h"
#include "kernels/topk_threshold.h"
#include "ops_util.h"
#include "topk_expected.h"

namespace dsv41 {
namespace {

TEST(TopK, PicksTorchsEntriesAmongTies) {
  int lower_index_first_differs = 0;
  for (const test::TopkExpected& e : test::topk_expected()) {
    const int64_t n = static_cast<int64_t>(e.scores.size());
    EXPECT_EQ(reference::topk_ascending(e.scores.data(), n, e.k, TopkTies::Torch), e.selected)
        << "n = " << n << ", k = " << e.k;
    // the rows are made so that ties decide: the serving order picks other entries
    lower_index_first_differs +=
        reference::topk_ascending(e.scores.data(), n, e.k, TopkTies::LowerIndexFirst) != e.selected;
  }
  EXPECT_GE(lower_index_first_differs, 4);  // measured: 5 of the 12 rows
}

TEST(TopK, EdgeSizes) {
  const float s[] = {1, 2, 2, 0};
  EXPECT_TRUE(reference::topk_ascending(s, 4, 0, TopkTies::Torch).empty());
  EXPECT_EQ(reference::topk_ascending(s, 4, 4, TopkTies::Torch), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(reference::topk_ascending(s, 4, 1, TopkTies::Torch).size(), 1u);
}

// Score rows that stress a running-threshold selection: many ties (few distinct values), -inf
// entries (masked keys, selectable when fewer than k are finite), ascending rows (every score
// enters the heap) and descending ones (none does), at sizes around the 16-score blocks.
std::vector<std::vector<float>> hard_rows() {
  std::mt19937 rng(7);
  std::vector<std::vector<float>> rows;
  for (const int n : {1, 15, 16, 17, 63, 200, 1000, 5000}) {
    for (int kind = 0; kind < 5; ++kind) {
      std::vector<float> r(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) {
        switch (kind) {
          case 0: r[i] = std::uniform_real_distribution<float>(-4, 4)(rng); break;
          case 1: r[i] = static_cast<float>(rng() % 5); break;  // ties everywhere
          case 2: r[i] = rng() % 3 == 0 ? -std::numeric_limits<float>::infinity() : static_cast<float>(rng() % 7); break;
          case 3: r[i] = static_cast<float>(i) * 0.5f; break;
          default: r[i] = -static_cast<float>(i); break;
        }
      }
      rows.push_back(std::move(r));
    }
  }
  return rows;
}

TEST(TopK, ThresholdSelectionEqualsTheReferenceOnEveryLevel) {
  int checked = 0;
  for (const std::vector<float>& r : hard_rows()) {
    const int64_t n = static_cast<int64_t>(r.size());
    for (const int64_t k : {int64_t{1}, int64_t{2}, int64_t{7}, int64_t{16}, int64_t{64}, n / 2, n - 1, n}) {
      if (k < 0 || k > n) continue;
      const std::vector<int32_t> want = reference::topk_ascending(r.data(), n, k, TopkTies::LowerIndexFirst);
      EXPECT_EQ(topk_by_threshold(r.data(), n, k), want) << "n = " << n << ", k = " << k;
      for (const auto& b : test::op_backends()) {
        EXPECT_EQ(b->topk_ascending(r.data(), n, k, TopkTies::LowerIndexFirst), want) << b->name();
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 250);
}

}  // namespace
}  // namespace dsv41
