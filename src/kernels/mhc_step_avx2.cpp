// AVX2 mHC kernels: the mixes' 24 dot products of a token in three ymm accumulators, two tokens
// interleaved, and the sum of squares one ymm per torch vector; expand and collapse 8 values at a
// time. The structure is in mhc_step_simd_impl.h; this file holds the vector operations.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cascade_sum.h"
#include "kernels/mhc_step.h"
#include "kernels/reference.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

// Compiled for AVX2 while the rest of the project stays baseline x86-64; it only runs after
// cpu_features() said so. No fusing of a multiply into a following add: the reference rounds every
// product before adding it.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#endif

namespace dsv41::detail::mhc_avx2 {

struct V {
  using F = __m256;
  static constexpr int W = 8;
  static constexpr int kTokens = 2;  // 2 tokens × 3 accumulator chains fit 16 registers with the operands
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static __m256i first(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static F load_first(const float* p, int64_t count) { return _mm256_maskload_ps(p, first(count)); }
  static void store_first(float* p, F v, int64_t count) { _mm256_maskstore_ps(p, first(count), v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  // round_bf16 lane by lane, as bf16_from_f32: nearest even, NaN kept quiet.
  static F round_bf16(F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};

// The cascade's vectors are torch's 8 lanes: one ymm.
using SumV = V;

#include "kernels/cascade_sum_simd_impl.h"
#include "kernels/mhc_step_simd_impl.h"

}  // namespace dsv41::detail::mhc_avx2

namespace dsv41::detail {

void mhc_mixes_avx2(const Exec& ex, const HcShape& s, const float* X, int64_t count, const HcMixWeights& w,
                    HcCoefficientsOut out) {
  if (s.hc != mhc_avx2::kHc) return reference::mhc_mixes(s, X, count, w, out);
  mhc_avx2::mixes(ex, s, X, count, w, out);
}
void mhc_collapse_avx2(const Exec& ex, const HcShape& s, const float* X, const float* pre, int64_t count, float* u) {
  if (s.hc != mhc_avx2::kHc) return reference::mhc_collapse(s, X, pre, count, u);
  mhc_avx2::collapse(ex, s, X, pre, count, u);
}
void mhc_expand_avx2(const Exec& ex, const HcShape& s, float* X, const float* y, const float* post, const float* comb,
                     int64_t count) {
  if (s.hc != mhc_avx2::kHc) return reference::mhc_expand(s, X, y, post, comb, count);
  mhc_avx2::expand(ex, s, X, y, post, comb, count);
}
void mhc_step_avx2(const Exec& ex, const HcShape& s, float* X, const float* y, const HcCoefficients& prev,
                   const HcMixWeights& next, int64_t count, HcCoefficientsOut out, float* u) {
  if (s.hc != mhc_avx2::kHc) return reference::mhc_step(s, X, y, prev, next, count, out, u);
  mhc_avx2::step(ex, s, X, y, prev, next, count, out, u);
}

}  // namespace dsv41::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86: the level is never available; the references stand in so the build links

namespace dsv41::detail {
void mhc_mixes_avx2(const Exec&, const HcShape& s, const float* X, int64_t count, const HcMixWeights& w,
                    HcCoefficientsOut out) {
  reference::mhc_mixes(s, X, count, w, out);
}
void mhc_collapse_avx2(const Exec&, const HcShape& s, const float* X, const float* pre, int64_t count, float* u) {
  reference::mhc_collapse(s, X, pre, count, u);
}
void mhc_expand_avx2(const Exec&, const HcShape& s, float* X, const float* y, const float* post, const float* comb,
                     int64_t count) {
  reference::mhc_expand(s, X, y, post, comb, count);
}
void mhc_step_avx2(const Exec&, const HcShape& s, float* X, const float* y, const HcCoefficients& prev,
                   const HcMixWeights& next, int64_t count, HcCoefficientsOut out, float* u) {
  reference::mhc_step(s, X, y, prev, next, count, out, u);
}
}  // namespace dsv41::detail

#endif
