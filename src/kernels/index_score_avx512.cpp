// AVX-512 indexer scores: 16 keys per vector. The structure is in index_score_simd_impl.h; this file
// holds the vector operations and the FP4 key decoder.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/index_score.h"
#include "kernels/linear_internal.h"
#include "kernels/reference.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

// Compiled for AVX-512 while the rest of the project stays baseline x86-64; it only runs after
// cpu_features() said so. No fusing of a multiply into the following add: the reference rounds
// every product.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
                             apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
// GCC 12's AVX-512 intrinsics start some results from a deliberately undefined vector, which -O3
// then reports as maybe-uninitialized inside the intrinsic headers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// A namespace of its own: the linear kernels' AVX-512 helpers live in detail::avx512.
namespace dsv41::detail::index_score_avx512 {

struct S {
  using F = __m512;
  using I = __m512i;
  static constexpr int W = 16;
  // Two packed dwords: 16 key vectors + 4 chains + operands fit the 32 registers.
  static constexpr int kColumnsPerPass = 2;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static I loadi(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }

  // Element j of each lane's dword, as e2m1_to_f32(code)·scale: vpermps looks the code up by the low
  // 4 bits of the lane (bit 3 = sign), so a shift is all the extraction needed.
  template <int J>
  static F nibble(I col, F scale) {
    const F lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f,
                                 -3.0f, -4.0f, -6.0f);
    const I code = J == 0 ? col : _mm512_srli_epi32(col, 4 * J);
    return _mm512_mul_ps(_mm512_permutexvar_ps(code, lut), scale);
  }
  static void decode8(I col, F scale, F* key) {
    key[0] = nibble<0>(col, scale);
    key[1] = nibble<1>(col, scale);
    key[2] = nibble<2>(col, scale);
    key[3] = nibble<3>(col, scale);
    key[4] = nibble<4>(col, scale);
    key[5] = nibble<5>(col, scale);
    key[6] = nibble<6>(col, scale);
    key[7] = nibble<7>(col, scale);
  }

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
  // std::max(x, 0.0f) is (x < 0) ? 0 : x; vmaxps(0, x) is (0 > x) ? 0 : x: the same for NaN and -0.
  static F relu(F x) { return _mm512_max_ps(_mm512_setzero_ps(), x); }
  static __mmask16 first(int n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFFu : (1u << n) - 1u); }
  static F hide_from(F v, int n) {
    return _mm512_mask_blend_ps(first(n), _mm512_set1_ps(-std::numeric_limits<float>::infinity()), v);
  }
  static void store_first(float* p, F v, int count) { _mm512_mask_storeu_ps(p, first(count), v); }
};

#include "kernels/index_score_simd_impl.h"

}  // namespace dsv41::detail::index_score_avx512

namespace dsv41::detail {

void index_scores_avx512(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                       const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores) {
  index_score_avx512::index_scores_simd(ex, q, weights, nq, nh, K, keys, n_keys, visible, scores);
}
void index_scores_in_pool_avx512(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh,
                               int64_t K, const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                               const std::vector<int32_t>* pools, int64_t block_size, float* scores) {
  index_score_avx512::index_scores_in_pool_simd(ex, q, weights, nq, nh, K, keys, n_keys, visible, pools, block_size,
                                              scores);
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
void index_scores_avx512(const Exec&, const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                       const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores) {
  reference::index_scores(q, weights, nq, nh, K, keys, n_keys, visible, scores);
}
void index_scores_in_pool_avx512(const Exec&, const float* q, const float* weights, int64_t nq, int64_t nh,
                               int64_t K, const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                               const std::vector<int32_t>* pools, int64_t block_size, float* scores) {
  reference::index_scores_in_pool(q, weights, nq, nh, K, keys, n_keys, visible, pools, block_size, scores);
}
}  // namespace dsv41::detail

#endif
