// The AVX-512 vector operations, weight decoders and activation quantizer that the AVX-512 level
// (simd_avx512.cpp) and the AVX-512-BF16 level (simd_avx512_bf16.cpp) share: see the structure in
// linear_simd_impl.h.
//
// This header has no include guard on purpose: each of those files includes it once, inside its own
// target region and namespace, after <immintrin.h>.

struct V {
  using F = __m512;
  static constexpr int W = 16;
  // Up to this many activation rows take the GEMV path: 2·4 partial + 2·4 accumulator chains in registers.
  static constexpr int kGemvRows = 4;
  static constexpr int MI = 6;  // 2·6 partial + 2·6 accumulator chains + 3 operands fit 32 registers
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }  // a < b ? a : b (b where either is NaN)
  static F max(F a, F b) { return _mm512_max_ps(a, b); }  // a > b ? a : b (b where either is NaN)
  static F xor_bits(F a, F b) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
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
  static void store_first(float* p, F v, int count) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << count) - 1u), v);
  }
  static F e8m0(const uint8_t* codes);  // W E8M0 codes as fp32 (defined with the packed decoders)
  // 2^e lane by lane for e in [-126, 127], as fp32 bits
  static F pow2(__m512i e) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127)), 23));
  }
  // torch_exp (torch_math.h) lane by lane, the same operations in the same order.
  static F exp(F d) {
    using namespace torch_exp_constants;
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, set1(kLog2e)));  // to nearest even
    const F qf = _mm512_cvtepi32_ps(q);
    F s = _mm512_fmadd_ps(qf, set1(-kLn2Hi), d);
    s = _mm512_fmadd_ps(qf, set1(-kLn2Lo), s);
    F u = set1(kPoly[0]);
    for (int i = 1; i < 6; ++i) u = _mm512_fmadd_ps(u, s, set1(kPoly[i]));
    u = _mm512_add_ps(set1(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    const __m512i half = _mm512_srai_epi32(q, 1), rest = _mm512_sub_epi32(q, half);
    u = _mm512_mul_ps(_mm512_mul_ps(u, pow2(half)), pow2(rest));
    // out of range q is garbage and replaced; NaN compares false and stays NaN
    u = _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(d, set1(kZeroBelow), _CMP_LT_OQ)), u);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(d, set1(kInfAbove), _CMP_GT_OQ), u,
                                set1(std::numeric_limits<float>::infinity()));
  }
};

// Rows r and r+16 of a 32-row tile side by side in one ymm: 16 bytes of each (from memory, the
// insert needs no shuffle port).
inline __m256i pair_rows(const uint8_t* lo, const uint8_t* hi) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1);
}

// Byte transpose in each 128-bit lane: in[r] holds 16 bytes of row r (low lane) and of row r+16
// (high lane); out[q] then holds byte q of rows 0..15 (low lane) and of rows 16..31 (high lane).
// Four unpack stages, each doubling the run of bytes from one row.
inline void transpose_bytes(const __m256i in[16], __m256i out[16]) {
  __m256i s1[16], s2[16], s3[16];
  for (int p = 0; p < 8; ++p) {  // s1[2p+h]: rows 2p, 2p+1; bytes 8h..8h+7
    s1[2 * p] = _mm256_unpacklo_epi8(in[2 * p], in[2 * p + 1]);
    s1[2 * p + 1] = _mm256_unpackhi_epi8(in[2 * p], in[2 * p + 1]);
  }
  for (int q = 0; q < 4; ++q) {  // s2[4q+g]: rows 4q..4q+3; bytes 4g..4g+3
    for (int h = 0; h < 2; ++h) {
      s2[4 * q + 2 * h] = _mm256_unpacklo_epi16(s1[4 * q + h], s1[4 * q + 2 + h]);
      s2[4 * q + 2 * h + 1] = _mm256_unpackhi_epi16(s1[4 * q + h], s1[4 * q + 2 + h]);
    }
  }
  for (int o = 0; o < 2; ++o) {  // s3[8o+f]: rows 8o..8o+7; bytes 2f, 2f+1
    for (int g = 0; g < 4; ++g) {
      s3[8 * o + 2 * g] = _mm256_unpacklo_epi32(s2[8 * o + g], s2[8 * o + 4 + g]);
      s3[8 * o + 2 * g + 1] = _mm256_unpackhi_epi32(s2[8 * o + g], s2[8 * o + 4 + g]);
    }
  }
  for (int f = 0; f < 8; ++f) {  // out[q]: rows 0..15; byte q
    out[2 * f] = _mm256_unpacklo_epi64(s3[f], s3[8 + f]);
    out[2 * f + 1] = _mm256_unpackhi_epi64(s3[f], s3[8 + f]);
  }
}

