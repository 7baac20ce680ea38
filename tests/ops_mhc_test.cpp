// The mHC ops: the fast versions against the scalar references, bit for bit, at every kernel level
// this machine runs and several thread counts; the fused step against the unfused sequence
// expand → mixes → collapse, through the backend and the model's API.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "io/config.h"
#include "kernels/backend.h"
#include "kernels/reference.h"
#include "model/mhc.h"
#include "numeric/formats.h"
#include "ops_util.h"

namespace {

using namespace dsv41;
using test::fast_backends;
using test::label;
using test::op_backends;

// "" when bitwise equal; else where and how they first differ. NaNs count as equal whatever their
// payload: when two NaNs meet in an addition the result's payload depends on operand order.
std::string first_difference(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return "sizes differ";
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) && std::isnan(want[i])) continue;
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i])) {
      return "first difference at " + std::to_string(i) + " of " + std::to_string(got.size()) + ": " +
             std::to_string(got[i]) + " vs " + std::to_string(want[i]);
    }
  }
  return "";
}

// Random inputs of one step for `count` tokens: a bf16 stream and sublayer output, mix weights of
// the released magnitudes, and the previous sublayer's coefficients from a real Sinkhorn.
struct Inputs {
  HcShape s;
  int64_t count = 0;
  std::vector<float> X, y, fn, scale, base;
  std::vector<float> pre, post, comb;  // the previous sublayer's

  Inputs(int64_t hc, int64_t dim, int64_t n_tokens, uint32_t seed) : count(n_tokens) {
    s.hc = hc;
    s.dim = dim;
    s.norm_eps = 1e-6f;
    s.sinkhorn_iters = 20;
    s.hc_eps = 1e-6f;
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int64_t mix = s.mix_count();
    X.resize(static_cast<size_t>(count * s.width()));
    y.resize(static_cast<size_t>(count * dim));
    fn.resize(static_cast<size_t>(mix * s.width()));
    base.resize(static_cast<size_t>(mix));
    for (auto& v : X) v = round_bf16(normal(rng));
    for (auto& v : y) v = round_bf16(normal(rng) * 0.5f);
    for (auto& v : fn) v = normal(rng) * 0.02f;
    for (auto& v : base) v = normal(rng) * 0.1f;
    scale = {0.5f, 0.7f, 1.3f};
    pre.resize(static_cast<size_t>(count * hc));
    post.resize(static_cast<size_t>(count * hc));
    comb.resize(static_cast<size_t>(count * hc * hc));
    std::vector<float> mixes(static_cast<size_t>(mix));
    for (int64_t t = 0; t < count; ++t) {
      for (auto& v : mixes) v = normal(rng);
      reference::hc_split_sinkhorn(mixes.data(), scale.data(), base.data(), static_cast<int>(hc), 20, 1e-6f, &pre[t * hc],
                        &post[t * hc], &comb[t * hc * hc]);
    }
  }
  HcMixWeights weights() const { return {fn.data(), scale.data(), base.data()}; }
  HcCoefficients previous() const { return {pre.data(), post.data(), comb.data()}; }
};

// What a call produced: the stream, the collapse and the new coefficients.
struct Outputs {
  std::vector<float> X, u, pre, post, comb;
  explicit Outputs(const Inputs& in)
      : X(in.X),
        u(static_cast<size_t>(in.count * in.s.dim), -1.0f),
        pre(static_cast<size_t>(in.count * in.s.hc), -1.0f),
        post(pre.size(), -1.0f),
        comb(static_cast<size_t>(in.count * in.s.hc * in.s.hc), -1.0f) {}
  HcCoefficientsOut coefficients() { return {pre.data(), post.data(), comb.data()}; }
};

void expect_same(const Outputs& got, const Outputs& want, const std::string& what) {
  EXPECT_EQ(first_difference(got.X, want.X), "") << what << ": X";
  EXPECT_EQ(first_difference(got.u, want.u), "") << what << ": u";
  EXPECT_EQ(first_difference(got.pre, want.pre), "") << what << ": pre";
  EXPECT_EQ(first_difference(got.post, want.post), "") << what << ": post";
  EXPECT_EQ(first_difference(got.comb, want.comb), "") << what << ": comb";
}

// The reference for the fused step: the three unfused scalar kernels in the model's order.
Outputs unfused_step(const Inputs& in) {
  Outputs o(in);
  reference::mhc_expand(in.s, o.X.data(), in.y.data(), in.post.data(), in.comb.data(), in.count);
  reference::mhc_mixes(in.s, o.X.data(), in.count, in.weights(), o.coefficients());
  reference::mhc_collapse(in.s, o.X.data(), in.pre.data(), in.count, o.u.data());
  return o;
}

// Each fast kernel, and the fused step, against the scalar references on the same inputs.
void check_level(const Backend& be, const Inputs& in, const std::string& what) {
  Outputs want_mixes(in), got_mixes(in);
  reference::mhc_mixes(in.s, in.X.data(), in.count, in.weights(), want_mixes.coefficients());
  be.mhc_mixes(in.s, in.X.data(), in.count, in.weights(), got_mixes.coefficients());
  expect_same(got_mixes, want_mixes, what + " mixes");

  Outputs want_collapse(in), got_collapse(in);
  reference::mhc_collapse(in.s, in.X.data(), in.pre.data(), in.count, want_collapse.u.data());
  be.mhc_collapse(in.s, in.X.data(), in.pre.data(), in.count, got_collapse.u.data());
  expect_same(got_collapse, want_collapse, what + " collapse");

  Outputs want_expand(in), got_expand(in);
  reference::mhc_expand(in.s, want_expand.X.data(), in.y.data(), in.post.data(), in.comb.data(), in.count);
  be.mhc_expand(in.s, got_expand.X.data(), in.y.data(), in.post.data(), in.comb.data(), in.count);
  expect_same(got_expand, want_expand, what + " expand");

  Outputs got_step(in);
  be.mhc_step(in.s, got_step.X.data(), in.y.data(), in.previous(), in.weights(), in.count, got_step.coefficients(),
             got_step.u.data());
  expect_same(got_step, unfused_step(in), what + " step");
}

