// AVX-512-BF16 kernels: the GEMM path (more than V::kGemvRows rows) of the FP8, FP4 and BF16 linear
// layers, the decode steps' FP8 and FP4 GEMV on packed tiles (where the CPU also has VBMI), and the
// q·k of both attentions on vdpbf16ps, two products per fp32 lane and instruction where the AVX-512
// level's FMA does one. The level's other ops, and the GEMV elsewhere, are the AVX-512 level's
// (backend.cpp).
//
// The bits are the reference's, not an approximation of them:
//  * the decoded weights (e4m3 · 2^-8, or e2m1) and the act_quant'ed activations (e4m3 · 2^8, or
//    e4m3) have at most 4 significant bits, so they are exact in bf16, and every product a·w (at
//    most 8 bits) is exact in fp32;
//  * vdpbf16ps adds a lane's two products to its accumulator one after the other, each addition
//    rounded to nearest even, the pair's upper (odd) half first (Intel SDM, VDPBF16PS pseudocode).
//    With k in the upper half and k+1 in the lower, each lane runs (acc + a_k·w_k) + a_k+1·w_k+1:
//    the reference's own chain (backend.h). A CPU whose instruction rounds otherwise does not get
//    this level (bf16_dot_rounds_in_order, asked at detection);
//  * its flush of subnormal inputs and results never fires: every product is a multiple of 2^-18
//    (smallest weight 2^-17, smallest activation 2^-1; FP4: 2^-1 and 2^-9), so is every partial sum,
//    and the power-of-two scales folded into the operands (the GEMM section) keep them all normal.
// The BF16 layers' and the attentions' conditions are with their kernels below.
#include <algorithm>
#include <array>
#include <chrono>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
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

// As simd_avx512.cpp, with vdpbf16ps; it only runs after cpu_features() said so.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"))), \
                             apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace dsv41::detail::avx512_bf16 {

#include "kernels/simd_avx512_ops.h"

#include "kernels/linear_simd_impl.h"
#include "kernels/attention_simd_impl.h"
#include "kernels/dense_attention_simd_impl.h"

// ---- bf16 pairs ---------------------------------------------------------------------------------

// Lane by lane, the bf16 pair (upper = hi, lower = lo) of two fp32 values exact in bf16: their upper
// halves.
inline __m512i pair_bf16(__m512 hi, __m512 lo) {
  const __m512i upper = _mm512_and_si512(_mm512_castps_si512(hi), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_or_si512(upper, _mm512_srli_epi32(_mm512_castps_si512(lo), 16));
}

inline uint32_t pair_bf16(float hi, float lo) {
  uint32_t h = 0, l = 0;
  std::memcpy(&h, &hi, 4);
  std::memcpy(&l, &lo, 4);
  return (h & 0xFFFF0000u) | (l >> 16);
}

// acc + a.upper·w.upper, then + a.lower·w.lower, lane by lane.
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)w);
}

constexpr int64_t kPairs = kQBlock / 2;  // bf16 pairs per K block

// A decoder's sink (linear_simd_impl.h) that stores a block's weights as pairs: k = 2q and 2q+1 of
// the tile's rows at panel[(b - c0)][q][2][W], in the decoder's lane order.
struct PairSink {
  uint32_t* panel;
  int64_t c0 = 0;
  uint32_t* base = nullptr;
  __m512 even0 = _mm512_setzero_ps(), even1 = _mm512_setzero_ps();
  void begin(int64_t b) { base = panel + (b - c0) * kPairs * kTileRows; }
  void w(int j, __m512 v0, __m512 v1) {  // j = 0..31 in order
    if ((j & 1) == 0) {
      even0 = v0;
      even1 = v1;
      return;
    }
    uint32_t* p = base + (j / 2) * kTileRows;
    _mm512_storeu_si512(p, pair_bf16(even0, v0));
    _mm512_storeu_si512(p + V::W, pair_bf16(even1, v1));
  }
  void end(int64_t) {}
};

// Blocks [c0, c1) of one tile into `sink`: from the packed tiles, or from the checkpoint's layout
// (`rows` holds the tile's rows; nan is set where an FP8 NaN code turns up).
template <class Kind, class Sink>
void decode_blocks(const typename Kind::Matrix& w, int64_t tile, const std::optional<Tile<Kind>>& rows, int64_t c0,
                   int64_t c1, Sink& sink, Scratch& s, bool& nan) {
  const uint8_t* blk[kTileRows];
  for (int64_t b = c0; b < c1; ++b) {
    if (!rows) {
      Kind::PDec::step(packed_block<Kind>(w, tile, b), b, sink);
    } else {
      rows->block(b, blk, s);
      Kind::Dec::step(blk, b, sink, nan);
    }
  }
}

// ---- packed tiles as pairs, by byte permutes (AVX-512 VBMI) -----------------------------------------
//
// Where the CPU has VBMI, packed FP8 and FP4 tiles turn into bf16 pairs with a few byte and word
// permutes, three to five instructions per 32 weights where widening to fp32 and pairing takes about
// a dozen: the decode steps' GEMV and the GEMM's panels use them. Only functions marked DSV41_VBMI
// run them, and only where cpu_features().avx512_vbmi (backend.cpp).

#define DSV41_VBMI __attribute__((target("avx512vbmi")))

// Packed FP4 columns as pairs. Column q of a block holds 32 bytes, one per tile row: the low nibble
// is k = 2q, the high nibble k = 2q+1. Each row's byte is spread to the four bytes of its lane; the
// lower word, shifted right by 4, indexes the table with the high nibble (k + 1, the pair's lower
// half), the upper word with the low nibble (k, the upper half). vpermw reads 5 index bits, so the
// table holds the 16 E2M1 values twice and the bit above each nibble does not matter.
struct Fp4Pairs {
  struct Tables {
    alignas(64) uint16_t values[32];
    alignas(64) uint8_t spread[2][64];
    alignas(64) uint16_t shifts[32];
  };
  static const Tables& tables() {
    static const Tables made = [] {
      Tables t{};
      for (int c = 0; c < 32; ++c) t.values[c] = bf16_from_f32(e2m1_to_f32(static_cast<uint8_t>(c % 16)));
      for (int l = 0; l < 16; ++l) {
        for (int j = 0; j < 4; ++j) {
          t.spread[0][4 * l + j] = static_cast<uint8_t>(l);
          t.spread[1][4 * l + j] = static_cast<uint8_t>(16 + l);
        }
        t.shifts[2 * l] = 4;
        t.shifts[2 * l + 1] = 0;
      }
      return t;
    }();
    return made;
  }
  __m512i table, spread0, spread1, shifts;
  Fp4Pairs()
      : table(_mm512_load_si512(tables().values)),
        spread0(_mm512_load_si512(tables().spread[0])),
        spread1(_mm512_load_si512(tables().spread[1])),
        shifts(_mm512_load_si512(tables().shifts)) {}
  // Block b's weight scales of the tile's rows 0..15 and 16..31 (packed in that order).
  static void scales(const Fp4Matrix& w, int64_t tile, int64_t b, __m512& s0, __m512& s1) {
    const uint8_t* codes = w.packed.scales + tile * w.packed.scale_tile_bytes + b * kTileRows;
    s0 = V::e8m0(codes);
    s1 = V::e8m0(codes + V::W);
  }
  // Pairs q of a block: rows 0..15 in w0, 16..31 in w1.
  DSV41_VBMI void pairs(const uint8_t* block, int q, __m512i& w0, __m512i& w1) const {
    const __m512i c = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * q)));
    w0 = _mm512_permutexvar_epi16(_mm512_srlv_epi16(_mm512_permutexvar_epi8(spread0, c), shifts), table);
    w1 = _mm512_permutexvar_epi16(_mm512_srlv_epi16(_mm512_permutexvar_epi8(spread1, c), shifts), table);
  }
};

