// The fast mHC kernels (the ops and their numerics are in kernels/backend.h; the references in
// kernels/reference.h). The residual stream (model-spec §3.2) holds hc copies of dim values per
// token, mixed around every sublayer. Three operations:
//  * mixes:    one rsqrt over all hc·dim values of a token, (2+hc)·hc fp32 dot products of length
//              hc·dim with `fn`, then hc_split_sinkhorn -> pre, post, comb;
//  * collapse: u[j] = Σ_c pre[c]·X[c][j] (hc_pre), fp32, one bf16 rounding;
//  * expand:   X'[k][j] = post[k]·y[j] + Σ_src comb[src][k]·X[src][j] (hc_post), one bf16 rounding.
// Between two sublayers the model runs expand (of the sublayer just done), then the next sublayer's
// mixes on the new stream, then its collapse with the `pre` the previous mixes produced (V4.1 hands
// `pre` on by one sublayer). mhc_step does the three in one pass over the stream.
//
// Summation orders, which every version keeps bit for bit: each dot product is one sequential fp32
// chain over the token's hc·dim values in index order (copy-major), each product rounded before it
// is added (no fused multiply-add); the sum of squares is torch's cascade (cascade_sum.h); the
// expand's and the collapse's sums run over the copies in index order, starting from 0.
#pragma once

#include <cstdint>

#include "kernels/exec.h"
#include "kernels/op_types.h"

namespace dsv41::detail {

// Each needs its ISA (isa_supported) and hc = 4 (the released value: 24 mixes); for another hc, or on
// a build without x86 SIMD, they run the scalar reference. Tokens are split over exec's workers;
// results do not depend on the split.
void mhc_mixes_avx2(const Exec& ex, const HcShape& s, const float* X, int64_t count, const HcMixWeights& w,
                    HcCoefficientsOut out);
void mhc_collapse_avx2(const Exec& ex, const HcShape& s, const float* X, const float* pre, int64_t count, float* u);
void mhc_expand_avx2(const Exec& ex, const HcShape& s, float* X, const float* y, const float* post, const float* comb,
                     int64_t count);
void mhc_step_avx2(const Exec& ex, const HcShape& s, float* X, const float* y, const HcCoefficients& prev,
                   const HcMixWeights& next, int64_t count, HcCoefficientsOut out, float* u);

void mhc_mixes_avx512(const Exec& ex, const HcShape& s, const float* X, int64_t count, const HcMixWeights& w,
                      HcCoefficientsOut out);
void mhc_collapse_avx512(const Exec& ex, const HcShape& s, const float* X, const float* pre, int64_t count,
                         float* u);
void mhc_expand_avx512(const Exec& ex, const HcShape& s, float* X, const float* y, const float* post,
                       const float* comb, int64_t count);
void mhc_step_avx512(const Exec& ex, const HcShape& s, float* X, const float* y, const HcCoefficients& prev,
                     const HcMixWeights& next, int64_t count, HcCoefficientsOut out, float* u);

}  // namespace dsv41::detail