std::string describe(const Backend& be, int64_t dim, int64_t count) {
  return label(be) + " dim " + std::to_string(dim) + " tokens " + std::to_string(count);
}

TEST(MhcKernels, FastVersionsMatchScalarBitForBit) {
  // dims below, at and across a vector and a 256-value block, most not a multiple of 16; token
  // counts around the interleaved groups (2, 4) and past a 64-token tile.
  const int64_t dims[] = {8, 40, 100, 256, 300, 1030};
  const int64_t counts[] = {1, 2, 3, 5, 9, 70};
  uint32_t seed = 1;
  for (int64_t dim : dims) {
    for (int64_t count : counts) {
      const Inputs in(4, dim, count, seed++);
      for (const Backend* be : fast_backends()) check_level(*be, in, describe(*be, dim, count));
    }
  }
}

TEST(MhcKernels, ReleasedWidth) {
  const Inputs in(4, 5120, 3, 99);
  for (const Backend* be : fast_backends()) check_level(*be, in, describe(*be, 5120, 3));
}

// Signed zeros (the chains start from +0, so -0 products must come out as the reference's), a stream
// copy that is all zero, a zero pre coefficient, huge values that overflow, and a NaN.
TEST(MhcKernels, SpecialValuesMatchScalar) {
  Inputs in(4, 72, 6, 7);
  const int64_t n = in.s.width(), d = in.s.dim;
  for (int64_t j = 0; j < n; ++j) in.X[0 * n + j] = j % 2 ? -0.0f : 0.0f;  // token 0: only zeros
  for (int64_t j = 0; j < d; ++j) in.y[0 * d + j] = -0.0f;
  in.pre[0] = 0.0f;
  in.pre[1] = -0.0f;
  for (int64_t j = 0; j < d; ++j) in.X[1 * n + 2 * d + j] = -0.0f;  // token 1: one copy of -0
  in.pre[1 * 4 + 3] = -0.0f;
  in.X[2 * n + 5] = 3.0e38f;  // token 2: the square overflows to inf
  in.X[2 * n + 6] = -3.0e38f;
  in.X[3 * n + 17] = std::numeric_limits<float>::quiet_NaN();  // token 3: a NaN spreads
  in.y[4 * d + 3] = std::numeric_limits<float>::infinity();    // token 4: inf from the sublayer
  for (const Backend* be : fast_backends()) check_level(*be, in, describe(*be, 72, 6) + " special");
}

// Another hc has no fast version: the fast entry points run the reference.
TEST(MhcKernels, OtherHcFallsBackToScalar) {
  const Inputs in(2, 24, 3, 5);
  for (const Backend* be : fast_backends()) check_level(*be, in, describe(*be, 24, 3) + " hc 2");
}

// The fused step of every backend, the scalar one included, against the unfused sequence.
TEST(MhcKernels, FusedStepMatchesUnfusedSequenceAtEveryLevel) {
  const Inputs in(4, 200, 7, 21);
  const Outputs want = unfused_step(in);
  for (const auto& be : op_backends()) {
    Outputs got(in);
    be->mhc_step(in.s, got.X.data(), in.y.data(), in.previous(), in.weights(), in.count, got.coefficients(),
                 got.u.data());
    expect_same(got, want, label(*be) + " mhc_step");
  }
}

// The model's API: hc_step is hc_post, then hc_mixes, then hc_pre with the previous pre.
TEST(MhcKernels, ModelStepMatchesPostMixesPre) {
  ModelConfig c;
  c.hc_mult = 4;
  c.dim = 136;
  c.norm_eps = 1e-6;
  c.hc_sinkhorn_iters = 20;
  c.hc_eps = 1e-6;
  const Inputs in(4, c.dim, 5, 33);
  Mixes prev;
  prev.pre = in.pre;
  prev.post = in.post;
  prev.comb = in.comb;
  for (const auto& backend : op_backends()) {
    const Backend& be = *backend;
    std::vector<float> X_fused = in.X, X_unfused = in.X;
    std::vector<float> u_fused(static_cast<size_t>(5 * c.dim)), u_unfused(u_fused.size());
    const Mixes fused = hc_step(be, c, X_fused.data(), in.y.data(), prev, in.fn, in.scale, in.base, 5, u_fused.data());
    hc_post(be, c, X_unfused.data(), in.y.data(), prev, 5);
    const Mixes unfused = hc_mixes(be, c, X_unfused.data(), 5, in.fn, in.scale, in.base);
    hc_pre(be, c, X_unfused.data(), prev.pre.data(), 5, u_unfused.data());
    const std::string what = label(be);
    EXPECT_EQ(first_difference(X_fused, X_unfused), "") << what;
    EXPECT_EQ(first_difference(u_fused, u_unfused), "") << what;
    EXPECT_EQ(first_difference(fused.pre, unfused.pre), "") << what;
    EXPECT_EQ(first_difference(fused.post, unfused.post), "") << what;
    EXPECT_EQ(first_difference(fused.comb, unfused.comb), "") << what;
    // and the same bits as the scalar reference, whatever the level
    const Outputs ref = unfused_step(in);
    EXPECT_EQ(first_difference(X_fused, ref.X), "") << what;
    EXPECT_EQ(first_difference(fused.comb, ref.comb), "") << what;
  }
}

}  // namespace