// Packed FP8 columns as pairs. Columns 2q and 2q+1 of a block are 64 adjacent bytes (32 rows each);
// two 128-entry byte tables give the upper and lower byte of each code's bf16 value (e4m3 · 2^-8, the
// AVX-512 decoders' weights, so the activations keep their prescale), the sign comes from the code,
// and a two-source byte permute interleaves them into each row's pair (k = 2q upper, 2q+1 lower).
// NaN codes are never decoded: their tiles take the scalar path.
struct Fp8Pairs {
  struct Tables {
    alignas(64) uint8_t upper[128], lower[128];
    alignas(64) uint8_t rows[2][64];
  };
  static const Tables& tables() {
    static const Tables made = [] {
      Tables t{};
      for (int c = 0; c < 128; ++c) {
        const uint16_t b = bf16_from_f32(e4m3_to_f32(static_cast<uint8_t>(c)) / Fp8Kind::kPrescale);  // exact
        t.upper[c] = static_cast<uint8_t>(b >> 8);
        t.lower[c] = static_cast<uint8_t>(b & 0xFF);
      }
      for (int v = 0; v < 2; ++v) {  // lane l: (lower, upper) bytes of k + 1, then of k; 64 + i: the upper
        for (int l = 0; l < 16; ++l) {
          const int row = 16 * v + l;
          t.rows[v][4 * l + 0] = static_cast<uint8_t>(32 + row);
          t.rows[v][4 * l + 1] = static_cast<uint8_t>(64 + 32 + row);
          t.rows[v][4 * l + 2] = static_cast<uint8_t>(row);
          t.rows[v][4 * l + 3] = static_cast<uint8_t>(64 + row);
        }
      }
      return t;
    }();
    return made;
  }
  __m512i upper0, upper1, lower0, lower1, rows0, rows1;
  Fp8Pairs()
      : upper0(_mm512_load_si512(tables().upper)),
        upper1(_mm512_load_si512(tables().upper + 64)),
        lower0(_mm512_load_si512(tables().lower)),
        lower1(_mm512_load_si512(tables().lower + 64)),
        rows0(_mm512_load_si512(tables().rows[0])),
        rows1(_mm512_load_si512(tables().rows[1])) {}
  // Block b's weight scale: one per 32×32 scale tile, which a tile of 32 rows lies in.
  static void scales(const Fp8Matrix& w, int64_t tile, int64_t b, __m512& s0, __m512& s1) {
    s0 = s1 = V::set1(e8m0_table()[w.scale[tile * (w.k / kQBlock) + b]]);
  }
  DSV41_VBMI void pairs(const uint8_t* block, int q, __m512i& w0, __m512i& w1) const {
    const __m512i c = _mm512_loadu_si512(block + 64 * q);
    const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
    // the upper bytes with the code's sign: a | (b & c)
    const __m512i up = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(upper0, c, upper1), c, sign, 0xF8);
    const __m512i lo = _mm512_permutex2var_epi8(lower0, c, lower1);
    w0 = _mm512_permutex2var_epi8(lo, rows0, up);
    w1 = _mm512_permutex2var_epi8(lo, rows1, up);
  }
};

template <class Kind>
using PairsOf = std::conditional_t<std::is_same_v<Kind, Fp8Kind>, Fp8Pairs, Fp4Pairs>;

// ---- the GEMM -------------------------------------------------------------------------------------
//
// The reference adds (partial·a_s)·w_s per block, both scales powers of two (ue8m0 / E8M0). Scaling by a
// power of two commutes with every rounding as long as nothing leaves fp32's normal range, so the
// scales are folded into the operands instead: the activation pairs hold a·a_s, the weight panel w·w_s,
// each block's chain of vdpbf16ps then computes partial·a_s·w_s directly, and the accumulation over
// blocks is one add per block (on the adder, beside the dot unit, instead of two multiplies on it).
// With every scale exponent in [-kFoldedExponent, kFoldedExponent] nothing leaves that range: the
// operands stay normal bf16 values (|a| in [2^-9, 2^17], |w| in [2^-17, 6] before scaling), every
// product and partial sum of a block is a multiple of 2^-18 · 2^(e_a + e_w) >= 2^-118 and at most
// 32 · 2^17.6 · 2^(e_a + e_w) < 2^123, and the reference's partial·a_s is inside the same bounds. A call
// whose activation scales fall outside, or a tile whose weight scales do, runs the AVX-512 level's
// kernel: the same bits at half the rate.
constexpr int kFoldedExponent = 50;

inline bool folded_exponent(float scale) {
  uint32_t bits;
  std::memcpy(&bits, &scale, 4);
  const int e = static_cast<int>((bits >> 23) & 0xFFu) - 127;  // zero, subnormal, inf and NaN fall outside
  return (bits & 0x807FFFFFu) == 0 && e >= -kFoldedExponent && e <= kFoldedExponent;
}

// Lanes of 16 scales outside the folded range.
inline __mmask16 outside_folded(__m512 scales) {
  const __m512i bits = _mm512_castps_si512(scales);
  const __mmask16 not_pow2 = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(static_cast<int>(0x807FFFFFu)));
  const __m512i from_least = _mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(127 - kFoldedExponent));
  return static_cast<__mmask16>(not_pow2 | _mm512_cmpgt_epu32_mask(from_least, _mm512_set1_epi32(2 * kFoldedExponent)));
}

inline bool folded_exponents(const float* scales, int64_t count) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    if (outside_folded(_mm512_loadu_ps(scales + i)) != 0) return false;
  }
  for (; i < count; ++i) {
    if (!folded_exponent(scales[i])) return false;
  }
  return true;
}

// Activation rows in groups of kGroupRows (the last group has the rest), each group's pairs
// interleaved by row, [kp][rows]: the micro kernel broadcasts them from one pointer at fixed offsets.
constexpr int kGroupRows = 6;  // 2·6 chains + 2·6 accumulators + 3 operands of 32 registers

inline int64_t group_rows(int64_t m, int64_t i0) { return std::min<int64_t>(kGroupRows, m - i0); }

