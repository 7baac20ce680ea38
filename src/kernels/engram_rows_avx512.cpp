// AVX-512 Engram row dequantization: 16 values per vector.
#include <cstdint>

#include "kernels/engram_rows.h"
#include "kernels/linear_internal.h"
#include "kernels/reference.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

// Compiled for AVX-512 while the rest of the project stays baseline x86-64; it only runs after
// cpu_features() said so.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
                             apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 intrinsic headers
#endif

namespace dsv41::detail {

namespace {

// round_bf16 lane by lane, as bf16_from_f32: nearest even, NaN kept quiet.
__m512 round_bf16_x16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  const __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i r = _mm512_mask_blend_epi32(nan, rounded, quiet);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 16 e4m3 codes as e4m3_to_f32 gives them. The code moved into fp16 position (s.eeee.mmm ->
// s.0eeee.mmm0000000) is the fp16 number value·2^-8, subnormals included; vcvtph2ps widens it exactly
// and ·256 is exact. The NaN codes (S.1111.111) land on ±480, which no finite code decodes to, and
// become the quiet NaN e4m3_to_f32 returns.
__m512 e4m3_x16(__m128i bytes) {
  const __m256i words = _mm256_cvtepu8_epi16(bytes);
  const __m256i half = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(words, 8), 1),
                                        _mm256_set1_epi16(static_cast<short>(0xBF80)));
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
  const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(480.0f), _CMP_EQ_OQ);
  return _mm512_mask_blend_ps(nan, v, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}

}  // namespace

void dequantize_fp8_blocks_avx512(const uint8_t* codes, const uint8_t* scales, int64_t blocks, float* out) {
  const float* e8m0 = e8m0_table();  // e8m0_to_f32 by code
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 scale = _mm512_set1_ps(e8m0[scales[b]]);
    for (int h = 0; h < 2; ++h) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + b * 32 + 16 * h));
      _mm512_storeu_ps(out + b * 32 + 16 * h, round_bf16_x16(_mm512_mul_ps(e4m3_x16(bytes), scale)));
    }
  }
}

}  // namespace dsv41::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#else  // not x86: the level is never available; the reference stands in so the build links

namespace dsv41::detail {
void dequantize_fp8_blocks_avx512(const uint8_t* codes, const uint8_t* scales, int64_t blocks, float* out) {
  reference::engram_rows(codes, scales, blocks, 32, out);
}
}  // namespace dsv41::detail

#endif
