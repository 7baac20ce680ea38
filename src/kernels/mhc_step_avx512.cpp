// AVX-512 (F/BW/VL/DQ) mHC kernels: the mixes' 24 dot products of a token in two zmm accumulators,
// four tokens interleaved, and the sum of squares one ymm per torch vector; expand and collapse 16
// values at a time. The structure is in mhc_step_simd_impl.h; this file holds the vector operations.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cascade_sum.h"
#include "kernels/mhc_step.h"
#include "kernels/reference.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

// Compiled for AVX-512 while the rest of the project stays baseline x86-64; it only runs after
// cpu_features() said so. No fusing of a multiply into a following add: the reference rounds every
// product before adding it.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
                             apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
// GCC 12's AVX-512 intrinsics start some results from a deliberately undefined vector (`__Y = __Y`),
// which -O3 then reports as maybe-uninitialized inside the intrinsic headers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace dsv41::detail::mhc_avx512 {

struct V {
  using F = __m512;
  static constexpr int W = 16;
  static constexpr int kTokens = 4;  // 4 tokens × 2 accumulator chains hide the add latency
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static __mmask16 first(int64_t count) { return static_cast<__mmask16>((1u << count) - 1u); }
  static F load_first(const float* p, int64_t count) { return _mm512_maskz_loadu_ps(first(count), p); }
  static void store_first(float* p, F v, int64_t count) { _mm512_mask_storeu_ps(p, first(count), v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  // round_bf16 lane by lane, as bf16_from_f32: nearest even, NaN kept quiet.
  static F round_bf16(F x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
    const __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i r = _mm512_mask_blend_epi32(nan, rounded, quiet);
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};

// The cascade's vectors are torch's 8 lanes (its AVX2 kernels, cascade_sum.h): one ymm each.
struct SumV {
  using F = __m256;
  static constexpr int W = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
};

#include "kernels/cascade_sum_simd_impl.h"
#include "kernels/mhc_step_simd_impl.h"

}  // namespace dsv41::detail::mhc_avx512

namespace dsv41::detail {

void mhc_mixes_avx512(const Exec& ex, const HcShape& s, const float* X, int64_t count, const HcMixWeights& w,
                    HcCoefficientsOut out) {
  if (s.hc != mhc_avx512::kHc) return reference::mhc_mixes(s, X, count, w, out);
  mhc_avx512::mixes(ex, s, X, count, w, out);
}
void mhc_collapse_avx512(const Exec& ex, const HcShape& s, const float* X, const float* pre, int64_t count, float* u) {
  if (s.hc != mhc_avx512::kHc) return reference::mhc_collapse(s, X, pre, count, u);
  mhc_avx512::collapse(ex, s, X, pre, count, u);
}
void mhc_expand_avx512(const Exec& ex, const HcShape& s, float* X, const float* y, const float* post, const float* comb,
                     int64_t count) {
  if (s.hc != mhc_avx512::kHc) return reference::mhc_expand(s, X, y, post, comb, count);
  mhc_avx512::expand(ex, s, X, y, post, comb, count);
}
void mhc_step_avx512(const Exec& ex, const HcShape& s, float* X, const float* y, const HcCoefficients& prev,
                   const HcMixWeights& next, int64_t count, HcCoefficientsOut out, float* u) {
  if (s.hc != mhc_avx512::kHc) return reference::mhc_step(s, X, y, prev, next, count, out, u);
  mhc_avx512::step(ex, s, X, y, prev, next, count, out, u);
}

}  // namespace dsv41::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#else  // not x86: the level is never available; the references stand in so the build links

namespace dsv41::detail {
void mhc_mixes_avx512(const Exec&, const HcShape& s, const float* X, int64_t count, const HcMixWeights& w,
                    HcCoefficientsOut out) {
  reference::mhc_mixes(s, X, count, w, out);
}
void mhc_collapse_avx512(const Exec&, const HcShape& s, const float* X, const float* pre, int64_t count, float* u) {
  reference::mhc_collapse(s, X, pre, count, u);
}
void mhc_expand_avx512(const Exec&, const HcShape& s, float* X, const float* y, const float* post, const float* comb,
                     int64_t count) {
  reference::mhc_expand(s, X, y, post, comb, count);
}
void mhc_step_avx512(const Exec&, const HcShape& s, float* X, const float* y, const HcCoefficients& prev,
                   const HcMixWeights& next, int64_t count, HcCoefficientsOut out, float* u) {
  reference::mhc_step(s, X, y, prev, next, count, out, u);
}
}  // namespace dsv41::detail

#endif
