// AVX-512-BF16 kernels: the GEMM path (more than V::kGemvRows rows) of the FP8, FP4 and BF16 linear
// layers on vdpbf16ps, two products per fp32 lane and instruction where the AVX-512 level's FMA does
// one (the BF16 layers' conditions are with their kernel below).
// The level's other ops, and these layers' GEMV path (bandwidth-bound: decode steps), are the
// AVX-512 level's (backend.cpp).
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
//    and none of them is subnormal.
// The per-block scaling and the accumulation over blocks are the AVX-512 level's fp32 operations.
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

// The activations (prescaled act_quant values, exact in bf16) as pairs: [m][k/2].
std::vector<uint32_t> activation_pairs(const Exec& ex, const QuantizedActivations& a, bool parallel) {
  std::vector<uint32_t> out(static_cast<size_t>(a.m * (a.k / 2)));
  const auto rows = [&](int64_t i0, int64_t i1, Scratch&) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* x = a.row(i);
      uint32_t* o = out.data() + i * (a.k / 2);
      for (int64_t p = 0; p < a.k / 2; ++p) o[p] = pair_bf16(x[2 * p], x[2 * p + 1]);
    }
  };
  ex.run(parallel && a.m > 1, a.m, 1, rows);
  return out;
}

// ---- the GEMM -------------------------------------------------------------------------------------

// MI activation rows × one tile over the panel's blocks [c0, c1), as linear_simd_impl.h's micro:
// per block 2·MI partial chains of 16 vdpbf16ps, then the scaled accumulation in fp32.
template <int MI>
void micro_pairs(const uint32_t* xp, const float* xs, int64_t i0, int64_t k, const uint32_t* panel, const float* ws,
                 int64_t c0, int64_t c1, float* acc_buf) {
  using F = V::F;
  const int64_t kb = k / kQBlock, kp = k / 2;
  F acc[MI][2];
  for (int ii = 0; ii < MI; ++ii) {
    acc[ii][0] = V::load(acc_buf + (i0 + ii) * kTileRows);
    acc[ii][1] = V::load(acc_buf + (i0 + ii) * kTileRows + V::W);
  }
  for (int64_t b = c0; b < c1; ++b) {
    const uint32_t* p = panel + (b - c0) * kPairs * kTileRows;
    F part[MI][2];
    for (int ii = 0; ii < MI; ++ii) part[ii][0] = part[ii][1] = V::zero();
    for (int q = 0; q < kPairs; ++q) {
      const __m512i w0 = _mm512_loadu_si512(p + q * kTileRows), w1 = _mm512_loadu_si512(p + q * kTileRows + V::W);
      for (int ii = 0; ii < MI; ++ii) {
        const __m512i av = _mm512_set1_epi32(static_cast<int>(xp[(i0 + ii) * kp + b * kPairs + q]));
        part[ii][0] = dot_pairs(part[ii][0], av, w0);
        part[ii][1] = dot_pairs(part[ii][1], av, w1);
      }
    }
    const F s0 = V::load(ws + (2 * b) * V::W), s1 = V::load(ws + (2 * b + 1) * V::W);
    for (int ii = 0; ii < MI; ++ii) {
      const F as = V::set1(xs[(i0 + ii) * kb + b]);
      acc[ii][0] = V::add(acc[ii][0], V::mul(V::mul(part[ii][0], as), s0));
      acc[ii][1] = V::add(acc[ii][1], V::mul(V::mul(part[ii][1], as), s1));
    }
  }
  for (int ii = 0; ii < MI; ++ii) {
    V::store(acc_buf + (i0 + ii) * kTileRows, acc[ii][0]);
    V::store(acc_buf + (i0 + ii) * kTileRows + V::W, acc[ii][1]);
  }
}

