// Kernels of the mHC residual stream (model-spec §3.2): hc copies of dim values per token, mixed
// around every sublayer. Three operations, in the reference's numerics:
//  * mixes:    one rsqrt over all hc·dim values of a token, (2+hc)·hc fp32 dot products of length
//              hc·dim with `fn`, then hc_split_sinkhorn -> pre, post, comb;
//  * collapse: u[j] = Σ_c pre[c]·X[c][j] (hc_pre), fp32, one bf16 rounding;
//  * expand:   X'[k][j] = post[k]·y[j] + Σ_src comb[src][k]·X[src][j] (hc_post), one bf16 rounding.
// Between two sublayers the model runs expand (of the sublayer just done), then the next sublayer's
// mixes on the new stream, then its collapse with the `pre` the previous mixes produced (V4.1 hands
// `pre` on by one sublayer). mhc_step does the three in one pass over the stream.
//
// Summation chains, which every version keeps bit for bit: each dot product and the sum of squares
// is one sequential fp32 chain over the token's hc·dim values in index order (copy-major), each
// product rounded before it is added (no fused multiply-add); the expand's and the collapse's sums
// run over the copies in index order, starting from 0.
#pragma once

#include <cstdint>

namespace dsv41 {

struct HcShape {
  int64_t hc = 4, dim = 0;
  float norm_eps = 0.0f;  // inside the rsqrt of the mixes
  int sinkhorn_iters = 20;
  float hc_eps = 1e-6f;
  int64_t width() const { return hc * dim; }          // values per token
  int64_t mix_count() const { return (2 + hc) * hc; }  // dot products per token
};

// One sublayer's mix weights, fp32: fn[(2+hc)·hc, hc·dim], scale[3], base[(2+hc)·hc].
struct HcMixWeights {
  const float* fn = nullptr;
  const float* scale = nullptr;
  const float* base = nullptr;
};

// Per-token coefficients of one sublayer: pre[count·hc], post[count·hc], comb[count·hc·hc]
// (comb[j·hc + k]: row j = source copy, column k = destination copy).
struct HcCoefficients {
  const float* pre = nullptr;
  const float* post = nullptr;
  const float* comb = nullptr;
};
struct HcCoefficientsOut {
  float* pre = nullptr;
  float* post = nullptr;
  float* comb = nullptr;
};

// X is [count, hc, dim]; y and u are [count, dim]. The fast versions split tokens over the kernel
// thread pool; results do not depend on the split.
void mhc_mixes(const HcShape& s, const float* X, int64_t count, const HcMixWeights& w, HcCoefficientsOut out);
void mhc_collapse(const HcShape& s, const float* X, const float* pre, int64_t count, float* u);
void mhc_expand(const HcShape& s, float* X, const float* y, const float* post, const float* comb, int64_t count);
// expand with `prev` (post, comb) and y; then the mixes of `next` from the new X into `out`; then
// the collapse of the new X with prev.pre into u. Same bits as those three calls.
void mhc_step(const HcShape& s, float* X, const float* y, const HcCoefficients& prev, const HcMixWeights& next,
              int64_t count, HcCoefficientsOut out, float* u);

namespace detail {

// The scalar references (single-threaded). mhc_step_scalar is the unfused sequence itself.
void mhc_mixes_scalar(const HcShape& s, const float* X, int64_t count, const HcMixWeights& w, HcCoefficientsOut out);
void mhc_collapse_scalar(const HcShape& s, const float* X, const float* pre, int64_t count, float* u);
void mhc_expand_scalar(const HcShape& s, float* X, const float* y, const float* post, const float* comb,
                       int64_t count);
void mhc_step_scalar(const HcShape& s, float* X, const float* y, const HcCoefficients& prev,
                     const HcMixWeights& next, int64_t count, HcCoefficientsOut out, float* u);

// The fast versions. Each needs its ISA (isa_supported) and hc = 4 (the released value: 24 mixes);
// for another hc, or on a build without x86 SIMD, they run the scalar reference.
void mhc_mixes_avx2(const HcShape& s, const float* X, int64_t count, const HcMixWeights& w, HcCoefficientsOut out);
void mhc_collapse_avx2(const HcShape& s, const float* X, const float* pre, int64_t count, float* u);
void mhc_expand_avx2(const HcShape& s, float* X, const float* y, const float* post, const float* comb,
                     int64_t count);
void mhc_step_avx2(const HcShape& s, float* X, const float* y, const HcCoefficients& prev, const HcMixWeights& next,
                   int64_t count, HcCoefficientsOut out, float* u);

void mhc_mixes_avx512(const HcShape& s, const float* X, int64_t count, const HcMixWeights& w, HcCoefficientsOut out);
void mhc_collapse_avx512(const HcShape& s, const float* X, const float* pre, int64_t count, float* u);
void mhc_expand_avx512(const HcShape& s, float* X, const float* y, const float* post, const float* comb,
                       int64_t count);
void mhc_step_avx512(const HcShape& s, float* X, const float* y, const HcCoefficients& prev,
                     const HcMixWeights& next, int64_t count, HcCoefficientsOut out, float* u);

}  // namespace detail

}  // namespace dsv41
