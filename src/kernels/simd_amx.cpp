// AMX-BF16 kernels: the FP8, FP4 and BF16 linear layers on the tile unit (tdpbf16ps: a 16×32 bf16 tile of
// activations times a 32×16 bf16 tile of weights into a 16×16 fp32 tile, 16,384 FLOPs an
// instruction). The weights stay in the checkpoint's formats (or the load-time packing of them);
// each 32-row weight tile is widened, a panel of K blocks at a time, into a cache-resident bf16
// buffer and reused by every activation row. The level's other ops are the AVX-512-BF16 level's.
//
// The numerics are this level's own, declared rather than the reference's bits:
//  * the operands are exact: a widened weight is its e4m3 (or e2m1) value times its power-of-two
//    block scale, an activation its act_quant'ed e4m3 value times its power-of-two block scale; at
//    most 4 significant bits each, so bf16 holds them and every product is exact in fp32 (BF16
//    layers: bf16 weights and activations as they are, their products exact too). Where a
//    scale would put an operand outside the safe range below (so that a product could be
//    subnormal, which the tile unit flushes, or a sum could overflow), that row takes the AVX-512
//    level's path and that weight tile the scalar reference's, both with the reference's bits;
//  * the sum is not the reference's chain. The reference sums each 32-block's products in one fp32
//    chain, rounding after every add, then adds the block times its scales. With the scales folded
//    into the operands, the tile unit sums all of K in its accumulator, 32 products an
//    instruction, and rounds as it does: probed on this project's Xeon (Sapphire Rapids class), a
//    pair of products is added exactly and rounded once, and several pairs are aligned to the
//    largest and summed with the low bits of the smaller ones cut, so neither the chain's bits nor
//    the exactly rounded sum's come out. Both sums are within a few fp32 units in the last place
//    of Σ|a·w| per instruction and per block; the op harness bounds the difference from the
//    reference by that (tests/ops_util.h) and docs/agreement.md states the agreement it leaves;
//  * a row's result depends on its own activations and the weights only: every row, whatever the
//    batch, runs the same instructions over the same K blocks in the same order (tile rows are
//    independent in the unit), so batching and chunking never change a bit. There is no switch by
//    row count: a decode step (m = 1) runs on the tiles too, else a prompt and its decode would
//    disagree with the speculative verifier's batch.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "kernels/amx_tile_config.h"
#include "kernels/linear_internal.h"
#include "kernels/reference.h"
#include "kernels/torch_math.h"
#include "numeric/formats.h"
#include "numeric/quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(                                                                                \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16"))), \
    apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")
#pragma GCC optimize("fp-contract=off")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace dsv41::detail::amx {

#include "kernels/simd_avx512_ops.h"

#include "kernels/linear_simd_impl.h"

// ---- tiles ----------------------------------------------------------------------------------------

