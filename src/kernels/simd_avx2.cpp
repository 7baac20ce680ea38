// AVX2 + FMA + F16C kernels: linear layers with 8 output rows per vector, and sparse attention.
// The structure is in linear_simd_impl.h and attention_simd_impl.h; this file holds the vector
// operations, the weight decoders and the activation quantizer.
#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cascade_sum.h"
#include "kernels/kv_rows.h"
#include "kernels/linear_internal.h"
#include "kernels/reference.h"
#include "kernels/torch_math.h"
#include "numeric/formats.h"
#include "numeric/quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

// Compiled for AVX2 while the rest of the project stays baseline x86-64; it only runs after
// cpu_features() said so. No fusing of a multiply into a following add (see simd_avx512.cpp).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#endif

namespace dsv41::detail::avx2 {

struct V {
  using F = __m256;
  static constexpr int W = 8;
  // Up to this many activation rows take the GEMV path: 2·2 partial + 2·2 accumulator chains in registers.
  static constexpr int kGemvRows = 2;
  static constexpr int MI = 3;  // 2·3 partial + 2·3 accumulator chains + 3 operands fit 16 registers
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }  // a < b ? a : b (b where either is NaN)
  static F max(F a, F b) { return _mm256_max_ps(a, b); }  // a > b ? a : b (b where either is NaN)
  static F xor_bits(F a, F b) { return _mm256_xor_ps(a, b); }
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
  static void store_first(float* p, F v, int count) {
    if (count == W) {
      _mm256_storeu_ps(p, v);
      return;
    }
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(p, mask, v);
  }
  static F e8m0(const uint8_t* codes);  // W E8M0 codes as fp32 (defined with the packed decoders)
  // 2^e lane by lane for e in [-126, 127], as fp32 bits
  static F pow2(__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  }
  // torch_exp (torch_math.h) lane by lane, the same operations in the same order.
  static F exp(F d) {
    using namespace torch_exp_constants;
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, set1(kLog2e)));  // to nearest even
    const F qf = _mm256_cvtepi32_ps(q);
    F s = _mm256_fmadd_ps(qf, set1(-kLn2Hi), d);
    s = _mm256_fmadd_ps(qf, set1(-kLn2Lo), s);
    F u = set1(kPoly[0]);
    for (int i = 1; i < 6; ++i) u = _mm256_fmadd_ps(u, s, set1(kPoly[i]));
    u = _mm256_add_ps(set1(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    const __m256i half = _mm256_srai_epi32(q, 1), rest = _mm256_sub_epi32(q, half);
    u = _mm256_mul_ps(_mm256_mul_ps(u, pow2(half)), pow2(rest));
    // out of range q is garbage and replaced; NaN compares false and stays NaN
    u = _mm256_andnot_ps(_mm256_cmp_ps(d, set1(kZeroBelow), _CMP_LT_OQ), u);
    return _mm256_blendv_ps(u, set1(std::numeric_limits<float>::infinity()), _mm256_cmp_ps(d, set1(kInfAbove), _CMP_GT_OQ));
  }
};

// Rows r and r+8 of a 16-row tile side by side in one ymm: 16 bytes of each.
inline __m256i pair_rows(const uint8_t* lo, const uint8_t* hi) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1);
}