// The activations (prescaled act_quant values, exact in bf16) times their block's scale, as pairs in
// groups into `out` (m · k/2 values); false when a scale is outside the folded range.
bool scaled_activation_pairs(const Exec& ex, const QuantizedActivations& a, bool parallel, uint32_t* out) {
  const int64_t kb = a.k / kQBlock, kp = a.k / 2;
  if (!folded_exponents(a.scales.data(), a.m * kb)) return false;
  const auto rows = [&](int64_t i0, int64_t i1, Scratch&) {
    alignas(64) uint32_t block[kPairs];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g0 = i - i % kGroupRows, r = i - g0, n = group_rows(a.m, g0);
      const float* x = a.row(i);
      const float* xs = a.row_scales(i);
      uint32_t* o = out + g0 * kp + r;
      for (int64_t b = 0; b < kb; ++b) {
        const __m512 s = _mm512_set1_ps(xs[b]);
        const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(x + b * kQBlock), s);
        const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(x + b * kQBlock + 16), s);
        // vcvtne2ps2bf16 is exact on bf16 values; the rotation puts each even k in the upper half
        _mm512_store_si512(block, _mm512_rol_epi32((__m512i)_mm512_cvtne2ps_pbh(hi, lo), 16));
        for (int q = 0; q < kPairs; ++q) o[(b * kPairs + q) * n] = block[q];
      }
    }
  };
  ex.run(parallel && a.m > 1, a.m, kGroupRows, rows);
  return true;
}

// PairSink with each block's weights times their scales (ws: [kb][2][W]).
struct ScaledPairSink : PairSink {
  const float* ws;
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  void begin(int64_t b) {
    PairSink::begin(b);
    s0 = _mm512_loadu_ps(ws + (2 * b) * V::W);
    s1 = _mm512_loadu_ps(ws + (2 * b + 1) * V::W);
  }
  void w(int j, __m512 v0, __m512 v1) { PairSink::w(j, _mm512_mul_ps(v0, s0), _mm512_mul_ps(v1, s1)); }
};

// Each lane's scale (a power of two inside the folded range) as a bf16 exponent step, e·2^7, in both
// 16-bit halves.
inline __m512i exponent_steps(__m512 scale) {
  const __m512i e = _mm512_srai_epi32(_mm512_sub_epi32(_mm512_castps_si512(scale), _mm512_set1_epi32(127 << 23)), 16);
  const __m512i low = _mm512_and_si512(e, _mm512_set1_epi32(0xFFFF));
  return _mm512_or_si512(low, _mm512_slli_epi32(low, 16));
}

// The ScaledPairSink panel of packed blocks [c0, c1) by the permute decoders: each nonzero bf16 weight
// times its scale by an add to its exponent (exact: the folded range keeps every result normal).
template <class Kind>
DSV41_VBMI void scaled_pairs_vbmi(const typename Kind::Matrix& w, int64_t tile, int64_t c0, int64_t c1,
                                  const float* ws, uint32_t* panel) {
  const PairsOf<Kind> dec;
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
  for (int64_t b = c0; b < c1; ++b) {
    const __m512i e0 = exponent_steps(V::load(ws + (2 * b) * V::W));
    const __m512i e1 = exponent_steps(V::load(ws + (2 * b + 1) * V::W));
    const uint8_t* block = packed_block<Kind>(w, tile, b);
    uint32_t* out = panel + (b - c0) * kPairs * kTileRows;
    for (int q = 0; q < kPairs; ++q) {
      __m512i w0, w1;
      dec.pairs(block, q, w0, w1);
      w0 = _mm512_mask_add_epi16(w0, _mm512_test_epi16_mask(w0, magnitude), w0, e0);
      w1 = _mm512_mask_add_epi16(w1, _mm512_test_epi16_mask(w1, magnitude), w1, e1);
      _mm512_storeu_si512(out + q * kTileRows, w0);
      _mm512_storeu_si512(out + q * kTileRows + V::W, w1);
    }
  }
}

// One group of MI activation rows (xg: its pairs, [kp][MI]) × one tile over the panel's blocks
// [c0, c1): per block 2·MI chains of 16 vdpbf16ps from zero (the block's scaled partial sums), each
// then added to its row's accumulator; chains and accumulators stay in registers.
template <int MI>
void micro_pairs(const uint32_t* xg, const uint32_t* panel, int64_t c0, int64_t c1, float* acc_buf) {
  using F = V::F;
  F acc[MI][2];
  for (int ii = 0; ii < MI; ++ii) {
    acc[ii][0] = V::load(acc_buf + ii * kTileRows);
    acc[ii][1] = V::load(acc_buf + ii * kTileRows + V::W);
  }
  for (int64_t b = c0; b < c1; ++b) {
    const uint32_t* p = panel + (b - c0) * kPairs * kTileRows;
    const uint32_t* xb = xg + b * kPairs * MI;
    F part[MI][2];
    for (int ii = 0; ii < MI; ++ii) part[ii][0] = part[ii][1] = V::zero();
    for (int q = 0; q < kPairs; ++q) {
      const __m512i w0 = _mm512_loadu_si512(p + q * kTileRows), w1 = _mm512_loadu_si512(p + q * kTileRows + V::W);
      for (int ii = 0; ii < MI; ++ii) {
        const __m512i av = _mm512_set1_epi32(static_cast<int>(xb[q * MI + ii]));
        part[ii][0] = dot_pairs(part[ii][0], av, w0);
        part[ii][1] = dot_pairs(part[ii][1], av, w1);
      }
    }
    for (int ii = 0; ii < MI; ++ii) {
      acc[ii][0] = V::add(acc[ii][0], part[ii][0]);
      acc[ii][1] = V::add(acc[ii][1], part[ii][1]);
    }
  }
  for (int ii = 0; ii < MI; ++ii) {
    V::store(acc_buf + ii * kTileRows, acc[ii][0]);
    V::store(acc_buf + ii * kTileRows + V::W, acc[ii][1]);
  }
}

// Every group of the m rows.
inline void micro_pairs_rows(const uint32_t* xp, int64_t m, int64_t kp, const uint32_t* panel, int64_t c0,
                             int64_t c1, float* acc_buf) {
  for (int64_t g0 = 0; g0 < m; g0 += kGroupRows) {
    const uint32_t* xg = xp + g0 * kp;
    float* acc = acc_buf + g0 * kTileRows;
    switch (group_rows(m, g0)) {
      case 6: micro_pairs<6>(xg, panel, c0, c1, acc); break;
      case 5: micro_pairs<5>(xg, panel, c0, c1, acc); break;
      case 4: micro_pairs<4>(xg, panel, c0, c1, acc); break;
      case 3: micro_pairs<3>(xg, panel, c0, c1, acc); break;
      case 2: micro_pairs<2>(xg, panel, c0, c1, acc); break;
      default: micro_pairs<1>(xg, panel, c0, c1, acc); break;
    }
  }
}