// Tiles 0-3 accumulate (16 rows × 16 fp32), 4-5 hold activation rows (16 × 32 bf16), 6-7 weight
// pairs (16 pair rows × 16 outputs × 2 bf16). Every tile is 16 rows of 64 bytes; a matrix with fewer
// rows is padded with zero rows, so one configuration serves all.
// The calling thread's tile state, configured for the life of the object (the state is per thread).
struct TileScope {
  TileScope() {
    AmxTileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.bytes_per_row[t] = 64;
      cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

constexpr int64_t kTileM = 16;                // activation rows per A tile
constexpr int64_t kPanelBlocks = 8;           // K blocks widened at a time: 32 rows × 256 k × 2 B = 16 KiB
constexpr int64_t kBlockPairs = 16 * 16 * 2;  // uint32 pairs of one K block of a weight tile (2 B tiles)

// Operands within [2^-60, 2^50] (activations) and [2^-60, 2^40] (weights), where the tile unit's
// flush of subnormals and the fp32 range cannot bite: their products lie in [2^-120, 2^90], sums of
// up to 2^20 of them below 2^110. The scales are checked: the values they multiply are prescaled
// e4m3 activations (|v| in [2^-1, 2^17]; FP4 layers [2^-9, 448]) and decoded weights (e4m3·2^-8 in
// [2^-17, 1.75]; e2m1 in [0.5, 6]).
constexpr float kMinScaleW = 0x1p-43f, kMaxScaleW = 0x1p37f;
constexpr float kMinScaleA = 0x1p-51f, kMaxScaleA = 0x1p33f;
// The BF16 layers' operands are checked value by value against the same range.
constexpr float kMinOperand = 0x1p-60f, kMaxBf16Weight = 0x1p40f, kMaxBf16Activation = 0x1p50f;

// Lanes holding a value that is neither zero nor in [2^-60, max] in magnitude (NaN included).
inline __mmask16 out_of_range(__m512 v, float max) {
  const __m512 a = _mm512_abs_ps(v);
  const __mmask16 zero = _mm512_cmp_ps_mask(a, V::zero(), _CMP_EQ_OQ);
  const __mmask16 in = _mm512_cmp_ps_mask(a, V::set1(kMinOperand), _CMP_GE_OQ) &
                       _mm512_cmp_ps_mask(a, V::set1(max), _CMP_LE_OQ);
  return static_cast<__mmask16>(~(zero | in));
}

// A decoder's sink (linear_simd_impl.h) that widens a tile's weights, times their block scales, into
// the B tiles' pair layout: block rb of the panel holds B tile v (outputs in the decoder's lane order
// of vector v) at panel[rb][v][q][lane] = (w[k = 2q], w[2q + 1]) as (low, high) bf16 halves. BF16
// weights have no scales; their values are checked instead (`bad`: a lane held a value outside the
// safe range, a NaN or an infinity).
template <bool Scaled>
struct WidenSink {
  uint32_t* panel;
  const float* ws;  // the tile's weight scales [kb][2][W] (Scaled)
  int64_t c0 = 0;
  uint16_t* base = nullptr;
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  __mmask16 bad = 0;
  void begin(int64_t b) {
    base = reinterpret_cast<uint16_t*>(panel + (b - c0) * kBlockPairs);
    if constexpr (Scaled) {
      s0 = V::load(ws + (2 * b) * V::W);
      s1 = V::load(ws + (2 * b + 1) * V::W);
    }
  }
  // j = 0..31 in order. The products by powers of two are exact, so a bf16 is the top half of its
  // fp32; an even k goes to the low half of its pair, an odd one to the high half, by a masked
  // 16-bit store (no branch on j).
  void w(int j, __m512 v0, __m512 v1) {
    if constexpr (Scaled) {
      v0 = V::mul(v0, s0);
      v1 = V::mul(v1, s1);
    } else {
      bad = static_cast<__mmask16>(bad | out_of_range(v0, kMaxBf16Weight) | out_of_range(v1, kMaxBf16Weight));
    }
    const int odd = j & 1;
    const __mmask32 halves = 0x55555555u << odd;
    const __m128i shift = _mm_cvtsi32_si128(16 - 16 * odd);
    uint16_t* p = base + (j / 2) * 32;
    _mm512_mask_storeu_epi16(p, halves, _mm512_srl_epi32(_mm512_castps_si512(v0), shift));
    _mm512_mask_storeu_epi16(p + 512, halves, _mm512_srl_epi32(_mm512_castps_si512(v1), shift));
  }
  void end(int64_t) {}
};

// The activations as the A tiles read them, each tile's 1 KiB contiguous (a tile load touches 16
// consecutive cache lines, not 16 pages): bf16 [m_pad/16][k/32][16][32], rows past m zero, each
// value its prescaled act_quant'ed e4m3 value times its block scale (the decoders' weights carry the
// inverse of the prescale, so each product is the reference's a·w·a_s·w_s exactly). ok[i] is false
// for a row whose scales leave the safe range or that holds a NaN.
struct Activations {
  int64_t m = 0, m_pad = 0, k = 0;
  std::unique_ptr<uint16_t[]> values;  // every element written: pad rows with zeros
  std::vector<char> ok;
  const uint16_t* data() const { return values.get(); }
};

// act_quant of each row (quantize_row, as every level computes it) straight into the tile layout.
Activations widen_activations(const Exec& ex, const float* x, int64_t m, int64_t k, float prescale, bool parallel) {
  Activations a;
  a.m = m;
  a.k = k;
  a.m_pad = (m + kTileM - 1) / kTileM * kTileM;
  a.values.reset(new uint16_t[static_cast<size_t>(a.m_pad * k)]);
  a.ok.assign(static_cast<size_t>(m), 1);
  const int64_t kb = k / kQBlock;
  const auto row_out = [&](int64_t i) { return a.values.get() + (i / kTileM) * kTileM * k + (i % kTileM) * kQBlock; };
  const auto rows = [&](int64_t i0, int64_t i1, Scratch&) {
    std::vector<float> q(static_cast<size_t>(k)), scales(static_cast<size_t>(kb));
    for (int64_t i = i0; i < i1; ++i) {
      quantize_row(x + i * k, k, prescale, q.data(), scales.data());
      uint16_t* out = row_out(i);
      bool ok = true;
      for (int64_t b = 0; b < kb; ++b) {
        ok = ok && scales[b] >= kMinScaleA && scales[b] <= kMaxScaleA;
        const __m512 scale = V::set1(scales[b]);
        for (int h = 0; h < 2; ++h) {
          const __m512 v = V::mul(V::load(q.data() + b * kQBlock + h * 16), scale);
          ok = ok && _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) == 0;
          const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kTileM * kQBlock + h * 16),
                              _mm512_cvtepi32_epi16(top));
        }
      }
      a.ok[i] = ok;
    }
  };
  ex.run(parallel && m > 1, m, 1, rows);
  for (int64_t i = m; i < a.m_pad; ++i) {
    for (int64_t b = 0; b < kb; ++b) std::fill_n(row_out(i) + b * kTileM * kQBlock, kQBlock, uint16_t{0});
  }
  return a;
}