template <int MI>
void micro_pairs_rows(const uint32_t* xp, const float* xs, int64_t m, int64_t k, const uint32_t* panel,
                      const float* ws, int64_t c0, int64_t c1, float* acc_buf) {
  int64_t i0 = 0;
  for (; i0 + MI <= m; i0 += MI) micro_pairs<MI>(xp, xs, i0, k, panel, ws, c0, c1, acc_buf);
  if constexpr (MI > 1) {
    if (i0 < m) {
      micro_pairs_rows<MI - 1>(xp + i0 * (k / 2), xs + i0 * (k / kQBlock), m - i0, k, panel, ws, c0, c1,
                               acc_buf + i0 * kTileRows);
    }
  }
}

// Rows [r0, r1) of y[m, n] (r0 a multiple of 2W), from the checkpoint's layout or the packed tiles.
template <class Kind>
void gemm_pairs(const uint32_t* xp, const QuantizedActivations& qa, const typename Kind::Matrix& w, float* y,
                int64_t r0, int64_t r1, Scratch& s) {
  const int64_t m = qa.m, kb = w.k / kQBlock;
  const bool packed = w.packed.tile_rows == kTileRows;
  float* ws = s.get<float>(ScratchSlot::LinearScales, static_cast<size_t>(kb * kTileRows));
  uint32_t* panel = s.get<uint32_t>(ScratchSlot::LinearPanel, static_cast<size_t>(kKc * kPairs * kTileRows));
  float* acc = s.get<float>(ScratchSlot::LinearAcc, static_cast<size_t>(m * kTileRows));
  const uint8_t* blk[kTileRows];
  for (int64_t row0 = r0; row0 < r1; row0 += kTileRows) {
    const int64_t tile = row0 / kTileRows;
    const int count = static_cast<int>(std::min<int64_t>(kTileRows, r1 - row0));
    if (packed && packed_nan<Kind>(w, tile)) {
      tile_scalar<Kind>(qa, w, y, row0, count);
      continue;
    }
    std::optional<Tile<Kind>> rows;  // the checkpoint's layout
    if (packed) {
      Kind::packed_scales(w, tile, ws);
    } else {
      rows.emplace(w, row0, r1, s);
      Kind::tile_scales(w, row0, count, ws);
    }
    std::fill(acc, acc + m * kTileRows, 0.0f);
    bool nan = false;
    for (int64_t c0 = 0; c0 < kb; c0 += kKc) {
      const int64_t c1 = std::min(kb, c0 + kKc);
      PairSink sink{panel, c0};
      for (int64_t b = c0; b < c1; ++b) {
        if (packed) {
          Kind::PDec::step(packed_block<Kind>(w, tile, b), b, sink);
        } else {
          rows->block(b, blk, s);
          Kind::Dec::step(blk, b, sink, nan);
        }
      }
      micro_pairs_rows<V::MI>(xp, qa.scales.data(), m, w.k, panel, ws, c0, c1, acc);
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

template <class Kind>
void run_linear_pairs(const Exec& ex, const float* x, int64_t m, const typename Kind::Matrix& w, float* y) {
  static_assert(Kind::kScaled, "the pair GEMM is for the quantized kinds: their products are exact");
  if (m <= V::kGemvRows || w.n <= 0) return run_linear<Kind>(ex, x, m, w, y);  // GEMV: bandwidth-bound
  assert(w.k % kQBlock == 0 && "act_quant needs K in whole blocks of 32");
  const bool parallel = w.n * w.k >= kParallelMin;
  const QuantizedActivations qa = quantize_rows(&ex, x, m, w.k, Kind::kPrescale, parallel);
  const std::vector<uint32_t> xp = activation_pairs(ex, qa, parallel);
  ex.run(parallel, w.n, kTileRows,
         [&](int64_t r0, int64_t r1, Scratch& s) { gemm_pairs<Kind>(xp.data(), qa, w, y, r0, r1, s); });
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
  const uint8_t* blk[kTileRows];
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
      for (int64_t b = c0; b < c1; ++b) {
        if (packed) {
          Kind::PDec::step(packed_block<Kind>(w, tile, b), b, sink);
        } else {
          rows->block(b, blk, s);
          Kind::Dec::step(blk, b, sink, nan);
        }
      }
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
bool bf16_dot_rounds_in_order() { return false; }
double bf16_dot_over_fma_rate() { return 0.0; }
}  // namespace dsv41::detail

#endif