// Rows [r0, r1) of y[m, n] (r0 a multiple of 2W), from the checkpoint's layout or the packed tiles;
// xp holds the scaled activation pairs.
template <class Kind>
void gemm_pairs(const uint32_t* xp, const QuantizedActivations& qa, const typename Kind::Matrix& w, float* y,
                int64_t r0, int64_t r1, Scratch& s, bool vbmi) {
  const int64_t m = qa.m, kb = w.k / kQBlock;
  const bool packed = w.packed.tile_rows == kTileRows;
  for (int64_t row0 = r0; row0 < r1; row0 += kTileRows) {
    const int64_t tile = row0 / kTileRows;
    const int count = static_cast<int>(std::min<int64_t>(kTileRows, r1 - row0));
    if (packed && packed_nan<Kind>(w, tile)) {
      tile_scalar<Kind>(qa, w, y, row0, count);
      continue;
    }
    // asked for per tile: the fallback below uses the same slots and may move them
    float* ws = s.get<float>(ScratchSlot::LinearScales, static_cast<size_t>(kb * kTileRows));
    uint32_t* panel = s.get<uint32_t>(ScratchSlot::LinearPanel, static_cast<size_t>(kKc * kPairs * kTileRows));
    float* acc = s.get<float>(ScratchSlot::LinearAcc, static_cast<size_t>(m * kTileRows));
    std::optional<Tile<Kind>> rows;  // the checkpoint's layout
    if (packed) {
      Kind::packed_scales(w, tile, ws);
    } else {
      rows.emplace(w, row0, r1, s);
      Kind::tile_scales(w, row0, count, ws);
    }
    if (!folded_exponents(ws, kb * kTileRows)) {  // this tile the AVX-512 level's way
      packed ? gemm_packed<Kind>(qa.values.data(), qa.scales.data(), &qa, m, w, y, row0, row0 + count, s)
             : gemm_rows<Kind>(qa.values.data(), qa.scales.data(), &qa, m, w, y, row0, row0 + count, s);
      continue;
    }
    std::fill(acc, acc + m * kTileRows, 0.0f);
    bool nan = false;
    for (int64_t c0 = 0; c0 < kb; c0 += kKc) {
      const int64_t c1 = std::min(kb, c0 + kKc);
      if (packed && vbmi) {
        scaled_pairs_vbmi<Kind>(w, tile, c0, c1, ws, panel);
      } else {
        ScaledPairSink sink{{panel, c0}, ws};
        decode_blocks<Kind>(w, tile, rows, c0, c1, sink, s, nan);
      }
      micro_pairs_rows(xp, m, w.k / 2, panel, c0, c1, acc);
    }
    if (nan) {
      tile_scalar<Kind>(qa, w, y, row0, count);
      continue;
    }
    for (int64_t i = 0; i < m; ++i) {
      const float* a = acc + i * kTileRows;
      const V::F v0 = finish<Kind>(V::load(a)), v1 = finish<Kind>(V::load(a + V::W));
      packed ? Kind::PDec::store(y + i * w.n + row0, v0, v1, count) : Kind::Dec::store(y + i * w.n + row0, v0, v1, count);
    }
  }
}

// With `vbmi` (only where the CPU has it), packed panels come from the permute decoders.
template <class Kind>
void run_linear_pairs(const Exec& ex, const float* x, int64_t m, const typename Kind::Matrix& w, float* y,
                      bool vbmi = false) {
  static_assert(Kind::kScaled, "the pair GEMM is for the quantized kinds: their products are exact");
  if (m <= V::kGemvRows || w.n <= 0) return run_linear<Kind>(ex, x, m, w, y);  // GEMV: bandwidth-bound
  assert(w.k % kQBlock == 0 && "act_quant needs K in whole blocks of 32");
  const bool parallel = w.n * w.k >= kParallelMin;
  const QuantizedActivations qa = quantize_rows(&ex, x, m, w.k, Kind::kPrescale, parallel);
  bool folded = false;
  // the pairs in the calling thread's scratch (reused call after call), read by every worker
  ex.serial(1, [&](int64_t, int64_t, Scratch& mine) {
    uint32_t* xp = mine.get<uint32_t>(ScratchSlot::PairRows, static_cast<size_t>(m * (w.k / 2)));
    if (!scaled_activation_pairs(ex, qa, parallel, xp)) return;
    folded = true;
    ex.run(parallel, w.n, kTileRows,
           [&](int64_t r0, int64_t r1, Scratch& s) { gemm_pairs<Kind>(xp, qa, w, y, r0, r1, s, vbmi); });
  });
  if (!folded) run_linear<Kind>(ex, x, m, w, y);  // activation scales outside the folded range
}

// ---- the GEMV: decode steps on the dot unit (packed tiles, AVX-512 VBMI) ---------------------------
//
// A decode step reads every weight once, so it is bound by how fast weights turn into products: the
// AVX-512 level's GEMV widens each weight to fp32 and spends one FMA on it, which on Zen 4 keeps a
// core below the memory's rate (docs/performance.md). Here packed tiles become bf16 pairs with byte
// and word permutes (AVX-512 VBMI: vpermb, vpermi2b) and each vdpbf16ps takes two weights of a row.
// Activations carry their block scale (scaled pairs, as the GEMM's); the weight scale multiplies each
// block's partial sum in one FMA, acc + partial·w_s, whose product is exact under the GEMM's range
// condition (tiles outside it, and calls whose activation scales are, take the AVX-512 GEMV).

// Rows [r0, r1) of y[0..M, :] from packed tiles; xg holds the M rows' scaled pairs, [kp][M].
template <class Kind, int M>
DSV41_VBMI void gemv_pairs(const uint32_t* xg, const QuantizedActivations& qa, const typename Kind::Matrix& w,
                           float* y, int64_t r0, int64_t r1, Scratch& s) {
  using F = V::F;
  const int64_t kb = w.k / kQBlock;
  const PairsOf<Kind> dec;
  for (int64_t row0 = r0; row0 < r1; row0 += kTileRows) {
    const int64_t tile = row0 / kTileRows;
    const int count = static_cast<int>(std::min<int64_t>(kTileRows, r1 - row0));
    if (packed_nan<Kind>(w, tile)) {
      tile_scalar<Kind>(qa, w, y, row0, count);
      continue;
    }
    F acc[M][2];
    for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = V::zero();
    __mmask16 outside = 0;
    for (int64_t b = 0; b < kb; ++b) {
      prefetch_ahead<Kind>(w, tile, b);
      const uint8_t* block = packed_block<Kind>(w, tile, b);
      const uint32_t* xb = xg + b * kPairs * M;
      F part[M][2];
      for (int i = 0; i < M; ++i) part[i][0] = part[i][1] = V::zero();
      for (int q = 0; q < kPairs; ++q) {
        __m512i w0, w1;
        dec.pairs(block, q, w0, w1);
        for (int i = 0; i < M; ++i) {
          const __m512i av = _mm512_set1_epi32(static_cast<int>(xb[q * M + i]));
          part[i][0] = dot_pairs(part[i][0], av, w0);
          part[i][1] = dot_pairs(part[i][1], av, w1);
        }
      }
      F s0, s1;
      dec.scales(w, tile, b, s0, s1);
      outside = static_cast<__mmask16>(outside | outside_folded(s0) | outside_folded(s1));
      for (int i = 0; i < M; ++i) {
        acc[i][0] = V::fma(part[i][0], s0, acc[i][0]);
        acc[i][1] = V::fma(part[i][1], s1, acc[i][1]);
      }
    }
    if (outside != 0) {  // a weight scale outside the folded range: this tile the AVX-512 level's way
      gemv_packed<Kind, M>(qa.values.data(), qa.scales.data(), &qa, w, y, row0, row0 + count, s);
      continue;
    }
    for (int i = 0; i < M; ++i) {
      Kind::PDec::store(y + i * w.n + row0, finish<Kind>(acc[i][0]), finish<Kind>(acc[i][1]), count);
    }
  }
}