// BF16 layers' activations (bf16 values, linear_bf16's contract) in the same layout, K padded with
// zeros to whole blocks; ok[i] is false for a row holding a value outside the safe range.
Activations bf16_activations(const Exec& ex, const float* x, int64_t m, int64_t k, bool parallel) {
  Activations a;
  a.m = m;
  a.k = k_blocks(k) * kQBlock;
  a.m_pad = (m + kTileM - 1) / kTileM * kTileM;
  a.values.reset(new uint16_t[static_cast<size_t>(a.m_pad * a.k)]);
  a.ok.assign(static_cast<size_t>(m), 1);
  const int64_t kb = a.k / kQBlock;
  const auto row_out = [&](int64_t i) { return a.values.get() + (i / kTileM) * kTileM * a.k + (i % kTileM) * kQBlock; };
  const auto rows = [&](int64_t i0, int64_t i1, Scratch&) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* xr = x + i * k;
      uint16_t* out = row_out(i);
      __mmask16 bad = 0;
      for (int64_t b = 0; b < kb; ++b) {
        for (int h = 0; h < 2; ++h) {
          const int64_t j = b * kQBlock + h * 16;
          const __mmask16 real = static_cast<__mmask16>(j + 16 <= k ? 0xFFFF : j < k ? (1u << (k - j)) - 1u : 0u);
          const __m512 v = _mm512_maskz_loadu_ps(real, xr + j);
          bad = static_cast<__mmask16>(bad | out_of_range(v, kMaxBf16Activation));
          const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kTileM * kQBlock + h * 16),
                              _mm512_cvtepi32_epi16(top));
        }
      }
      a.ok[i] = bad == 0;
    }
  };
  ex.run(parallel && m > 1, m, 1, rows);
  for (int64_t i = m; i < a.m_pad; ++i) {
    for (int64_t b = 0; b < kb; ++b) std::fill_n(row_out(i) + b * kTileM * kQBlock, kQBlock, uint16_t{0});
  }
  return a;
}

