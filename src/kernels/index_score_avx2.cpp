// AVX2 indexer scores: 8 keys per vector. The structure is in index_score_simd_impl.h; this file
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

// Compiled for AVX2 while the rest of the project stays baseline x86-64; it only runs after
// cpu_features() said so. No fusing of a multiply into the following add: the reference rounds
// every product.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#endif

// A namespace of its own: the linear kernels' AVX2 helpers live in detail::avx2.
namespace dsv41::detail::index_score_avx2 {

struct S {
  using F = __m256;
  using I = __m256i;
  static constexpr int W = 8;
  // One packed dword: 8 key vectors + 4 chains + operands fit the 16 registers.
  static constexpr int kColumnsPerPass = 1;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static I loadi(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }

  // Element j of each lane's dword, as e2m1_to_f32(code)·scale: vpermps looks the magnitude up by the
  // low 3 bits of the lane, and the code's bit 3 is moved to the sign bit.
  template <int J>
  static F nibble(I col, F scale) {
    const F magnitude = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const I code = J == 0 ? col : _mm256_srli_epi32(col, 4 * J);
    const I sign = _mm256_and_si256(J == 7 ? col : _mm256_slli_epi32(col, 28 - 4 * J),
                                    _mm256_set1_epi32(static_cast<int>(0x80000000u)));
    const F value = _mm256_or_ps(_mm256_permutevar8x32_ps(magnitude, code), _mm256_castsi256_ps(sign));
    return _mm256_mul_ps(value, scale);
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
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // std::max(x, 0.0f) is (x < 0) ? 0 : x; vmaxps(0, x) is (0 > x) ? 0 : x: the same for NaN and -0.
  static F relu(F x) { return _mm256_max_ps(_mm256_setzero_ps(), x); }
  static I first(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
  static F hide_from(F v, int n) {
    return _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), v, _mm256_castsi256_ps(first(n)));
  }
  static void store_first(float* p, F v, int count) { _mm256_maskstore_ps(p, first(count), v); }
};

#include "kernels/index_score_simd_impl.h"

}  // namespace dsv41::detail::index_score_avx2

namespace dsv41::detail {

void index_scores_avx2(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                       const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores) {
  index_score_avx2::index_scores_simd(ex, q, weights, nq, nh, K, keys, n_keys, visible, scores);
}
void index_scores_in_pool_avx2(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh,
                               int64_t K, const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                               const std::vector<int32_t>* pools, int64_t block_size, float* scores) {
  index_score_avx2::index_scores_in_pool_simd(ex, q, weights, nq, nh, K, keys, n_keys, visible, pools, block_size,
                                              scores);
}

}  // namespace dsv41::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86: the level is never available; the references stand in so the build links

namespace dsv41::detail {
void index_scores_avx2(const Exec&, const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                       const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores) {
  reference::index_scores(q, weights, nq, nh, K, keys, n_keys, visible, scores);
}
void index_scores_in_pool_avx2(const Exec&, const float* q, const float* weights, int64_t nq, int64_t nh,
                               int64_t K, const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                               const std::vector<int32_t>* pools, int64_t block_size, float* scores) {
  reference::index_scores_in_pool(q, weights, nq, nh, K, keys, n_keys, visible, pools, block_size, scores);
}
}  // namespace dsv41::detail

#endif