// m <= kGemvRows rows against packed tiles; false (nothing written) where the activation scales are
// outside the folded range.
template <class Kind>
DSV41_VBMI bool run_gemv_pairs(const Exec& ex, const float* x, int64_t m, const typename Kind::Matrix& w, float* y) {
  const bool parallel = w.n * w.k >= kParallelMin;
  const QuantizedActivations qa = quantize_rows(&ex, x, m, w.k, Kind::kPrescale, false);
  bool folded = false;
  // the pairs in the calling thread's scratch (reused call after call), read by every worker
  ex.serial(1, [&](int64_t, int64_t, Scratch& mine) {
    uint32_t* xp = mine.get<uint32_t>(ScratchSlot::PairRows, static_cast<size_t>(m * (w.k / 2)));
    if (!scaled_activation_pairs(ex, qa, false, xp)) return;  // m <= kGroupRows: one group, [kp][m]
    folded = true;
    const auto rows = [&](auto count) {
      constexpr int M = decltype(count)::value;
      ex.run(parallel, w.n, kTileRows,
             [&](int64_t r0, int64_t r1, Scratch& s) { gemv_pairs<Kind, M>(xp, qa, w, y, r0, r1, s); });
    };
    static_assert(V::kGemvRows == 4 && kGroupRows >= 4, "one group of up to four rows");
    switch (m) {
      case 1: return rows(std::integral_constant<int, 1>{});
      case 2: return rows(std::integral_constant<int, 2>{});
      case 3: return rows(std::integral_constant<int, 3>{});
      default: return rows(std::integral_constant<int, 4>{});
    }
  });
  return folded;
}

// The layer where the CPU has VBMI: a few rows against packed tiles on the pair GEMV, the rest on the
// pair GEMM with its panels from the permute decoders.
template <class Kind>
DSV41_VBMI void run_linear_vbmi(const Exec& ex, const float* x, int64_t m, const typename Kind::Matrix& w, float* y) {
  const bool gemv = m >= 1 && m <= V::kGemvRows && w.n > 0 && w.packed.tile_rows == kTileRows;
  if (gemv && run_gemv_pairs<Kind>(ex, x, m, w, y)) return;
  run_linear_pairs<Kind>(ex, x, m, w, y, true);
}

// ---- the bf16 linears ------------------------------------------------------------------------------
//
// linear_bf16, and linear_f32 on activations that are all bf16 values: one chain per output over all of
// k in k order (backend.h), which vdpbf16ps runs two products at a time (k in the upper half, k+1 in
// the lower, as above). A product of two bf16 values is exact in fp32. The flush of subnormal inputs
// and results never fires when every nonzero activation and weight is finite with an exponent of at
// least -56: the lowest bit of each product, and so of each partial sum, is then 2^-126 or above, so
// every partial sum is zero or a normal number. Activations outside that send the call, weights outside
// it their tile, to the AVX-512 level's path (the same bits at half the rate).

constexpr uint32_t kPairMinExponent = 127 - 56;  // biased; fp32 and bf16 share the exponent field

// Lanes (fp32 bit patterns) that are nonzero and below that exponent, infinite or NaN.
inline __mmask16 outside_pair_range(__m512i bits) {
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i exponent = _mm512_srli_epi32(magnitude, 23);
  const __mmask16 nonzero = _mm512_test_epi32_mask(magnitude, magnitude);
  const __mmask16 low = _mm512_cmplt_epu32_mask(exponent, _mm512_set1_epi32(kPairMinExponent));
  const __mmask16 special = _mm512_cmpeq_epi32_mask(exponent, _mm512_set1_epi32(255));
  return static_cast<__mmask16>(nonzero & (low | special));
}

inline bool outside_pair_range(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint32_t magnitude = bits & 0x7FFFFFFFu, exponent = magnitude >> 23;
  return magnitude != 0 && (exponent < kPairMinExponent || exponent == 255);
}

// PairSink that also notes weights outside the pairs' range.
struct CheckedPairSink : PairSink {
  __mmask16 outside = 0;
  void w(int j, __m512 v0, __m512 v1) {
    outside = static_cast<__mmask16>(outside | outside_pair_range(_mm512_castps_si512(v0)) |
                                      outside_pair_range(_mm512_castps_si512(v1)));
    PairSink::w(j, v0, v1);
  }
};

// `count` values as pairs (value 2p in the upper half of out[p], 2p + 1 in the lower; an odd last
// value pairs with zero) into `out`, unless it is null; whether every value is a bf16 value inside
// the pairs' range. (vcvtne2ps2bf16 is exact on bf16 values; the rotation puts the even value on top.)
inline bool row_pairs(const float* r, int64_t count, uint32_t* out) {
  const __m512i low_bits = _mm512_set1_epi32(0xFFFF);
  __mmask16 bad = 0;
  int64_t j = 0;
  for (; j + 32 <= count; j += 32) {
    const __m512 a = _mm512_loadu_ps(r + j), b = _mm512_loadu_ps(r + j + 16);
    const __m512i ab = _mm512_castps_si512(a), bb = _mm512_castps_si512(b);
    bad = static_cast<__mmask16>(bad | _mm512_test_epi32_mask(ab, low_bits) | _mm512_test_epi32_mask(bb, low_bits) |
                                 outside_pair_range(ab) | outside_pair_range(bb));
    if (out != nullptr) _mm512_storeu_si512(out + j / 2, _mm512_rol_epi32((__m512i)_mm512_cvtne2ps_pbh(b, a), 16));
  }
  bool ok = bad == 0;
  for (; j < count; j += 2) {
    const float hi = r[j], lo = j + 1 < count ? r[j + 1] : 0.0f;
    uint32_t hb, lb;
    std::memcpy(&hb, &hi, 4);
    std::memcpy(&lb, &lo, 4);
    ok = ok && ((hb | lb) & 0xFFFFu) == 0 && !outside_pair_range(hi) && !outside_pair_range(lo);
    if (out != nullptr) out[j / 2] = pair_bf16(hi, lo);
  }
  return ok;
}

// The activations as pairs [m][k_blocks·16] (k zero-padded to whole blocks) into `out`; false when one
// is not a bf16 value or is outside the pairs' range.
bool bf16_activation_pairs(const Exec& ex, const float* x, int64_t m, int64_t k, bool parallel, uint32_t* out) {
  const int64_t kp = k_blocks(k) * kPairs, used = (k + 1) / 2;
  std::vector<uint8_t> bad(static_cast<size_t>(m), 0);
  ex.run(parallel && m > 1, m, 1, [&](int64_t i0, int64_t i1, Scratch&) {
    for (int64_t i = i0; i < i1; ++i) {
      bad[static_cast<size_t>(i)] = !row_pairs(x + i * k, k, out + i * kp);
      std::fill(out + i * kp + used, out + (i + 1) * kp, 0u);
    }
  });
  return std::none_of(bad.begin(), bad.end(), [](uint8_t b) { return b != 0; });
}