// Word transpose in each 128-bit lane: in[r] holds 8 words of row r (low lane) and of row r+16
// (high lane); out[8o+f] then holds word f of rows 8o..8o+7 (low lane) and of rows 16+8o.. (high).
inline void transpose_words(const __m256i in[16], __m256i out[16]) {
  __m256i s1[16], s2[16];
  for (int p = 0; p < 8; ++p) {  // s1[2p+x]: rows 2p, 2p+1; words 4x..4x+3
    s1[2 * p] = _mm256_unpacklo_epi16(in[2 * p], in[2 * p + 1]);
    s1[2 * p + 1] = _mm256_unpackhi_epi16(in[2 * p], in[2 * p + 1]);
  }
  for (int q = 0; q < 4; ++q) {  // s2[4q+g]: rows 4q..4q+3; words 2g, 2g+1
    for (int x = 0; x < 2; ++x) {
      s2[4 * q + 2 * x] = _mm256_unpacklo_epi32(s1[4 * q + x], s1[4 * q + 2 + x]);
      s2[4 * q + 2 * x + 1] = _mm256_unpackhi_epi32(s1[4 * q + x], s1[4 * q + 2 + x]);
    }
  }
  for (int o = 0; o < 2; ++o) {  // out[8o+f]: rows 8o..8o+7; word f
    for (int g = 0; g < 4; ++g) {
      out[8 * o + 2 * g] = _mm256_unpacklo_epi64(s2[8 * o + g], s2[8 * o + 4 + g]);
      out[8 * o + 2 * g + 1] = _mm256_unpackhi_epi64(s2[8 * o + g], s2[8 * o + 4 + g]);
    }
  }
}

// Tiles whose vector v holds rows 16v .. 16v+15 in lane order.
struct SplitRows {
  static int lane_row(int v, int lane) { return 16 * v + lane; }
  static void store(float* y, __m512 v0, __m512 v1, int count) {
    V::store_first(y, v0, std::min(count, 16));
    if (count > 16) V::store_first(y + 16, v1, count - 16);
  }
};

struct Fp8Dec {
  static constexpr int64_t kBlockBytes = 32;
  // An e4m3 code shifted into fp16 position (s.eeee.mmm → s.0eeee.mmm0000000) is the fp16 number
  // value·2^-8, subnormals included, and vcvtph2ps widens it exactly: no table, no fp32 denormals
  // (a multiply with a denormal input costs a microcode assist). The activations carry the 2^8
  // instead, so every product a·w is bit for bit the reference's. NaN codes (0x7F, 0xFF) would
  // decode as ±480·2^-8 and are caught separately.
  static constexpr float kActivationPrescale = 256.0f;

  // The fp16 placement works on the transposed bytes in place, two rows per 16-bit word: v0 holds
  // the even rows (0, 2, .., 14, 16, .., 30) and v1 the odd ones.
  static int lane_row(int v, int lane) { return (lane < 8 ? 2 * lane : 16 + 2 * (lane - 8)) + v; }
  static void store(float* y, __m512 v0, __m512 v1, int count) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    V::store_first(y, _mm512_permutex2var_ps(v0, lo, v1), std::min(count, 16));
    if (count > 16) V::store_first(y + 16, _mm512_permutex2var_ps(v0, hi, v1), count - 16);
  }

  template <class Sink>
  static void step(const uint8_t* const* blk, int64_t b, Sink& sink, bool& nan) {
    const __m256i low7 = _mm256_set1_epi8(0x7F);
    const __m256i keep = _mm256_set1_epi16(static_cast<short>(0xBF80));  // sign, 4 exponent, 3 mantissa bits
    __m256i top = _mm256_setzero_si256();
    sink.begin(b);
    for (int h = 0; h < 2; ++h) {  // bytes 16h .. 16h+15 of each row
      __m256i rows[16], t[16];
      for (int r = 0; r < 16; ++r) {
        rows[r] = pair_rows(blk[r] + 16 * h, blk[16 + r] + 16 * h);
        top = _mm256_max_epu8(top, _mm256_and_si256(rows[r], low7));
      }
      transpose_bytes(rows, t);
      for (int q = 0; q < 16; ++q) {
        // Word = (even row's code, odd row's code): move each byte to bits 7..14, sign-extended.
        const __m256i even = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(t[q], 8), 1), keep);
        const __m256i odd = _mm256_and_si256(_mm256_srai_epi16(t[q], 1), keep);
        sink.w(16 * h + q, _mm512_cvtph_ps(even), _mm512_cvtph_ps(odd));
      }
    }
    sink.end(b);
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(top, low7)) != 0) nan = true;
  }
};