// Byte transpose in each 128-bit lane: in[r] holds 16 bytes of row r (low lane) and of row r+8
// (high lane); out[f] then holds, per lane, byte 2f of the lane's 8 rows in its low half and byte
// 2f+1 in its high half.
inline void transpose_bytes(const __m256i in[8], __m256i out[8]) {
  __m256i s1[8], s2[8];
  for (int p = 0; p < 4; ++p) {  // s1[2p+h]: rows 2p, 2p+1; bytes 8h..8h+7
    s1[2 * p] = _mm256_unpacklo_epi8(in[2 * p], in[2 * p + 1]);
    s1[2 * p + 1] = _mm256_unpackhi_epi8(in[2 * p], in[2 * p + 1]);
  }
  for (int q = 0; q < 2; ++q) {  // s2[4q+g]: rows 4q..4q+3; bytes 4g..4g+3
    for (int h = 0; h < 2; ++h) {
      s2[4 * q + 2 * h] = _mm256_unpacklo_epi16(s1[4 * q + h], s1[4 * q + 2 + h]);
      s2[4 * q + 2 * h + 1] = _mm256_unpackhi_epi16(s1[4 * q + h], s1[4 * q + 2 + h]);
    }
  }
  for (int g = 0; g < 4; ++g) {  // out[f]: rows 0..7; bytes 2f, 2f+1
    out[2 * g] = _mm256_unpacklo_epi32(s2[g], s2[4 + g]);
    out[2 * g + 1] = _mm256_unpackhi_epi32(s2[g], s2[4 + g]);
  }
}

// Word transpose in each 128-bit lane: in[r] holds 8 words of row r (low lane) and of row r+8 (high
// lane); out[f] then holds word f of the lane's 8 rows.
inline void transpose_words(const __m256i in[8], __m256i out[8]) {
  __m256i s1[8], s2[8];
  for (int p = 0; p < 4; ++p) {  // s1[2p+x]: rows 2p, 2p+1; words 4x..4x+3
    s1[2 * p] = _mm256_unpacklo_epi16(in[2 * p], in[2 * p + 1]);
    s1[2 * p + 1] = _mm256_unpackhi_epi16(in[2 * p], in[2 * p + 1]);
  }
  for (int q = 0; q < 2; ++q) {  // s2[4q+g]: rows 4q..4q+3; words 2g, 2g+1
    for (int x = 0; x < 2; ++x) {
      s2[4 * q + 2 * x] = _mm256_unpacklo_epi32(s1[4 * q + x], s1[4 * q + 2 + x]);
      s2[4 * q + 2 * x + 1] = _mm256_unpackhi_epi32(s1[4 * q + x], s1[4 * q + 2 + x]);
    }
  }
  for (int g = 0; g < 4; ++g) {  // out[f]: rows 0..7; word f
    out[2 * g] = _mm256_unpacklo_epi64(s2[g], s2[4 + g]);
    out[2 * g + 1] = _mm256_unpackhi_epi64(s2[g], s2[4 + g]);
  }
}

// Tiles whose vector v holds rows 8v .. 8v+7 in lane order.
struct SplitRows {
  static int lane_row(int v, int lane) { return 8 * v + lane; }
  static void store(float* y, __m256 v0, __m256 v1, int count) {
    V::store_first(y, v0, std::min(count, 8));
    if (count > 8) V::store_first(y + 8, v1, count - 8);
  }
};

struct Fp8Dec : SplitRows {
  static constexpr int64_t kBlockBytes = 32;
  // fp16 placement of the e4m3 code, widened by vcvtph2ps: value·2^-8 exactly, the activations carry
  // the 2^8 (see simd_avx512.cpp).
  static constexpr float kActivationPrescale = 256.0f;

  // 16 codes (k, rows 0..7 then k+1, rows 0..7) as sign-extended words -> two vectors of 8 values.
  static void decode(__m128i codes, __m256& first, __m256& second) {
    const __m256i keep = _mm256_set1_epi16(static_cast<short>(0xBF80));
    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7), keep);
    first = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
    second = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
  }

  template <class Sink>
  static void step(const uint8_t* const* blk, int64_t b, Sink& sink, bool& nan) {
    const __m256i low7 = _mm256_set1_epi8(0x7F);
    __m256i top = _mm256_setzero_si256();
    sink.begin(b);
    for (int h = 0; h < 2; ++h) {  // bytes 16h .. 16h+15 of each row
      __m256i rows[8], t[8];
      for (int r = 0; r < 8; ++r) {
        rows[r] = pair_rows(blk[r] + 16 * h, blk[8 + r] + 16 * h);
        top = _mm256_max_epu8(top, _mm256_and_si256(rows[r], low7));
      }
      transpose_bytes(rows, t);
      for (int f = 0; f < 8; ++f) {  // k = 16h + 2f and 16h + 2f + 1
        __m256 a0, a1, b0, b1;
        decode(_mm256_castsi256_si128(t[f]), a0, a1);
        decode(_mm256_extracti128_si256(t[f], 1), b0, b1);
        sink.w(16 * h + 2 * f, a0, b0);
        sink.w(16 * h + 2 * f + 1, a1, b1);
      }
    }
    sink.end(b);
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(top, low7)) != 0) nan = true;
  }
};