// MI activation rows × one tile over the panel's blocks [c0, c1): 2·MI chains of vdpbf16ps that
// continue from the accumulators across blocks (no per-block partials: one chain over all of k).
template <int MI>
void micro_chain(const uint32_t* xp, int64_t i0, int64_t kp, const uint32_t* panel, int64_t c0, int64_t c1,
                 float* acc_buf) {
  using F = V::F;
  F acc[MI][2];
  for (int ii = 0; ii < MI; ++ii) {
    acc[ii][0] = V::load(acc_buf + (i0 + ii) * kTileRows);
    acc[ii][1] = V::load(acc_buf + (i0 + ii) * kTileRows + V::W);
  }
  for (int64_t b = c0; b < c1; ++b) {
    const uint32_t* p = panel + (b - c0) * kPairs * kTileRows;
    for (int q = 0; q < kPairs; ++q) {
      const __m512i w0 = _mm512_loadu_si512(p + q * kTileRows), w1 = _mm512_loadu_si512(p + q * kTileRows + V::W);
      for (int ii = 0; ii < MI; ++ii) {
        const __m512i av = _mm512_set1_epi32(static_cast<int>(xp[(i0 + ii) * kp + b * kPairs + q]));
        acc[ii][0] = dot_pairs(acc[ii][0], av, w0);
        acc[ii][1] = dot_pairs(acc[ii][1], av, w1);
      }
    }
  }
  for (int ii = 0; ii < MI; ++ii) {
    V::store(acc_buf + (i0 + ii) * kTileRows, acc[ii][0]);
    V::store(acc_buf + (i0 + ii) * kTileRows + V::W, acc[ii][1]);
  }
}

template <int MI>
void micro_chain_rows(const uint32_t* xp, int64_t m, int64_t kp, const uint32_t* panel, int64_t c0, int64_t c1,
                      float* acc_buf) {
  int64_t i0 = 0;
  for (; i0 + MI <= m; i0 += MI) micro_chain<MI>(xp, i0, kp, panel, c0, c1, acc_buf);
  if constexpr (MI > 1) {
    if (i0 < m) micro_chain_rows<MI - 1>(xp + i0 * kp, m - i0, kp, panel, c0, c1, acc_buf + i0 * kTileRows);
  }
}

// Rows [r0, r1) of y[m, n] (r0 a multiple of 2W), from the checkpoint's layout or the packed tiles.
template <class Kind>
void gemm_bf16_pairs(const uint32_t* xp, const float* x, int64_t m, const Bf16Matrix& w, float* y, int64_t r0,
                     int64_t r1, Scratch& s) {
  const int64_t kb = k_blocks(w.k), kp = kb * kPairs;
  const bool packed = w.packed.tile_rows == kTileRows;
  for (int64_t row0 = r0; row0 < r1; row0 += kTileRows) {
    const int64_t tile = row0 / kTileRows;
    const int count = static_cast<int>(std::min<int64_t>(kTileRows, r1 - row0));
    // asked for per tile: a fallback below uses the same slots and may move them
    uint32_t* panel = s.get<uint32_t>(ScratchSlot::LinearPanel, static_cast<size_t>(kKc * kPairs * kTileRows));
    float* acc = s.get<float>(ScratchSlot::LinearAcc, static_cast<size_t>(m * kTileRows));
    std::optional<Tile<Kind>> rows;  // the checkpoint's layout
    if (!packed) rows.emplace(w, row0, r1, s);
    std::fill(acc, acc + m * kTileRows, 0.0f);
    __mmask16 outside = 0;
    bool nan = false;
    for (int64_t c0 = 0; c0 < kb; c0 += kKc) {
      const int64_t c1 = std::min(kb, c0 + kKc);
      CheckedPairSink sink{{panel, c0}, 0};
      decode_blocks<Kind>(w, tile, rows, c0, c1, sink, s, nan);
      outside = static_cast<__mmask16>(outside | sink.outside);
      micro_chain_rows<V::MI>(xp, m, kp, panel, c0, c1, acc);
    }
    if (outside != 0) {  // weights the pairs cannot take: this tile the AVX-512 level's way
      packed ? gemm_packed<Kind>(x, nullptr, nullptr, m, w, y, row0, row0 + count, s)
             : gemm_rows<Kind>(x, nullptr, nullptr, m, w, y, row0, row0 + count, s);
      continue;
    }
    for (int64_t i = 0; i < m; ++i) {
      const float* a = acc + i * kTileRows;
      const V::F v0 = finish<Kind>(V::load(a)), v1 = finish<Kind>(V::load(a + V::W));
      packed ? Kind::PDec::store(y + i * w.n + row0, v0, v1, count) : Kind::Dec::store(y + i * w.n + row0, v0, v1, count);
    }
  }
}

// Kind: Bf16Kind<false> (linear_bf16) or Bf16Kind<false, false> (linear_f32 on bf16 values). False
// when the activations cannot be pairs; the caller then takes the AVX-512 level's path.
template <class Kind>
bool run_bf16_pairs(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  static_assert(!Kind::kRounded, "pairs need exact products");
  if (m <= V::kGemvRows || w.n <= 0 || w.k <= 0) return false;  // GEMV: bandwidth-bound
  const bool parallel = w.n * w.k >= kParallelMin;
  bool paired = false;
  // the pairs in the calling thread's scratch (reused call after call), read by every worker
  ex.serial(1, [&](int64_t, int64_t, Scratch& mine) {
    uint32_t* xp = mine.get<uint32_t>(ScratchSlot::PairRows, static_cast<size_t>(m * k_blocks(w.k) * kPairs));
    if (!bf16_activation_pairs(ex, x, m, w.k, parallel, xp)) return;
    paired = true;
    ex.run(parallel, w.n, kTileRows, [&](int64_t r0, int64_t r1, Scratch& s) { gemm_bf16_pairs<Kind>(xp, x, m, w, y, r0, r1, s); });
  });
  return paired;
}

// ---- the ViT's attention: q·k on vdpbf16ps ----------------------------------------------------------
//
// The reference's q·k is one fp32 chain over the head's lanes in order (dense_attention_simd_impl.h),
// the chain vdpbf16ps runs two products at a time (lane e in the upper half, e+1 in the lower). The
// ViT's queries and keys are bf16 values (rounded after its RoPE), so every product is exact; the
// pairs' conditions are the bf16 linears' above, checked over the call's queries and keys, and a call
// that does not meet them takes the fp32 chains (DenseScores).

// Whether q and k (n rows at `stride`, heads·d lanes each, d even) can be pairs; k's pairs into kp
// [n][heads][d/2].
bool dense_pairs(const Exec& ex, const float* q, const float* k, int64_t n, int64_t heads, int64_t d, int64_t stride,
                 uint32_t* kp) {
  const int64_t width = heads * d;
  std::vector<uint8_t> bad(static_cast<size_t>(n), 0);
  ex.run(n * width >= (int64_t{1} << 16), n, 16, [&](int64_t t0, int64_t t1, Scratch&) {
    for (int64_t t = t0; t < t1; ++t) {
      const bool keys = row_pairs(k + t * stride, width, kp + t * width / 2);
      bad[static_cast<size_t>(t)] = !keys || !row_pairs(q + t * stride, width, nullptr);
    }
  });
  return std::none_of(bad.begin(), bad.end(), [](uint8_t b) { return b != 0; });
}

