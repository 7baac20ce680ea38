// The cascaded sum of squares (kernels/cascade_sum.h) against torch's own results: the table in
// cascade_sum_expected.h was computed by torch's `x.square().sum(-1)` and `.mean(-1)`
// (tests/tools/cascade_sum_expected.py) on the AVX2 kernels, whose vectors have 8 lanes, the width
// the goldens' torch ran (kTorchSumLanes); every SIMD level is held to that reference by the op
// tests (tests/ops_test.cpp, rms_norm and the mHC ops).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "cascade_sum_expected.h"
#include "kernels/cascade_sum.h"

namespace dsv41 {
namespace {

// The script's input formula: exact in double, one rounding to fp32.
std::vector<float> torch_input(int64_t n) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t u = (static_cast<uint64_t>(i) * 2654435761u + static_cast<uint64_t>(n) * 40503u) & 0xFFFFFFFFu;
    const double v = (static_cast<double>(u) / 4294967296.0 - 0.5) * std::ldexp(1.0, static_cast<int>(u >> 27) - 16);
    x[static_cast<size_t>(i)] = static_cast<float>(v);
  }
  return x;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

TEST(CascadeSum, EqualsTorchBitForBit) {
  static_assert(test::kTorchExpectedLanes == 8, "regenerate the table on a machine whose torch runs AVX2");
  static_assert(kTorchSumLanes == test::kTorchExpectedLanes, "the model's order is the one checked here");
  int sequential_differs = 0;
  for (const test::CascadeExpected& e : test::kCascadeExpected) {
    const std::vector<float> x = torch_input(e.n);
    const float sum = reference::cascade_sum_of_squares(x.data(), e.n);
    EXPECT_TRUE(same_bits(sum, e.sum)) << "n = " << e.n << ": " << sum << " vs torch " << e.sum;
    EXPECT_TRUE(same_bits(sum / static_cast<float>(e.n), e.mean)) << "n = " << e.n << ": mean";
    float sequential = 0;
    for (float v : x) sequential += v * v;
    sequential_differs += !same_bits(sequential, e.sum);
  }
  // the inputs are made so that the order decides bits: a plain running sum misses many of them
  EXPECT_GE(sequential_differs, 10);
}

TEST(CascadeSum, SixteenLanesIsTheSameOrderOnWiderVectors) {
  // With every square equal to 1 every partial sum is exact, so both widths give n; on the spread of
  // magnitudes of the torch inputs the lane structure decides bits, and the two widths differ.
  std::vector<float> ones(5000, 1.0f);
  EXPECT_EQ(reference::cascade_sum_of_squares<16>(ones.data(), 5000), 5000.0f);
  EXPECT_EQ(reference::cascade_sum_of_squares<8>(ones.data(), 5000), 5000.0f);
  int widths_differ = 0;
  for (const test::CascadeExpected& e : test::kCascadeExpected) {
    const std::vector<float> x = torch_input(e.n);
    widths_differ += !same_bits(reference::cascade_sum_of_squares<16>(x.data(), e.n),
                                reference::cascade_sum_of_squares<8>(x.data(), e.n));
  }
  EXPECT_GE(widths_differ, 5);
  // below 16 values (and below 8) both take the scalar path: identical
  const std::vector<float> x = torch_input(7);
  EXPECT_TRUE(same_bits(reference::cascade_sum_of_squares<16>(x.data(), 7),
                        reference::cascade_sum_of_squares<8>(x.data(), 7)));
}

}  // namespace
}  // namespace dsv41