struct Fp4Dec : SplitRows {
  static constexpr int64_t kBlockBytes = 16;

  template <class Sink>
  static void step(const uint8_t* const* blk, int64_t b, Sink& sink, bool&) {
    __m256i rows[16], t[16];
    for (int r = 0; r < 16; ++r) rows[r] = pair_rows(blk[r], blk[16 + r]);
    transpose_bytes(rows, t);
    // E2M1 by code (bit 3 = sign): vpermps indexes the 16 entries with the low 4 bits of each lane.
    const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                      -2.0f, -3.0f, -4.0f, -6.0f);
    sink.begin(b);
    for (int q = 0; q < 16; ++q) {  // byte q holds k = 2q (low nibble) and 2q+1 (high nibble)
      const __m512i d0 = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(t[q]));
      const __m512i d1 = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(t[q], 1));
      sink.w(2 * q, _mm512_permutexvar_ps(d0, lut), _mm512_permutexvar_ps(d1, lut));
      sink.w(2 * q + 1, _mm512_permutexvar_ps(_mm512_srli_epi32(d0, 4), lut),
             _mm512_permutexvar_ps(_mm512_srli_epi32(d1, 4), lut));
    }
    sink.end(b);
  }
};

struct Bf16Dec : SplitRows {
  static constexpr int64_t kBlockBytes = 64;

  static __m512 widen(__m256i words) {  // bf16 -> fp32 is a 16-bit shift
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
  }

  template <class Sink>
  static void step(const uint8_t* const* blk, int64_t b, Sink& sink, bool&) {
    sink.begin(b);
    for (int e = 0; e < 4; ++e) {  // k 8e .. 8e+7
      __m256i rows[16], t[16];
      for (int r = 0; r < 16; ++r) rows[r] = pair_rows(blk[r] + 16 * e, blk[16 + r] + 16 * e);
      transpose_words(rows, t);
      for (int f = 0; f < 8; ++f) {
        sink.w(8 * e + f, widen(_mm256_permute2x128_si256(t[f], t[8 + f], 0x20)),
               widen(_mm256_permute2x128_si256(t[f], t[8 + f], 0x31)));
      }
    }
    sink.end(b);
  }
};

// ---- packed tiles (packed_weights.h): one column of 32 rows side by side, rows 0..15 in v0 -------

// 16 E8M0 codes as fp32 lanes: the code is the exponent field, except 0 (the subnormal 2^-127) and
// 0xFF (NaN), as e8m0_to_f32.
inline __m512 V::e8m0(const uint8_t* codes) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  __m512i bits = _mm512_slli_epi32(c, 23);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(c, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(c, _mm512_set1_epi32(0xFF)), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(bits);
}

struct Fp8PackedDec : SplitRows {
  static constexpr int64_t kBlockBytes = 32;  // of one row per K block
  // The e4m3 → fp16 placement of Fp8Dec on sign-extended bytes: s.eeee.mmm << 7 lands the exponent and
  // mantissa in place and a copy of the sign in bit 15; the mask clears the other copy in bit 14.
  template <class Sink>
  static void step(const uint8_t* p, int64_t b, Sink& sink) {
    const __m512i keep = _mm512_set1_epi16(static_cast<short>(0xBF80));
    sink.begin(b);
    for (int j = 0; j < 32; ++j) {
      const __m512i words = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j)));
      const __m512i h = _mm512_and_si512(_mm512_slli_epi16(words, 7), keep);
      sink.w(j, _mm512_cvtph_ps(_mm512_castsi512_si256(h)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)));
    }
    sink.end(b);
  }
};