// DenseScores' chains on vdpbf16ps: queries transposed as pairs (qt[p][W]), each key's pair broadcast.
struct DensePairScores {
  const float* q;
  const uint32_t* kp;  // [n][heads][d/2]
  int64_t heads, d, stride;
  V::F operator()(int64_t n, float scale, int64_t i0, int64_t count, int64_t h, float* sc, Scratch& s) const {
    const int64_t dp = d / 2, key_stride = heads * dp;
    uint32_t* qt = s.get<uint32_t>(ScratchSlot::DenseQuery, static_cast<size_t>(dp * V::W));  // [p][W]
    for (int64_t p = 0; p < dp; ++p) {
      for (int l = 0; l < V::W; ++l) {
        const float* qr = q + (i0 + l) * stride + h * d + 2 * p;
        qt[p * V::W + l] = l < count ? pair_bf16(qr[0], qr[1]) : 0u;
      }
    }
    const uint32_t* kh = kp + h * dp;
    const V::F sv = V::set1(scale);
    V::F mx = V::set1(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      V::F acc[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
      for (int64_t p = 0; p < dp; ++p) {
        const __m512i qv = _mm512_loadu_si512(qt + p * V::W);
        for (int r = 0; r < 4; ++r) {
          acc[r] = dot_pairs(acc[r], qv, _mm512_set1_epi32(static_cast<int>(kh[(t + r) * key_stride + p])));
        }
      }
      for (int r = 0; r < 4; ++r) {
        const V::F sr = V::mul(acc[r], sv);
        V::store(sc + (t + r) * V::W, sr);
        mx = V::max(sr, mx);
      }
    }
    for (; t < n; ++t) {
      V::F acc = V::zero();
      for (int64_t p = 0; p < dp; ++p) {
        acc = dot_pairs(acc, _mm512_loadu_si512(qt + p * V::W), _mm512_set1_epi32(static_cast<int>(kh[t * key_stride + p])));
      }
      const V::F sr = V::mul(acc, sv);
      V::store(sc + t * V::W, sr);
      mx = V::max(sr, mx);
    }
    return mx;
  }
};

// ---- sparse attention: q·k on vdpbf16ps ---------------------------------------------------------------
//
// The logits are fp32 chains over d of rounded products (attention_simd_impl.h). Where the query and
// every selected row are bf16 values in the pairs' range (the bf16 linears' conditions, checked per
// call), every product is exact and vdpbf16ps runs the same chain two lanes at a time (lane e in the
// upper half, e+1 in the lower), heads in lanes as the fp32 chains have them; the rest of the op (the
// softmax, P·V) is the AVX-512 level's.
struct PairLogits {
  const float* q;
  int64_t d;
  const uint32_t* rows;  // [n][d/2]: the decoded rows as pairs
  void prepare(int64_t h0, int64_t h1, Scratch& s) {
    const int64_t groups = (h1 - h0 + V::W - 1) / V::W, dp = d / 2;
    qt = s.get<uint32_t>(ScratchSlot::AttentionQuery, static_cast<size_t>(groups * dp * V::W));  // [group][d/2][W]
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t p = 0; p < dp; ++p) {
        for (int l = 0; l < V::W; ++l) {
          const int64_t h = h0 + g * V::W + l;
          qt[(g * dp + p) * V::W + l] = h < h1 ? pair_bf16(q[h * d + 2 * p], q[h * d + 2 * p + 1]) : 0u;
        }
      }
    }
  }
  template <int R>
  void rows_of(const uint32_t* qg, const int64_t* at, float* out) const {
    const int64_t dp = d / 2;
    V::F acc[R];
    const uint32_t* row[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = V::zero();
      row[r] = rows + at[r] * dp;
    }
    for (int64_t p = 0; p < dp; ++p) {
      const __m512i qv = _mm512_loadu_si512(qg + p * V::W);
      for (int r = 0; r < R; ++r) acc[r] = dot_pairs(acc[r], qv, _mm512_set1_epi32(static_cast<int>(row[r][p])));
    }
    for (int r = 0; r < R; ++r) V::store(out + r * V::W, acc[r]);
  }
  void operator()(int64_t g, const int64_t* at, int64_t count, float* out) const {
    const uint32_t* qg = qt + g * (d / 2) * V::W;
    int64_t r = 0;
    for (; r + 4 <= count; r += 4) rows_of<4>(qg, at + r, out + r * V::W);
    for (; r < count; ++r) rows_of<1>(qg, at + r, out + r * V::W);
  }
  uint32_t* qt = nullptr;
};

void sparse_attention_pairs(const Exec& ex, const float* q, int64_t heads, int64_t d, const KvRows& rows,
                            const float* sink, float scale, float* out) {
  if (heads <= 0) return;
  const int64_t n = rows.size();
  const bool parallel = attention_in_parallel(heads, n, d), even = d % 2 == 0;
  ex.serial(1, [&](int64_t, int64_t, Scratch& mine) {
    uint32_t* pairs = mine.get<uint32_t>(ScratchSlot::PairRows, static_cast<size_t>(std::max<int64_t>(n * (d / 2), 1)));
    std::vector<uint8_t> outside(static_cast<size_t>(n), 0);
    const float* const* values = decode_rows(ex, rows, d, parallel, mine, [&](int64_t j, const float* row) {
      if (even) outside[static_cast<size_t>(j)] = !row_pairs(row, d, pairs + j * (d / 2));
    });
    const bool paired = even && row_pairs(q, heads * d, nullptr) &&
                        std::none_of(outside.begin(), outside.end(), [](uint8_t o) { return o != 0; });
    ex.run(parallel, heads, V::W, [&](int64_t h0, int64_t h1, Scratch& s) {
      if (paired) {
        attention_heads(PairLogits{q, d, pairs}, d, values, n, sink, scale, out, h0, h1, s);
      } else {
        attention_heads(ChainLogits{q, d, values}, d, values, n, sink, scale, out, h0, h1, s);
      }
    });
  });
}

// The rounding of vdpbf16ps on this CPU, against the chain the level relies on: a fixed set of
// accumulators and e4m3-like pairs where rounding once, or in the other order, gives other bits.
bool rounds_in_order() {
  uint32_t state = 12345u;
  const auto next = [&state] {
    state = state * 1664525u + 1013904223u;
    return state >> 8;
  };
  for (int t = 0; t < 256; ++t) {
    float a[2], w[2];
    for (int h = 0; h < 2; ++h) {
      a[h] = std::ldexp(static_cast<float>(8 + next() % 8), static_cast<int>(next() % 24) - 12) * (next() % 2 ? -1.0f : 1.0f);
      w[h] = std::ldexp(static_cast<float>(8 + next() % 8), static_cast<int>(next() % 24) - 12);
    }
    const float acc = std::ldexp(static_cast<float>(next() % (1u << 24)), static_cast<int>(next() % 24) - 24);
    const float want = (acc + a[0] * w[0]) + a[1] * w[1];
    alignas(64) float got[16];
    V::store(got, dot_pairs(V::set1(acc), _mm512_set1_epi32(static_cast<int>(pair_bf16(a[0], a[1]))),
                            _mm512_set1_epi32(static_cast<int>(pair_bf16(w[0], w[1])))));
    if (std::memcmp(&got[0], &want, 4) != 0) return false;
  }
  return true;
}

