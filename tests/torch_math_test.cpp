// torch's exp, sigmoid, SiLU and softplus (kernels/torch_math.h) against the values torch itself computes
// (tests/tools/torch_math_expected.py): bit for bit, on inputs chosen where a correctly rounded exp
// gives other bits, and on the edges of the range and the special values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/torch_math.h"
#include "torch_math_expected.h"

namespace dsv41 {
namespace {

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(a) && std::isnan(b)); }

TEST(TorchMath, EqualsTorchBitForBit) {
  for (const test::TorchMathExpected& e : test::kTorchMathExpected) {
    EXPECT_TRUE(same_bits(torch_exp(e.x), e.exp)) << "exp(" << e.x << "): " << torch_exp(e.x) << " vs " << e.exp;
    EXPECT_TRUE(same_bits(torch_sigmoid(e.x), e.sigmoid)) << "sigmoid(" << e.x << ")";
    EXPECT_TRUE(same_bits(torch_silu(e.x), e.silu)) << "silu(" << e.x << ")";
    EXPECT_TRUE(same_bits(torch_softplus(e.x), e.softplus)) << "softplus(" << e.x << ")";
  }
}

TEST(TorchMath, TheTableTellsTorchsExpFromACorrectlyRoundedOne) {
  // libm's expf is correctly rounded on these inputs; the table must catch an engine that uses it
  int exp_differs = 0, sigmoid_differs = 0, silu_differs = 0, softplus_differs = 0;
  for (const test::TorchMathExpected& e : test::kTorchMathExpected) {
    exp_differs += !same_bits(std::exp(e.x), e.exp);
    sigmoid_differs += !same_bits(1.0f / (1.0f + std::exp(-e.x)), e.sigmoid);
    silu_differs += !same_bits(e.x / (1.0f + std::exp(-e.x)), e.silu);
    softplus_differs += !same_bits(e.x > 20.0f ? e.x : std::log1p(std::exp(e.x)), e.softplus);
  }
  EXPECT_GE(exp_differs, 100);
  EXPECT_GE(sigmoid_differs, 100);
  EXPECT_GE(silu_differs, 100);
  EXPECT_GE(softplus_differs, 100);
}

TEST(TorchMath, RangeEdges) {
  EXPECT_EQ(torch_exp(0.0f), 1.0f);
  EXPECT_EQ(torch_exp(-104.5f), 0.0f);  // below -104: zero, as Sleef's
  EXPECT_TRUE(std::isinf(torch_exp(100.5f)));
  EXPECT_TRUE(std::isinf(torch_exp(89.0f)));  // past fp32's range: the scalings overflow
  EXPECT_GT(torch_exp(-103.0f), 0.0f);  // a subnormal, through the two scalings
  EXPECT_TRUE(std::isnan(torch_exp(std::nanf(""))));
  EXPECT_EQ(torch_log1p(-1.0f), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(torch_log1p(-2.0f)));
  EXPECT_TRUE(std::signbit(torch_log1p(-0.0f)));
  EXPECT_EQ(torch_log1p(1e-30f), 1e-30f);
}

}  // namespace
}  // namespace dsv41