struct Fp4Dec : SplitRows {
  static constexpr int64_t kBlockBytes = 16;

  // An E2M1 code in the low bits of each lane: magnitude by vpermps (low 3 bits), sign from bit 3;
  // bits above the nibble are ignored.
  static __m256 nibbles(__m256i d) {
    const __m256 mag = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f), d);
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(d, 28), _mm256_set1_epi32(static_cast<int>(0x80000000u)));
    return _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
  }

  template <class Sink>
  static void step(const uint8_t* const* blk, int64_t b, Sink& sink, bool&) {
    __m256i rows[8], t[8];
    for (int r = 0; r < 8; ++r) rows[r] = pair_rows(blk[r], blk[8 + r]);
    transpose_bytes(rows, t);
    sink.begin(b);
    for (int f = 0; f < 8; ++f) {  // bytes 2f, 2f+1 hold k = 4f .. 4f+3, low nibble first
      const __m128i lo = _mm256_castsi256_si128(t[f]), hi = _mm256_extracti128_si256(t[f], 1);
      const __m256i a0 = _mm256_cvtepu8_epi32(lo), a1 = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
      const __m256i b0 = _mm256_cvtepu8_epi32(hi), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
      sink.w(4 * f, nibbles(a0), nibbles(b0));
      sink.w(4 * f + 1, nibbles(_mm256_srli_epi32(a0, 4)), nibbles(_mm256_srli_epi32(b0, 4)));
      sink.w(4 * f + 2, nibbles(a1), nibbles(b1));
      sink.w(4 * f + 3, nibbles(_mm256_srli_epi32(a1, 4)), nibbles(_mm256_srli_epi32(b1, 4)));
    }
    sink.end(b);
  }
};

struct Bf16Dec : SplitRows {
  static constexpr int64_t kBlockBytes = 64;

  static __m256 widen(__m128i words) {  // bf16 -> fp32 is a 16-bit shift
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
  }

  template <class Sink>
  static void step(const uint8_t* const* blk, int64_t b, Sink& sink, bool&) {
    sink.begin(b);
    for (int e = 0; e < 4; ++e) {  // k 8e .. 8e+7
      __m256i rows[8], t[8];
      for (int r = 0; r < 8; ++r) rows[r] = pair_rows(blk[r] + 16 * e, blk[8 + r] + 16 * e);
      transpose_words(rows, t);
      for (int f = 0; f < 8; ++f) {
        sink.w(8 * e + f, widen(_mm256_castsi256_si128(t[f])), widen(_mm256_extracti128_si256(t[f], 1)));
      }
    }
    sink.end(b);
  }
};

// ---- packed tiles (packed_weights.h): one column of 16 rows side by side, rows 0..7 in v0 ---------

// 8 E8M0 codes as fp32 lanes: the code is the exponent field, except 0 (the subnormal 2^-127) and
// 0xFF (NaN), as e8m0_to_f32.
inline __m256 V::e8m0(const uint8_t* codes) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  __m256i bits = _mm256_slli_epi32(c, 23);
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(c, _mm256_setzero_si256()));
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000), _mm256_cmpeq_epi32(c, _mm256_set1_epi32(0xFF)));
  return _mm256_castsi256_ps(bits);
}

