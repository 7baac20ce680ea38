// The vision tower's ops (kernels/backend.h, "the vision tower"): every level at every thread count
// against the scalar reference, bit for bit, and the references themselves against values worked
// out by hand (so a reference that is wrong cannot agree with itself).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kernels/reference.h"
#include "ops_util.h"

namespace dsv41 {
namespace {

using test::first_difference;
using test::label;
using test::op_backends;
using test::random_bf16_values;

// The op on every backend equals the reference.
void expect_levels_agree(const std::string& what, const std::function<std::vector<float>(const Backend*)>& run) {
  const std::vector<float> want = run(nullptr);
  for (const auto& b : op_backends()) EXPECT_EQ(first_difference(run(b.get()), want), "") << what << " on " << label(*b);
}

TEST(OpsVision, EveryLevelGivesTheReferencesBits) {
  std::mt19937 rng(41);
  for (const auto& [n, heads, d] : {std::tuple{int64_t{84}, int64_t{4}, int64_t{16}}, std::tuple{int64_t{300}, int64_t{4}, int64_t{16}},
                                     std::tuple{int64_t{70}, int64_t{16}, int64_t{64}}, std::tuple{int64_t{5}, int64_t{3}, int64_t{20}}}) {
    const int64_t width = heads * d, stride = 3 * width;
    const std::vector<float> qkv = random_bf16_values(rng, static_cast<size_t>(n * stride), 2.0f);
    const std::string shape = "n=" + std::to_string(n) + " heads=" + std::to_string(heads) + " d=" + std::to_string(d);
    expect_levels_agree("dense_attention " + shape, [&](const Backend* b) {
      std::vector<float> out(static_cast<size_t>(n * width));
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      b ? b->dense_attention(qkv.data(), qkv.data() + width, qkv.data() + 2 * width, n, heads, d, stride, scale, out.data())
        : reference::dense_attention(qkv.data(), qkv.data() + width, qkv.data() + 2 * width, n, heads, d, stride, scale,
                                     out.data());
      return out;
    });
    std::vector<float> cos(static_cast<size_t>(n * d / 2)), sin(cos.size());
    std::uniform_real_distribution<float> angle(-3.0f, 3.0f);
    for (size_t i = 0; i < cos.size(); ++i) {
      const float a = angle(rng);
      cos[i] = std::cos(a);
      sin[i] = std::sin(a);
    }
    expect_levels_agree("rope_rotate_half " + shape, [&](const Backend* b) {
      std::vector<float> x = qkv;
      b ? b->rope_rotate_half(cos.data(), sin.data(), n, heads, d, x.data() + width, stride)
        : reference::rope_rotate_half(cos.data(), sin.data(), n, heads, d, x.data() + width, stride);
      return x;
    });
  }
  // dense_attention on inputs a level's bf16-pair path does not take (it falls back to the fp32
  // chains): a query lane at 2^-100, and values that are not bf16 at all
  {
    const int64_t n = 40, heads = 2, d = 16, width = heads * d, stride = 3 * width;
    for (const bool bf16_values : {true, false}) {
      std::vector<float> qkv = random_bf16_values(rng, static_cast<size_t>(n * stride), 2.0f);
      if (bf16_values) {
        qkv[5] = std::ldexp(1.5f, -100);
      } else {
        for (float& v : qkv) v *= 1.0f + 1e-6f;
      }
      expect_levels_agree(bf16_values ? "dense_attention, a query at 2^-100" : "dense_attention, fp32 values",
                          [&](const Backend* b) {
                            std::vector<float> out(static_cast<size_t>(n * width));
                            b ? b->dense_attention(qkv.data(), qkv.data() + width, qkv.data() + 2 * width, n, heads, d,
                                                   stride, 0.25f, out.data())
                              : reference::dense_attention(qkv.data(), qkv.data() + width, qkv.data() + 2 * width, n,
                                                           heads, d, stride, 0.25f, out.data());
                            return out;
                          });
    }
  }
  const std::vector<float> x = random_bf16_values(rng, 6 * 2 * 176, 3.0f), bias = random_bf16_values(rng, 2 * 176);
  expect_levels_agree("silu_mul_bf16", [&](const Backend* b) {
    std::vector<float> out(6 * 176);
    b ? b->silu_mul_bf16(x.data(), 6, 176, out.data()) : reference::silu_mul_bf16(x.data(), 6, 176, out.data());
    return out;
  });
  expect_levels_agree("gelu_erf_bf16", [&](const Backend* b) {
    std::vector<float> y = x;
    b ? b->gelu_erf_bf16(y.data(), static_cast<int64_t>(y.size())) : reference::gelu_erf_bf16(y.data(), static_cast<int64_t>(y.size()));
    return y;
  });
  expect_levels_agree("add_bias_bf16 and add_bf16", [&](const Backend* b) {
    std::vector<float> y = x;
    b ? b->add_bias_bf16(y.data(), 6, 2 * 176, bias.data()) : reference::add_bias_bf16(y.data(), 6, 2 * 176, bias.data());
    b ? b->add_bf16(y.data(), x.data(), 6 * 2 * 176) : reference::add_bf16(y.data(), x.data(), 6 * 2 * 176);
    return y;
  });
  expect_levels_agree("unfold_cells 7x11", [&](const Backend* b) {
    std::vector<float> out(static_cast<size_t>(3 * 4 * 24 * 9));
    b ? b->unfold_cells(x.data(), 7, 11, 24, 3, out.data()) : reference::unfold_cells(x.data(), 7, 11, 24, 3, out.data());
    return out;
  });
}

TEST(OpsVision, RotateHalfPairsLaneIWithLaneIPlusHalf) {
  // one row, one head of 8 lanes: angles 0 (identity), pi/2 (x1 -> -x2, x2 -> x1) on lanes 0 and 1
  std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<float> cos = {1, 0, 1, 1}, sin = {0, 1, 0, 0};
  reference::rope_rotate_half(cos.data(), sin.data(), 1, 1, 8, x.data(), 8);
  EXPECT_EQ(x, (std::vector<float>{1, -6, 3, 4, 5, 2, 7, 8}));
}

TEST(OpsVision, DenseAttentionIsSoftmaxWeightedValues) {
  // two rows, one head of 2 lanes: q·k scores decide the weights of the two value rows
  std::vector<float> qkv = {0, 0, 0, 0, 1, 2,     // row 0: q, k, v
                            0, 0, 0, 0, 3, 6};    // row 1: equal scores: the mean of the values
  std::vector<float> out(4);
  reference::dense_attention(qkv.data(), qkv.data() + 2, qkv.data() + 4, 2, 1, 2, 6, 1.0f, out.data());
  EXPECT_EQ(out, (std::vector<float>{2, 4, 2, 4}));
  // a dominant score: row 0's query matches key 1 by far
  qkv = {10, 0, 0, 0, 1, 2, 0, 0, 10, 0, 3, 6};
  reference::dense_attention(qkv.data(), qkv.data() + 2, qkv.data() + 4, 2, 1, 2, 6, 1.0f, out.data());
  EXPECT_FLOAT_EQ(out[0], 3.0f);
  EXPECT_FLOAT_EQ(out[1], 6.0f);
}

TEST(OpsVision, GeluSiluAndRounding) {
  std::vector<float> g = {0.0f, 1.0f, -1.0f, 3.0f};
  reference::gelu_erf_bf16(g.data(), 4);
  // GELU(1) = 0.841344..., GELU(-1) = -0.158655..., GELU(3) = 2.99595...; bf16 keeps 8 bits
  EXPECT_EQ(g[0], 0.0f);
  EXPECT_NEAR(g[1], 0.841344f, 0.004f);
  EXPECT_NEAR(g[2], -0.158655f, 0.001f);
  EXPECT_NEAR(g[3], 2.99595f, 0.008f);
  EXPECT_EQ(g[1], round_bf16(g[1]));
  const std::vector<float> gate_up = {2.0f, 3.0f};  // silu(2) = 1.76159..., rounded to bf16, times 3
  std::vector<float> out(1);
  reference::silu_mul_bf16(gate_up.data(), 1, 1, out.data());
  EXPECT_EQ(out[0], round_bf16(round_bf16(1.7615942f) * 3.0f));
}

TEST(OpsVision, UnfoldIsChannelMajorWithZeroPadding) {
  // a 2 x 2 grid of 2-channel cells, value = 10·cell + channel; r = 3 pads it to one 3 x 3 cell
  const std::vector<float> x = {0, 1, 10, 11, 20, 21, 30, 31};
  std::vector<float> out(2 * 9);
  reference::unfold_cells(x.data(), 2, 2, 2, 3, out.data());
  // column c·9 + ky·3 + kx
  const std::vector<float> want = {0, 10, 0, 20, 30, 0, 0, 0, 0,   // channel 0
                                   1, 11, 0, 21, 31, 0, 0, 0, 0};  // channel 1
  EXPECT_EQ(out, want);
}

}  // namespace
}  // namespace dsv41
