// The sampler's vocabulary order (runtime/logit_order.h) against the rule it implements, checked by a
// comparison sort: largest logit first, equal logits (-0 and +0 among them) by ascending id.
#include "runtime/logit_order.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "runtime/sampler.h"

namespace dsv41 {
namespace {

std::vector<int32_t> by_comparison(const std::vector<float>& logits) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  return order;
}

// Logits with what real rows hold and what breaks a careless bit sort: many exact ties (values
// rounded to quarters), both zeros, negatives and positives, subnormals, infinities, the extremes.
std::vector<float> hard_logits(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    float x = normal(rng);
    switch (rng() % 8) {
      case 0: x = std::round(x * 4) / 4; break;  // ties
      case 1: x = (rng() % 2) ? 0.0f : -0.0f; break;
      case 2: x = std::numeric_limits<float>::denorm_min() * static_cast<float>(rng() % 5) * ((rng() % 2) ? 1 : -1); break;
      case 3: x = (rng() % 2) ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity(); break;
      case 4: x = (rng() % 2) ? std::numeric_limits<float>::max() : std::numeric_limits<float>::lowest(); break;
      default: break;
    }
    v[i] = x;
  }
  return v;
}

TEST(LogitOrder, IsTheComparisonSortsOrder) {
  LogitOrder sorter;  // reused across calls and sizes, as the sampler does
  std::vector<int32_t> order;
  for (size_t n : {size_t{1}, size_t{2}, size_t{7}, size_t{256}, size_t{4096}, size_t{129280}, size_t{300}}) {
    for (uint32_t seed : {1u, 2u}) {
      const std::vector<float> logits = hard_logits(n, seed + static_cast<uint32_t>(n));
      sorter.sort(logits.data(), static_cast<int64_t>(n), order);
      ASSERT_EQ(order, by_comparison(logits)) << n << " logits, seed " << seed;
    }
  }
  // all equal: ids ascending (every pass trivial); all distinct and already descending
  std::vector<float> same(1000, -1.5f), descending(1000);
  for (size_t i = 0; i < descending.size(); ++i) descending[i] = 500.0f - static_cast<float>(i);
  sorter.sort(same.data(), 1000, order);
  EXPECT_EQ(order, by_comparison(same));
  sorter.sort(descending.data(), 1000, order);
  EXPECT_EQ(order, by_comparison(descending));
}

// The sampler draws from that order: its distribution at temperature 1 is the softmax, most likely
// token included, on a row with ties.
TEST(LogitOrder, TheSamplersDistributionIsTheSoftmax) {
  const std::vector<float> logits = {1.0f, 3.0f, -0.0f, 3.0f, 0.0f, -2.0f};
  Sampler s(SamplingParams{1.0, 1.0, 5});
  const std::vector<double> p = s.distribution(logits.data(), static_cast<int64_t>(logits.size()));
  double z = 0;
  for (float x : logits) z += std::exp(static_cast<double>(x));
  for (size_t i = 0; i < logits.size(); ++i) EXPECT_NEAR(p[i], std::exp(static_cast<double>(logits[i])) / z, 1e-12) << i;
}

}  // namespace
}  // namespace dsv41