struct Fp8PackedDec : SplitRows {
  static constexpr int64_t kBlockBytes = 32;  // of one row per K block
  template <class Sink>
  static void step(const uint8_t* p, int64_t b, Sink& sink) {
    sink.begin(b);
    for (int j = 0; j < 32; ++j) {
      __m256 v0, v1;
      Fp8Dec::decode(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * j)), v0, v1);
      sink.w(j, v0, v1);
    }
    sink.end(b);
  }
};

struct Fp4PackedDec : SplitRows {
  static constexpr int64_t kBlockBytes = 16;
  template <class Sink>
  static void step(const uint8_t* p, int64_t b, Sink& sink) {
    sink.begin(b);
    for (int q = 0; q < 16; ++q) {  // column q: k = 2q (low nibbles) and 2q+1 (high nibbles)
      const uint8_t* c = p + 16 * q;
      const __m256i d0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
      const __m256i d1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8)));
      sink.w(2 * q, Fp4Dec::nibbles(d0), Fp4Dec::nibbles(d1));
      sink.w(2 * q + 1, Fp4Dec::nibbles(_mm256_srli_epi32(d0, 4)), Fp4Dec::nibbles(_mm256_srli_epi32(d1, 4)));
    }
    sink.end(b);
  }
};

struct Bf16PackedDec : SplitRows {
  static constexpr int64_t kBlockBytes = 64;
  template <class Sink>
  static void step(const uint8_t* p, int64_t b, Sink& sink) {
    sink.begin(b);
    for (int j = 0; j < 32; ++j) {
      const __m128i* c = reinterpret_cast<const __m128i*>(p + 32 * j);
      sink.w(j, Bf16Dec::widen(_mm_loadu_si128(c)), Bf16Dec::widen(_mm_loadu_si128(c + 1)));
    }
    sink.end(b);
  }
};

// act_quant_fp8 of one row with the e4m3 values, times `prescale`, written as fp32: the same
// operations lane by lane (see simd_avx512.cpp for why each step matches quant.cpp).
inline void quantize_row(const float* x, int64_t k, float prescale, float* out, float* scales) {
  const __m256i abs_bits = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256 max_e4m3 = _mm256_set1_ps(448.0f);
  const __m256i min_exp = _mm256_set1_epi32(121 << 23);
  const __m256i inv_base = _mm256_set1_epi32(static_cast<int>(257u << 23));
  const __m256i three = _mm256_set1_epi32(3 << 23);
  const __m256 qnan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
  const __m256 pre = _mm256_set1_ps(prescale);
  for (int64_t b = 0; b < k / kQBlock; ++b) {
    const float* xb = x + b * kQBlock;
    __m256 m = _mm256_setzero_ps();
    for (int h = 0; h < 4; ++h) {
      const __m256i xi = _mm256_castps_si256(_mm256_loadu_ps(xb + 8 * h));
      const __m256 a = _mm256_castsi256_ps(_mm256_and_si256(xi, abs_bits));
      m = _mm256_max_ps(a, m);  // a NaN |x| leaves m as it was
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = std::max(_mm_cvtss_f32(m4), 1e-4f);
    const float s = pow2_ceil_scale(amax, 1.0f / 448.0f);
    scales[b] = s;
    const __m256 sv = _mm256_set1_ps(s);
    for (int h = 0; h < 4; ++h) {
      const __m256 v = _mm256_div_ps(_mm256_loadu_ps(xb + 8 * h), sv);
      const __m256i vb = _mm256_castps_si256(v);
      const __m256 a = _mm256_min_ps(_mm256_castsi256_ps(_mm256_and_si256(vb, abs_bits)), max_e4m3);
      const __m256i e = _mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7F800000)),
                                         min_exp);
      const __m256 inv = _mm256_castsi256_ps(_mm256_sub_epi32(inv_base, e));
      const __m256 step = _mm256_castsi256_ps(_mm256_sub_epi32(e, three));
      const __m256 q = _mm256_round_ps(_mm256_mul_ps(a, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m256 r = _mm256_mul_ps(q, step);
      r = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(r), _mm256_andnot_si256(abs_bits, vb)));
      r = _mm256_blendv_ps(r, qnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      _mm256_storeu_ps(out + b * kQBlock + 8 * h, _mm256_mul_ps(r, pre));
    }
  }
}