// FLOPs per second of vdpbf16ps over those of vfmadd (zmm), each in a register-only loop of 16
// independent chains, best of a few short runs: whether the pair GEMM can beat the AVX-512 one.
// (machine_peaks.cpp measures the same units at length for bench.)
double dot_over_fma_rate() {
  constexpr int kChains = 16;
  constexpr int64_t kIters = 20000;  // about 0.1-0.5 ms per run
  const auto best_seconds = [](auto loop) {
    double best = 1e30;
    for (int run = 0; run < 5; ++run) {
      const auto t0 = std::chrono::steady_clock::now();
      loop();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  alignas(64) float sink[16];
  const double dot_s = best_seconds([&] {
    const __m512i a = _mm512_set1_epi32(0x3F803F80), b = _mm512_set1_epi32(0x3C003C00);  // (1, 1) · (2^-7, 2^-7)
    __m512 c[kChains];
    for (int j = 0; j < kChains; ++j) c[j] = V::set1(static_cast<float>(j));
    for (int64_t i = 0; i < kIters; ++i) {
#pragma GCC unroll 16
      for (int j = 0; j < kChains; ++j) c[j] = dot_pairs(c[j], a, b);
    }
    for (int j = 1; j < kChains; ++j) c[0] = V::add(c[0], c[j]);
    V::store(sink, c[0]);
  });
  const double fma_s = best_seconds([&] {
    const __m512 a = V::set1(0.999999f), b = V::set1(0.5f);
    __m512 c[kChains];
    for (int j = 0; j < kChains; ++j) c[j] = V::set1(static_cast<float>(j));
    for (int64_t i = 0; i < kIters; ++i) {
#pragma GCC unroll 16
      for (int j = 0; j < kChains; ++j) c[j] = V::fma(c[j], a, b);
    }
    for (int j = 1; j < kChains; ++j) c[0] = V::add(c[0], c[j]);
    V::store(sink, c[0]);
  });
  asm volatile("" : : "r"(sink) : "memory");
  return (4.0 / dot_s) / (2.0 / fma_s);  // 4 FLOPs per lane for a dot, 2 for an FMA
}

}  // namespace dsv41::detail::avx512_bf16

namespace dsv41::detail {

void linear_fp8_avx512_bf16(const Exec& ex, const float* x, int64_t m, const Fp8Matrix& w, float* y) {
  avx512_bf16::run_linear_pairs<avx512_bf16::Fp8Kind>(ex, x, m, w, y);
}
void linear_fp4_avx512_bf16(const Exec& ex, const float* x, int64_t m, const Fp4Matrix& w, float* y) {
  avx512_bf16::run_linear_pairs<avx512_bf16::Fp4Kind>(ex, x, m, w, y);
}
void linear_fp8_avx512_bf16_vbmi(const Exec& ex, const float* x, int64_t m, const Fp8Matrix& w, float* y) {
  avx512_bf16::run_linear_vbmi<avx512_bf16::Fp8Kind>(ex, x, m, w, y);
}
void linear_fp4_avx512_bf16_vbmi(const Exec& ex, const float* x, int64_t m, const Fp4Matrix& w, float* y) {
  avx512_bf16::run_linear_vbmi<avx512_bf16::Fp4Kind>(ex, x, m, w, y);
}
void linear_bf16_avx512_bf16(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  using Exact = avx512_bf16::Bf16Kind<false>;
  if (!avx512_bf16::run_bf16_pairs<Exact>(ex, x, m, w, y)) avx512_bf16::run_linear<Exact>(ex, x, m, w, y);
}
void linear_f32_avx512_bf16(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  using ExactF32 = avx512_bf16::Bf16Kind<false, false>;
  if (avx512_bf16::run_bf16_pairs<ExactF32>(ex, x, m, w, y)) return;
  if (avx512_bf16::all_bf16_values(x, m * w.k)) return avx512_bf16::run_linear<ExactF32>(ex, x, m, w, y);
  avx512_bf16::run_linear<avx512_bf16::Bf16Kind<true>>(ex, x, m, w, y);
}
void dense_attention_avx512_bf16(const Exec& ex, const float* q, const float* k, const float* v, int64_t n,
                                 int64_t heads, int64_t d, int64_t stride, float scale, float* out) {
  bool paired = false;
  if (d % 2 == 0) {
    // the key pairs in the calling thread's scratch (reused call after call), read by every worker
    ex.serial(1, [&](int64_t, int64_t, Scratch& mine) {
      uint32_t* kp = mine.get<uint32_t>(ScratchSlot::PairRows, static_cast<size_t>(n * heads * d / 2));
      if (!avx512_bf16::dense_pairs(ex, q, k, n, heads, d, stride, kp)) return;
      paired = true;
      avx512_bf16::dense_attention_simd(ex, avx512_bf16::DensePairScores{q, kp, heads, d, stride}, v, n, heads, d,
                                        stride, scale, out);
    });
  }
  if (!paired) avx512_bf16::dense_attention_simd(ex, q, k, v, n, heads, d, stride, scale, out);
}
void sparse_attention_avx512_bf16(const Exec& ex, const float* q, int64_t heads, int64_t d, const KvRows& rows,
                                  const float* sink, float scale, float* out) {
  avx512_bf16::sparse_attention_pairs(ex, q, heads, d, rows, sink, scale, out);
}
bool bf16_dot_rounds_in_order() { return avx512_bf16::rounds_in_order(); }
double bf16_dot_over_fma_rate() { return avx512_bf16::dot_over_fma_rate(); }

}  // namespace dsv41::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#else  // not x86: the level is never available; the references stand in so the build links

namespace dsv41::detail {
void linear_fp8_avx512_bf16(const Exec&, const float* x, int64_t m, const Fp8Matrix& w, float* y) {
  reference::linear_fp8(x, m, w, y);
}
void linear_fp4_avx512_bf16(const Exec&, const float* x, int64_t m, const Fp4Matrix& w, float* y) {
  reference::linear_fp4(x, m, w, y);
}
void linear_fp8_avx512_bf16_vbmi(const Exec&, const float* x, int64_t m, const Fp8Matrix& w, float* y) {
  reference::linear_fp8(x, m, w, y);
}
void linear_fp4_avx512_bf16_vbmi(const Exec&, const float* x, int64_t m, const Fp4Matrix& w, float* y) {
  reference::linear_fp4(x, m, w, y);
}
void linear_bf16_avx512_bf16(const Exec&, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  reference::linear_bf16(x, m, w, y);
}
void linear_f32_avx512_bf16(const Exec&, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  reference::linear_f32(x, m, w, y);
}
void dense_attention_avx512_bf16(const Exec&, const float* q, const float* k, const float* v, int64_t n,
                                 int64_t heads, int64_t d, int64_t stride, float scale, float* out) {
  reference::dense_attention(q, k, v, n, heads, d, stride, scale, out);
}
void sparse_attention_avx512_bf16(const Exec&, const float* q, int64_t heads, int64_t d, const KvRows& rows,
                                  const float* sink, float scale, float* out) {
  reference::sparse_attention(q, heads, d, rows, sink, scale, out);
}
bool bf16_dot_rounds_in_order() { return false; }
double bf16_dot_over_fma_rate() { return 0.0; }
}  // namespace dsv41::detail

#endif