struct Fp4PackedDec : SplitRows {
  static constexpr int64_t kBlockBytes = 16;
  template <class Sink>
  static void step(const uint8_t* p, int64_t b, Sink& sink) {
    const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                      -2.0f, -3.0f, -4.0f, -6.0f);
    sink.begin(b);
    for (int q = 0; q < 16; ++q) {  // column q: k = 2q (low nibbles) and 2q+1 (high nibbles)
      const uint8_t* c = p + 32 * q;
      const __m512i d0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
      const __m512i d1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16)));
      sink.w(2 * q, _mm512_permutexvar_ps(d0, lut), _mm512_permutexvar_ps(d1, lut));
      sink.w(2 * q + 1, _mm512_permutexvar_ps(_mm512_srli_epi32(d0, 4), lut),
             _mm512_permutexvar_ps(_mm512_srli_epi32(d1, 4), lut));
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
      const __m256i* c = reinterpret_cast<const __m256i*>(p + 64 * j);
      sink.w(j, Bf16Dec::widen(_mm256_loadu_si256(c)), Bf16Dec::widen(_mm256_loadu_si256(c + 1)));
    }
    sink.end(b);
  }
};

// act_quant_fp8 of one row (quant.cpp) with the e4m3 values, times `prescale`, written as fp32:
// the same operations lane by lane. amax skips NaN as std::max does (vmaxps returns its second
// operand when either is NaN); the scale comes from the same pow2_ceil_scale; x / s is a real
// division; the e4m3 rounding is round(a·2^(3-e))·2^(e-3) with e = max(exponent(a), -6), which is
// e4m3_from_f32's own formula (vrndscaleps rounds to nearest even, like its tie rule).
inline void quantize_row(const float* x, int64_t k, float prescale, float* out, float* scales) {
  const __m512i abs_bits = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512 max_e4m3 = _mm512_set1_ps(448.0f);
  const __m512i min_exp = _mm512_set1_epi32(121 << 23);  // 2^-6: below it the e4m3 step is fixed
  const __m512i inv_base = _mm512_set1_epi32(static_cast<int>(257u << 23));
  const __m512i three = _mm512_set1_epi32(3 << 23);
  const __m512 qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000));  // e4m3_to_f32(0x7F)
  const __m512 pre = _mm512_set1_ps(prescale);
  for (int64_t b = 0; b < k / kQBlock; ++b) {
    const float* xb = x + b * kQBlock;
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const __m512 a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x0), abs_bits));
    const __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x1), abs_bits));
    const __m512 m = _mm512_max_ps(a1, _mm512_max_ps(a0, _mm512_setzero_ps()));
    const float amax = std::max(_mm512_reduce_max_ps(m), 1e-4f);
    const float s = pow2_ceil_scale(amax, 1.0f / 448.0f);
    scales[b] = s;
    const __m512 sv = _mm512_set1_ps(s);
    for (int h = 0; h < 2; ++h) {
      const __m512 v = _mm512_div_ps(h == 0 ? x0 : x1, sv);
      const __m512i vb = _mm512_castps_si512(v);
      const __m512 a = _mm512_min_ps(_mm512_castsi512_ps(_mm512_and_si512(vb, abs_bits)), max_e4m3);
      const __m512i e = _mm512_max_epi32(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7F800000)),
                                         min_exp);
      const __m512 inv = _mm512_castsi512_ps(_mm512_sub_epi32(inv_base, e));  // 2^(3-e)
      const __m512 step = _mm512_castsi512_ps(_mm512_sub_epi32(e, three));    // 2^(e-3)
      const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(a, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m512 r = _mm512_mul_ps(q, step);
      r = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), _mm512_andnot_si512(abs_bits, vb)));
      r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, qnan);
      _mm512_storeu_ps(out + b * kQBlock + 16 * h, _mm512_mul_ps(r, pre));
    }
  }
}