#include "kernels/linear_simd_impl.h"
#include "kernels/attention_simd_impl.h"
#include "kernels/dense_attention_simd_impl.h"
#include "kernels/swiglu_simd_impl.h"

}  // namespace dsv41::detail::avx2

namespace dsv41::detail {

void linear_fp8_avx2(const Exec& ex, const float* x, int64_t m, const Fp8Matrix& w, float* y) {
  avx2::run_linear<avx2::Fp8Kind>(ex, x, m, w, y);
}
void linear_fp4_avx2(const Exec& ex, const float* x, int64_t m, const Fp4Matrix& w, float* y) {
  avx2::run_linear<avx2::Fp4Kind>(ex, x, m, w, y);
}
void linear_bf16_avx2(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  avx2::run_linear<avx2::Bf16Kind<false>>(ex, x, m, w, y);
}
void linear_f32_avx2(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  // activations that are all bf16 values (the vision tower's) take linear_bf16's FMA path, unrounded
  if (avx2::all_bf16_values(x, m * w.k)) return avx2::run_linear<avx2::Bf16Kind<false, false>>(ex, x, m, w, y);
  avx2::run_linear<avx2::Bf16Kind<true>>(ex, x, m, w, y);
}
QuantizedActivations quantize_activations_avx2(const float* x, int64_t m, int64_t k, float prescale) {
  return avx2::quantize_rows(nullptr, x, m, k, prescale, false);
}
void sparse_attention_avx2(const Exec& ex, const float* q, int64_t heads, int64_t d, const KvRows& rows,
                          const float* sink, float scale, float* out) {
  avx2::sparse_attention_simd(ex, q, heads, d, rows, sink, scale, out);
}
void dense_attention_avx2(const Exec& ex, const float* q, const float* k, const float* v, int64_t n, int64_t heads,
                          int64_t d, int64_t stride, float scale, float* out) {
  avx2::dense_attention_simd(ex, q, k, v, n, heads, d, stride, scale, out);
}

void swiglu_avx2(const Exec& ex, float* gate, const float* up, int64_t m, int64_t n, float limit,
                 const float* row_weights) {
  avx2::swiglu_simd(ex, gate, up, m, n, limit, row_weights);
}

}  // namespace dsv41::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // not x86: the level is never available; the references stand in so the build links

namespace dsv41::detail {
void linear_fp8_avx2(const Exec&, const float* x, int64_t m, const Fp8Matrix& w, float* y) {
  reference::linear_fp8(x, m, w, y);
}
void linear_fp4_avx2(const Exec&, const float* x, int64_t m, const Fp4Matrix& w, float* y) {
  reference::linear_fp4(x, m, w, y);
}
void linear_bf16_avx2(const Exec&, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  reference::linear_bf16(x, m, w, y);
}
void linear_f32_avx2(const Exec&, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  reference::linear_f32(x, m, w, y);
}
QuantizedActivations quantize_activations_avx2(const float* x, int64_t m, int64_t k, float prescale) {
  return quantize_activations(x, m, k, prescale);
}
void sparse_attention_avx2(const Exec&, const float* q, int64_t heads, int64_t d, const KvRows& rows,
                          const float* sink, float scale, float* out) {
  reference::sparse_attention(q, heads, d, rows, sink, scale, out);
}
void dense_attention_avx2(const Exec&, const float* q, const float* k, const float* v, int64_t n, int64_t heads,
                          int64_t d, int64_t stride, float scale, float* out) {
  reference::dense_attention(q, k, v, n, heads, d, stride, scale, out);
}
void swiglu_avx2(const Exec&, float* gate, const float* up, int64_t m, int64_t n, float limit,
                 const float* row_weights) {
  reference::swiglu(gate, up, m, n, limit, row_weights);
}
}  // namespace dsv41::detail

#endif