// Whether a tile's weight scales (fp32 lanes [kb][2][W]) keep every widened weight in range.
bool scales_in_range(const float* ws, int64_t kb) {
  const __m512 lo = V::set1(kMinScaleW), hi = V::set1(kMaxScaleW);
  __mmask16 bad = 0;
  for (int64_t i = 0; i < kb * kTileRows; i += V::W) {
    const __m512 v = V::load(ws + i);  // NaN (code 0xFF) compares false: out of range
    bad |= static_cast<__mmask16>(~(_mm512_cmp_ps_mask(v, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(v, hi, _CMP_LE_OQ)));
  }
  return bad == 0;
}

// The reference's computation of one weight tile for every row (a tile with NaN codes or scales out
// of range: rare, so the activations are quantized again here rather than kept for it).
template <class Kind>
void tile_reference(const float* x, int64_t m, const typename Kind::Matrix& w, float* y, int64_t row0, int count) {
  if constexpr (!Kind::kScaled) {  // BF16
    // Packed, the weights are read from the tile (element (r, j) at j·32 + r): a packed BF16 matrix
    // need not keep its row-major values (the loader drops wo_a's converted copy).
    const bool packed = w.packed.tile_rows == kTileRows;
    const uint16_t* tile =
        packed ? reinterpret_cast<const uint16_t*>(w.packed.tiles + (row0 / kTileRows) * w.packed.tile_bytes) : nullptr;
    for (int64_t i = 0; i < m; ++i) {
      for (int r = 0; r < count; ++r) {
        const auto weight = [&](int64_t j) { return packed ? tile[j * kTileRows + r] : w.w[(row0 + r) * w.k + j]; };
        float acc = 0.0f;  // reference::linear_bf16's chain: bf16 products are exact in fp32
        for (int64_t j = 0; j < w.k; ++j) acc += x[i * w.k + j] * bf16_to_f32(weight(j));
        y[i * w.n + row0 + r] = round_bf16(acc);
      }
    }
    return;
  }
  const QuantizedActivations qa = quantize_rows(nullptr, x, m, w.k, Kind::kPrescale, false);
  if constexpr (std::is_same_v<Kind, Fp8Kind>) {
    tile_scalar<Kind>(qa, w, y, row0, count);
  } else if constexpr (std::is_same_v<Kind, Fp4Kind>) {
    float table16[16];
    for (int c = 0; c < 16; ++c) table16[c] = e2m1_to_f32(static_cast<uint8_t>(c));
    const int64_t kb = w.k / kQBlock, row_bytes = w.k / 2;
    // Packed, a row's bytes and scales are gathered from its tile (byte c of row r at c·32 + r, scale
    // block b at b·32 + r): a packed FP4 matrix need not keep its row-major bytes (the expert cache
    // holds packed experts only).
    const bool packed = w.packed.tile_rows == kTileRows;
    std::vector<uint8_t> row(packed ? static_cast<size_t>(row_bytes + kb) : 0);
    for (int r = 0; r < count; ++r) {
      const int64_t n = row0 + r;
      const uint8_t* wr = nullptr;
      const uint8_t* sr = nullptr;
      if (!packed) {
        wr = w.w + n * row_bytes;
        sr = w.scale + n * kb;
      } else {
        const uint8_t* tile = w.packed.tiles + (row0 / kTileRows) * w.packed.tile_bytes;
        const uint8_t* scales = w.packed.scales + (row0 / kTileRows) * w.packed.scale_tile_bytes;
        for (int64_t c = 0; c < row_bytes; ++c) row[static_cast<size_t>(c)] = tile[c * kTileRows + r];
        for (int64_t b = 0; b < kb; ++b) row[static_cast<size_t>(row_bytes + b)] = scales[b * kTileRows + r];
        wr = row.data();
        sr = row.data() + row_bytes;
      }
      for (int64_t i = 0; i < qa.m; ++i) {
        y[i * w.n + n] = round_bf16(fp4_dot_scalar(qa.row(i), qa.row_scales(i), wr, sr, w.k, table16));
      }
    }
  }
}

// The tile unit's work for activation rows [i0, i0 + 16·R) × one weight tile (two B tiles) over the
// panel's blocks [c0, c1), into accumulator tiles 0-1 (rows i0..) and 2-3 (rows i0 + 16..).
template <int R>
void dot_blocks(const Activations& a, const uint32_t* panel, int64_t i0, int64_t c0, int64_t c1) {
  for (int64_t b = c0; b < c1; ++b) {
    const uint16_t* x = a.data() + i0 * a.k + b * kTileM * kQBlock;
    const uint32_t* p = panel + (b - c0) * kBlockPairs;
    _tile_loadd(4, x, 64);
    _tile_loadd(6, p, 64);
    _tile_loadd(7, p + 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (R == 2) {
      _tile_loadd(5, x + kTileM * a.k, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// Accumulator tiles to and from acc ([m_pad][32] fp32) for rows [i0, i0 + 16·R).
constexpr int64_t kAccStride = kTileRows * 4;  // bytes per accumulator row
template <int R>
void zero_acc() {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (R == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
}
template <int R>
void load_acc(const float* acc, int64_t i0) {
  const float* c = acc + i0 * kTileRows;
  _tile_loadd(0, c, kAccStride);
  _tile_loadd(1, c + 16, kAccStride);
  if constexpr (R == 2) {
    _tile_loadd(2, c + 16 * kTileRows, kAccStride);
    _tile_loadd(3, c + 16 * kTileRows + 16, kAccStride);
  }
}
template <int R>
void store_acc(float* acc, int64_t i0) {
  float* c = acc + i0 * kTileRows;
  _tile_stored(0, c, kAccStride);
  _tile_stored(1, c + 16, kAccStride);
  if constexpr (R == 2) {
    _tile_stored(2, c + 16 * kTileRows, kAccStride);
    _tile_stored(3, c + 16 * kTileRows + 16, kAccStride);
  }
}

// Many rows: per panel, each 32-row group's accumulators are loaded, advanced and stored back.
template <int R>
void panel_rows(const Activations& a, const uint32_t* panel, int64_t i0, int64_t c0, int64_t c1, float* acc) {
  c0 == 0 ? zero_acc<R>() : load_acc<R>(acc, i0);
  dot_blocks<R>(a, panel, i0, c0, c1);
  store_acc<R>(acc, i0);
}

// Activation rows per pass over the weights: their panel (rows × 256 k in bf16, 512 KiB) stays in the
// core's L2 while every weight tile of the thread's range goes past it.
constexpr int64_t kRowBlock = 1024;

// Outputs [r0, r1) of y[m, n] (r0 a multiple of 32), from the checkpoint's layout or the packed tiles.
// Up to 32 rows (decode steps, speculative verification), each weight tile runs over all of K with
// its accumulators resident in the tiles. More rows go K panel by K panel, every weight tile of the
// range against the panel of up to kRowBlock rows, the accumulators stored between panels (fp32,
// exact): the same instructions on the same values in the same order either way, so the same bits.
template <class Kind>
void gemm_tiles(const Activations& a, const float* x, const typename Kind::Matrix& w, float* y,
                int64_t r0, int64_t r1, Scratch& s) {
  const int64_t kb = k_blocks(w.k);
  const int64_t tiles = (r1 - r0 + kTileRows - 1) / kTileRows;
  const bool packed = w.packed.tile_rows == kTileRows;
  const int64_t block_rows = std::min(a.m_pad, kRowBlock);
  float* ws_all = s.get<float>(ScratchSlot::LinearScales, static_cast<size_t>(tiles * kb * kTileRows));
  uint32_t* panel = s.get<uint32_t>(ScratchSlot::LinearPanel, static_cast<size_t>(kPanelBlocks * kBlockPairs));
  float* acc_all = s.get<float>(ScratchSlot::LinearAcc, static_cast<size_t>(tiles * block_rows * kTileRows));
  const auto row0_of = [&](int64_t t) { return r0 + t * kTileRows; };
  const auto count_of = [&](int64_t t) { return static_cast<int>(std::min<int64_t>(kTileRows, r1 - row0_of(t))); };
  // 'r': the reference's computation (NaN codes, scales out of range); 'n': NaN codes found while
  // widening the checkpoint's layout; 0: the tile unit's.
  std::vector<char> fallback(static_cast<size_t>(tiles), 0);
  for (int64_t t = 0; t < tiles; ++t) {
    float* ws = ws_all + t * kb * kTileRows;
    const int64_t tile = row0_of(t) / kTileRows;
    packed ? Kind::packed_scales(w, tile, ws) : Kind::tile_scales(w, row0_of(t), count_of(t), ws);
    if ((packed && packed_nan<Kind>(w, tile)) || (Kind::kScaled && !scales_in_range(ws, kb))) {
      tile_reference<Kind>(x, a.m, w, y, row0_of(t), count_of(t));
      fallback[t] = 'r';
    }
  }
  const uint8_t* blk[kTileRows];
  const auto widen = [&](int64_t t, int64_t c0, int64_t c1) {
    WidenSink<Kind::kScaled> sink{panel, ws_all + t * kb * kTileRows, c0};
    bool nan = false;
    if (packed) {
      for (int64_t b = c0; b < c1; ++b) Kind::PDec::step(packed_block<Kind>(w, row0_of(t) / kTileRows, b), b, sink);
    } else {
      const Tile<Kind> rows(w, row0_of(t), r1, s);
      for (int64_t b = c0; b < c1; ++b) {
        rows.block(b, blk, s);
        Kind::Dec::step(blk, b, sink, nan);
      }
    }
    if (nan || sink.bad != 0) fallback[t] = 'n';
  };
  const TileScope tile_state;
  for (int64_t m0 = 0; m0 < a.m_pad; m0 += block_rows) {
    const int64_t m1 = std::min(a.m_pad, m0 + block_rows);
    const auto acc_of = [&](int64_t t) { return acc_all + t * block_rows * kTileRows - m0 * kTileRows; };
    if (m1 - m0 <= 2 * kTileM) {
      for (int64_t t = 0; t < tiles; ++t) {
        if (fallback[t] == 'r') continue;
        m1 - m0 == kTileM ? zero_acc<1>() : zero_acc<2>();
        for (int64_t c0 = 0; c0 < kb; c0 += kPanelBlocks) {
          const int64_t c1 = std::min(kb, c0 + kPanelBlocks);
          widen(t, c0, c1);
          m1 - m0 == kTileM ? dot_blocks<1>(a, panel, m0, c0, c1) : dot_blocks<2>(a, panel, m0, c0, c1);
        }
        m1 - m0 == kTileM ? store_acc<1>(acc_of(t), m0) : store_acc<2>(acc_of(t), m0);
      }
    } else {
      for (int64_t c0 = 0; c0 < kb; c0 += kPanelBlocks) {
        const int64_t c1 = std::min(kb, c0 + kPanelBlocks);
        for (int64_t t = 0; t < tiles; ++t) {
          if (fallback[t] == 'r') continue;
          widen(t, c0, c1);
          int64_t i0 = m0;
          for (; i0 + 2 * kTileM <= m1; i0 += 2 * kTileM) panel_rows<2>(a, panel, i0, c0, c1, acc_of(t));
          if (i0 < m1) panel_rows<1>(a, panel, i0, c0, c1, acc_of(t));
        }
      }
    }
    for (int64_t t = 0; t < tiles; ++t) {
      if (fallback[t] != 0) continue;
      const float* acc = acc_of(t);
      for (int64_t i = m0; i < std::min(m1, a.m); ++i) {
        const float* c = acc + i * kTileRows;
        const V::F v0 = finish<Kind>(V::load(c)), v1 = finish<Kind>(V::load(c + V::W));
        float* out = y + i * w.n + row0_of(t);
        packed ? Kind::PDec::store(out, v0, v1, count_of(t)) : Kind::Dec::store(out, v0, v1, count_of(t));
      }
    }
  }
  for (int64_t t = 0; t < tiles; ++t) {
    if (fallback[t] == 'n') tile_reference<Kind>(x, a.m, w, y, row0_of(t), count_of(t));
  }
}

template <class Kind>
void run_linear_tiles(const Exec& ex, const float* x, int64_t m, const typename Kind::Matrix& w, float* y,
                      void (*row_fallback)(const Exec&, const float*, int64_t, const typename Kind::Matrix&, float*)) {
  if (m <= 0 || w.n <= 0) return;
  assert((!Kind::kScaled || w.k % kQBlock == 0) && "act_quant needs K in whole blocks of 32");
  const bool parallel = w.n * w.k >= kParallelMin;
  const Activations a = Kind::kScaled ? widen_activations(ex, x, m, w.k, Kind::kPrescale, parallel)
                                      : bf16_activations(ex, x, m, w.k, parallel);
  ex.run(parallel, w.n, kTileRows,
         [&](int64_t r0, int64_t r1, Scratch& s) { gemm_tiles<Kind>(a, x, w, y, r0, r1, s); });
  for (int64_t i = 0; i < m; ++i) {
    if (!a.ok[i]) row_fallback(ex, x + i * w.k, 1, w, y + i * w.n);
  }
}

}  // namespace dsv41::detail::amx

namespace dsv41::detail {

void linear_fp8_amx(const Exec& ex, const float* x, int64_t m, const Fp8Matrix& w, float* y) {
  amx::run_linear_tiles<amx::Fp8Kind>(ex, x, m, w, y, linear_fp8_avx512);
}
void linear_fp4_amx(const Exec& ex, const float* x, int64_t m, const Fp4Matrix& w, float* y) {
  amx::run_linear_tiles<amx::Fp4Kind>(ex, x, m, w, y, linear_fp4_avx512);
}
void linear_bf16_amx(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  amx::run_linear_tiles<amx::Bf16Kind<false>>(ex, x, m, w, y, linear_bf16_avx512);
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
void linear_fp8_amx(const Exec&, const float* x, int64_t m, const Fp8Matrix& w, float* y) {
  reference::linear_fp8(x, m, w, y);
}
void linear_fp4_amx(const Exec&, const float* x, int64_t m, const Fp4Matrix& w, float* y) {
  reference::linear_fp4(x, m, w, y);
}
void linear_bf16_amx(const Exec&, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  reference::linear_bf16(x, m, w, y);
}
}  // namespace dsv41::detail

#endif
