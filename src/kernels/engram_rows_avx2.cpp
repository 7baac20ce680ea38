// AVX2 Engram row dequantization: 8 values per vector (the decoding is explained in
// engram_rows_avx512.cpp).
#include <cstdint>

#include "kernels/engram_rows.h"
#include "kernels/linear_internal.h"
#include "kernels/reference.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

// Compiled for AVX2 while the rest of the project stays baseline x86-64; it only runs after
// cpu_features() said so.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#endif

namespace dsv41::detail {

namespace {

// round_bf16 lane by lane, as bf16_from_f32: nearest even, NaN kept quiet.
__m256 round_bf16_x8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
  const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 8 e4m3 codes (8 fp16-placed words) as e4m3_to_f32 gives them; NaN codes decode to ±480 first.
__m256 e4m3_x8(__m128i half) {
  const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
  const __m256 nan = _mm256_cmp_ps(magnitude, _mm256_set1_ps(480.0f), _CMP_EQ_OQ);
  return _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
}

}  // namespace

void dequantize_fp8_blocks_avx2(const uint8_t* codes, const uint8_t* scales, int64_t blocks, float* out) {
  const float* e8m0 = e8m0_table();  // e8m0_to_f32 by code
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256 scale = _mm256_set1_ps(e8m0[scales[b]]);
    for (int h = 0; h < 2; ++h) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + b * 32 + 16 * h));
      // s.eeee.mmm -> s.0eeee.mmm0000000: the fp16 number value·2^-8
      const __m256i words = _mm256_cvtepu8_epi16(bytes);
      const __m256i half = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(words, 8), 1),
                                            _mm256_set1_epi16(static_cast<short>(0xBF80)));
      float* o = out + b * 32 + 16 * h;
      _mm256_storeu_ps(o, round_bf16_x8(_mm256_mul_ps(e4m3_x8(_mm256_castsi256_si128(half)), scale)));
      _mm256_storeu_ps(o + 8, round_bf16_x8(_mm256_mul_ps(e4m3_x8(_mm256_extracti128_si256(half, 1)), scale)));
    }
  }
}

}  // namespace dsv41::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86: the level is never available; the reference stands in so the build links

namespace dsv41::detail {
void dequantize_fp8_blocks_avx2(const uint8_t* codes, const uint8_t* scales, int64_t blocks, float* out) {
  reference::engram_rows(codes, scales, blocks, 32, out);
}
}  // namespace dsv41::detail

#endif
