// AVX-512 VNNI indexer scores: each 32-element block's dot product in integers (vpdpbusd), the
// reference's bits kept (index_score.h states the numerics; the derivation is below).
//
// Why integers give the reference's bits. The reference computes a head's dot as one fp32 chain,
// dot += q[e]·key[e] in e order, each product rounded. The indexer's queries are FP4 quantize-
// dequantized per 32 and its keys are FP4 with E8M0 scales per 32, so within block b every q[e] is a
// small integer times 2^sq_b and every key[e] an integer in [-12, 12] times 2^ek_b. When
//   (1) 2^(sq_b + ek_b) is no finer than fp32's smallest subnormal, 2^-149, and
//   (2) every partial sum of the chain needs at most 24 significant bits and stays below 2^127,
// every product and every partial sum is exact, so the chain's result is the exact sum whatever the
// order: Σ_b I_b·2^(sq_b + ek_b), I_b the block's integer dot, which vpdpbusd computes exactly and
// fp32 holds exactly (|I_b| < 2^16). (2) is checked from bounds: block b adds at most
// 384·max|q int|·2^(sq_b + ek_b) and every partial is a multiple of 2^(min sq + min ek). The check is
// per query row (its blocks' exponents and largest integers) and key (its blocks' exponent range):
// a (row, key) that fails it, or whose key has a scale whose values overflow or are NaN, is computed
// by the reference's chain; a query whose values are not such integers (or are not finite) is scored
// by the fp32 AVX-512 kernel. The bf16 roundings, relu, head weights and head sum then follow the
// reference's order lane by lane, as in index_score_simd_impl.h.
//
// vpdpbusd multiplies unsigned by signed bytes: keys are stored biased (int + 12, in [0, 24]) and the
// bias is taken back per block (12·Σ q ints). The packed key dword holds elements 8c..8c+7 as
// nibbles; its low nibbles (even elements) and high nibbles (odd ones) become two byte vectors, and a
// query's integers are laid out the same way, so no nibble is moved across bytes.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/index_score.h"
#include "kernels/linear_internal.h"
#include "kernels/reference.h"
#include "numeric/row_codecs.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))), \
                             apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace dsv41::detail::index_score_vnni {

namespace {

constexpr int W = 16;           // keys per vector
constexpr int kBlock = 32;      // elements per quantization block
constexpr int kKeyBias = 12;    // key integers are in [-12, 12]
constexpr int kRowsPerStep = 8; // independent vpdpbusd chains in flight
// Dots of at most this many query rows wait in L1 for their queries' head sums.
constexpr int64_t kDotRows = 512;

// A query's rows (one per head) as integers: dwords[row][K/4] (column c's even elements in dword 2c,
// odd ones in 2c+1), per block the bias 12·Σ ints and the scale 2^sq (0 for a block of zeros), and per
// row the limits the keys' exponents must meet for the integer path to be exact (see the top).
struct QueryInts {
  std::vector<uint32_t> dwords;
  std::vector<int32_t> bias;
  std::vector<float> scale;
  std::vector<int32_t> span_max, ek_min, ek_max;  // per row: ek_max - ek_min <= span_max, ...
  std::vector<uint8_t> integral;                  // per query: every head's values are such integers
  // The tightest of those limits over every row: a key tile within them is exact for all rows.
  int32_t all_span_max = std::numeric_limits<int32_t>::max();
  int32_t all_ek_min = std::numeric_limits<int32_t>::min();
  int32_t all_ek_max = std::numeric_limits<int32_t>::max();
};

int ceil_log2(int n) { return n <= 1 ? 0 : std::bit_width(static_cast<unsigned>(n - 1)); }

// 2^e for e in [-149, 127]: built from its bits where it is a normal float.
inline float pow2(int e) {
  return e >= -126 ? std::bit_cast<float>(static_cast<uint32_t>(e + 127) << 23) : std::ldexp(1.0f, e);
}

// A block of 32 values as integers (lanes of lo, hi) times 2^sq, sq as large as they allow, with
// |integer| < 128; false when they are not finite such integers. A block of zeros gives sq = 0.
inline bool block_integers(const float* v, int& sq, __m512i& lo, __m512i& hi) {
  const __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16), zero = _mm512_setzero_ps();
  constexpr int kNotFinite = 0x01 | 0x08 | 0x10 | 0x80;  // vfpclassps: QNaN, +inf, -inf, SNaN
  if ((_mm512_fpclass_ps_mask(x0, kNotFinite) | _mm512_fpclass_ps_mask(x1, kNotFinite)) != 0) return false;
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  sq = 0;
  if (amax == 0) {
    lo = hi = _mm512_setzero_si512();
    return true;
  }
  // The largest value over 2^sq is below 2^7: every value an integer then fits a signed byte.
  sq = std::ilogb(amax) - 6;
  __m512 y0, y1;
  if (sq >= -126 && sq <= 126) {  // 2^-sq is a normal float: multiplying by it is exact but for underflow
    const __m512 m = _mm512_set1_ps(pow2(-sq));
    y0 = _mm512_mul_ps(x0, m);
    y1 = _mm512_mul_ps(x1, m);
  } else {
    alignas(64) float y[kBlock];
    for (int e = 0; e < kBlock; ++e) y[e] = std::ldexp(v[e], -sq);
    y0 = _mm512_load_ps(y);
    y1 = _mm512_load_ps(y + 16);
  }
  lo = _mm512_cvtps_epi32(y0);
  hi = _mm512_cvtps_epi32(y1);
  // Integers: converting back gives the same value, and no nonzero value underflowed to zero.
  const auto not_integer = [&](__m512 x, __m512 y, __m512i n) {
    return _mm512_cmp_ps_mask(_mm512_cvtepi32_ps(n), y, _CMP_NEQ_UQ) |
           (_mm512_cmp_ps_mask(y, zero, _CMP_EQ_OQ) & _mm512_cmp_ps_mask(x, zero, _CMP_NEQ_UQ));
  };
  if ((not_integer(x0, y0, lo) | not_integer(x1, y1, hi)) != 0) return false;
  const unsigned bits =
      static_cast<unsigned>(_mm512_reduce_or_epi32(_mm512_or_si512(_mm512_abs_epi32(lo), _mm512_abs_epi32(hi))));
  const int tz = std::countr_zero(bits);  // bits != 0: amax maps to at least 64
  const __m128i shift = _mm_cvtsi32_si128(tz);
  lo = _mm512_sra_epi32(lo, shift);
  hi = _mm512_sra_epi32(hi, shift);
  sq += tz;
  return true;
}

// Fills row `row` (K values x) of `qi`; false when some value is not a finite integer multiple of a
// power of two that fits a signed byte within its block.
bool quantize_row(const float* x, int64_t K, int64_t row, QueryInts& qi) {
  const int64_t nb = K / kBlock;
  int top = std::numeric_limits<int>::min(), low = std::numeric_limits<int>::max(), nonzero = 0;
  uint8_t* bytes = reinterpret_cast<uint8_t*>(qi.dwords.data() + row * (K / 4));
  // Column c's even elements, then its odd ones: the key bytes' order (pack_keys).
  const __m512i even_odd = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t b = 0; b < nb; ++b) {
    int sq = 0;
    __m512i lo, hi;
    if (!block_integers(x + b * kBlock, sq, lo, hi)) return false;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes + b * kBlock),
                     _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(even_odd, lo)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes + b * kBlock + 16),
                     _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(even_odd, hi)));
    const int max_int = _mm512_reduce_max_epi32(_mm512_max_epi32(_mm512_abs_epi32(lo), _mm512_abs_epi32(hi)));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
    if (max_int != 0) {
      ++nonzero;
      top = std::max(top, sq + static_cast<int>(std::bit_width(static_cast<unsigned>(384 * max_int))));
      low = std::min(low, sq);
    }
    qi.bias[row * nb + b] = kKeyBias * sum;
    qi.scale[row * nb + b] = max_int == 0 ? 0.0f : pow2(sq);
  }
  if (nonzero == 0) {  // every dot is an exact 0 for any finite key
    qi.span_max[row] = std::numeric_limits<int32_t>::max();
    qi.ek_min[row] = std::numeric_limits<int32_t>::min();
    qi.ek_max[row] = std::numeric_limits<int32_t>::max();
    return true;
  }
  const int lg = ceil_log2(nonzero);
  qi.span_max[row] = 24 + low - top - lg;
  qi.ek_min[row] = -149 - low;
  qi.ek_max[row] = 127 - top - lg;
  return true;
}

void quantize_queries(const float* q, int64_t nq, int64_t nh, int64_t K, QueryInts& qi) {
  const int64_t rows = nq * nh, nb = K / kBlock;
  qi.dwords.resize(static_cast<size_t>(rows * K / 4));
  qi.bias.resize(static_cast<size_t>(rows * nb));
  qi.scale.resize(static_cast<size_t>(rows * nb));
  qi.span_max.resize(static_cast<size_t>(rows));
  qi.ek_min.resize(static_cast<size_t>(rows));
  qi.ek_max.resize(static_cast<size_t>(rows));
  qi.integral.assign(static_cast<size_t>(nq), 1);
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t h = 0; h < nh && qi.integral[i]; ++h) {
      if (!quantize_row(q + (i * nh + h) * K, K, i * nh + h, qi)) qi.integral[i] = 0;
    }
    if (!qi.integral[i]) continue;
    for (int64_t row = i * nh; row < (i + 1) * nh; ++row) {
      qi.all_span_max = std::min(qi.all_span_max, qi.span_max[row]);
      qi.all_ek_min = std::max(qi.all_ek_min, qi.ek_min[row]);
      qi.all_ek_max = std::min(qi.all_ek_max, qi.ek_max[row]);
    }
  }
}

// A tile of W keys: biased bytes kb[K/4][W] dwords, per block the scale 2^ek as fp32 lanes, per lane
// the blocks' smallest and largest ek, and which lanes have every value finite.
struct KeyTile {
  uint32_t* kb;
  float* scale;
  __m512i ek_min, ek_max, ek_span;
  __mmask16 finite;
  bool exact_for_all;  // every lane passes every row's check (the common case: no per-row check)
};

void pack_keys(const uint8_t* const* keys, int64_t t0, int count, int64_t K, const QueryInts& qi, uint32_t* cols,
               KeyTile& tile) {
  const float* e8m0 = e8m0_table();
  const int64_t nb = K / kBlock;
  alignas(64) int32_t lo[W], hi[W];
  std::fill_n(lo, W, std::numeric_limits<int32_t>::max());
  std::fill_n(hi, W, std::numeric_limits<int32_t>::min());
  __mmask16 finite = 0;
  for (int l = 0; l < W; ++l) {
    const uint8_t* row = keys[t0 + std::min(l, count - 1)];
    for (int64_t c = 0; c < K / 8; ++c) std::memcpy(&cols[c * W + l], row + 4 * c, 4);
    bool ok = true;
    for (int64_t b = 0; b < nb; ++b) {
      const int code = row[K / 2 + b];
      // 12·2^(code-128) overflows fp32 past 252; 255 is NaN.
      ok = ok && code <= 252;
      const int ek = code - 128;
      lo[l] = std::min(lo[l], ek);
      hi[l] = std::max(hi[l], ek);
      tile.scale[b * W + l] = code <= 252 ? e8m0[code] * 0.5f : 0.0f;  // 2^ek, exact (2^-128 included)
    }
    if (ok) finite = static_cast<__mmask16>(finite | (1u << l));
  }
  tile.ek_min = _mm512_load_si512(lo);
  tile.ek_max = _mm512_load_si512(hi);
  tile.ek_span = _mm512_sub_epi32(tile.ek_max, tile.ek_min);
  tile.finite = finite;
  tile.exact_for_all = finite == 0xFFFF && _mm512_reduce_max_epi32(tile.ek_span) <= qi.all_span_max &&
                       _mm512_reduce_min_epi32(tile.ek_min) >= qi.all_ek_min &&
                       _mm512_reduce_max_epi32(tile.ek_max) <= qi.all_ek_max;
  // E2M1 code (bit 3 = sign) -> biased integer 12 ± 2·|value|, looked up by vpshufb per byte.
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t c = 0; c < K / 8; ++c) {
    const __m512i packed = _mm512_loadu_si512(cols + c * W);
    const __m512i even = _mm512_and_si512(packed, nibble);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(packed, 4), nibble);
    _mm512_store_si512(tile.kb + (2 * c) * W, _mm512_shuffle_epi8(lut, even));
    _mm512_store_si512(tile.kb + (2 * c + 1) * W, _mm512_shuffle_epi8(lut, odd));
  }
}

// dots[r] (W lanes) of rows rows[0..R) against the tile: Σ_b (I_b)·2^sq·2^ek, exact where the lanes'
// checks hold (the rest is patched by the caller).
template <int R>
inline void integer_dots(const QueryInts& qi, const int64_t* rows, int64_t K, const KeyTile& tile, float* dots) {
  const int64_t nb = K / kBlock, dwords = K / 4;
  __m512 dot[R];
  for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_ps();
  const int32_t* q[R];
  for (int r = 0; r < R; ++r) q[r] = reinterpret_cast<const int32_t*>(qi.dwords.data() + rows[r] * dwords);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    for (int d = 0; d < 8; ++d) {
      const __m512i kv = _mm512_load_si512(tile.kb + (b * 8 + d) * W);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbusd_epi32(acc[r], kv, _mm512_set1_epi32(q[r][b * 8 + d]));
    }
    const __m512 ks = _mm512_load_ps(tile.scale + b * W);
    for (int r = 0; r < R; ++r) {
      const int64_t at = rows[r] * nb + b;
      const __m512 block = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], _mm512_set1_epi32(qi.bias[at])));
      dot[r] = _mm512_add_ps(dot[r], _mm512_mul_ps(block, _mm512_mul_ps(ks, _mm512_set1_ps(qi.scale[at]))));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_store_ps(dots + r * W, dot[r]);
}

// The lanes of `row` whose integer dot is the reference's (see the top).
inline __mmask16 exact_lanes(const QueryInts& qi, int64_t row, const KeyTile& tile) {
  __mmask16 ok = _mm512_mask_cmple_epi32_mask(tile.finite, tile.ek_span, _mm512_set1_epi32(qi.span_max[row]));
  ok = _mm512_mask_cmpge_epi32_mask(ok, tile.ek_min, _mm512_set1_epi32(qi.ek_min[row]));
  return _mm512_mask_cmple_epi32_mask(ok, tile.ek_max, _mm512_set1_epi32(qi.ek_max[row]));
}

// The reference's chain for one (query head, key): the path for lanes the check turns away.
float chain_dot(const float* q, const uint8_t* key_row, int64_t K, float* key) {
  unpack_index_key_row(key_row, K, key);
  float dot = 0;
  for (int64_t e = 0; e < K; ++e) dot += q[e] * key[e];
  return dot;
}

// round_bf16 lane by lane, as bf16_from_f32: nearest even, NaN kept quiet.
inline __m512 round_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  const __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i r = _mm512_mask_blend_epi32(nan, rounded, quiet);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __mmask16 first(int64_t n) { return static_cast<__mmask16>(n >= W ? 0xFFFFu : (1u << n) - 1u); }

// Scores of the queries in [i0, i1) whose values are integers, against the tile of keys [t0, t0+count).
void score_tile(const float* q, const float* weights, int64_t nh, int64_t K, const QueryInts& qi,
                const uint8_t* const* keys, const KeyTile& tile, int64_t t0, int count, int64_t i0, int64_t i1,
                const int64_t* visible, int64_t n_keys, int64_t* rows, float* dots, float* key, float* scores) {
  // The rows to compute: every head of each query that sees part of the tile.
  int64_t n_rows = 0;
  for (int64_t i = i0; i < i1; ++i) {
    if (!qi.integral[i] || visible[i] <= t0) continue;
    for (int64_t h = 0; h < nh; ++h) rows[n_rows++] = i * nh + h;
  }
  int64_t r = 0;
  for (; r + kRowsPerStep <= n_rows; r += kRowsPerStep) integer_dots<kRowsPerStep>(qi, rows + r, K, tile, dots + r * W);
  for (; r < n_rows; ++r) integer_dots<1>(qi, rows + r, K, tile, dots + r * W);
  // Patch the lanes the integers cannot stand for, then the head sums in the reference's order.
  r = 0;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = i0; i < i1; ++i) {
    if (!qi.integral[i]) continue;
    float* out = scores + i * n_keys + t0;
    if (visible[i] <= t0) {
      std::fill(out, out + count, neg_inf);
      continue;
    }
    const int64_t seen = std::min<int64_t>(visible[i] - t0, count);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t h = 0; h < nh; ++h, ++r) {
      float* d = dots + r * W;
      const unsigned patch =
          tile.exact_for_all ? 0u : first(seen) & ~static_cast<unsigned>(exact_lanes(qi, i * nh + h, tile));
      for (unsigned m = patch; m != 0; m &= m - 1) {
        const int l = std::countr_zero(m);
        d[l] = chain_dot(q + (i * nh + h) * K, keys[t0 + l], K, key);
      }
      const __m512 dot = _mm512_max_ps(_mm512_setzero_ps(), round_bf16(_mm512_load_ps(d)));
      sum = _mm512_add_ps(sum, round_bf16(_mm512_mul_ps(dot, _mm512_set1_ps(weights[i * nh + h]))));
    }
    const __m512 score = _mm512_mask_blend_ps(first(seen), _mm512_set1_ps(neg_inf), round_bf16(sum));
    _mm512_mask_storeu_ps(out, first(count), score);
  }
}

void index_scores_integral(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                           const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, const QueryInts& qi,
                           float* scores) {
  const int64_t tiles = (n_keys + W - 1) / W;
  const int64_t group = std::clamp<int64_t>(kDotRows / nh, 1, nq);
  int64_t last_visible = 0;  // keys at or past it are seen by no query
  for (int64_t i = 0; i < nq; ++i) last_visible = std::max(last_visible, visible[i]);
  const bool parallel = nq * n_keys * nh * K >= kIndexScoreParallelWork;
  ex.run(parallel, tiles, 1, [&](int64_t tile_begin, int64_t tile_end, Scratch& s) {
    uint32_t* cols = s.get<uint32_t>(ScratchSlot::IndexColumns, static_cast<size_t>(K / 8 * W));
    KeyTile tile{};
    tile.kb = s.get<uint32_t>(ScratchSlot::IndexKeyBytes, static_cast<size_t>(K / 4 * W));
    tile.scale = s.get<float>(ScratchSlot::IndexScales, static_cast<size_t>(K / kBlock * W));
    const int64_t max_rows = std::max<int64_t>(group * nh, 1);
    float* dots = s.get<float>(ScratchSlot::IndexAcc, static_cast<size_t>(max_rows * W + K));
    float* key = dots + max_rows * W;
    int64_t* rows = s.get<int64_t>(ScratchSlot::IndexRows, static_cast<size_t>(max_rows));
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      const int64_t t0 = t * W;
      const int count = static_cast<int>(std::min<int64_t>(W, n_keys - t0));
      if (t0 >= last_visible) {
        for (int64_t i = 0; i < nq; ++i) {
          if (qi.integral[i]) std::fill_n(scores + i * n_keys + t0, count, -std::numeric_limits<float>::infinity());
        }
        continue;
      }
      pack_keys(keys, t0, count, K, qi, cols, tile);
      for (int64_t i0 = 0; i0 < nq; i0 += group) {
        score_tile(q, weights, nh, K, qi, keys, tile, t0, count, i0, std::min(nq, i0 + group), visible, n_keys,
                   rows, dots, key, scores);
      }
    }
  });
}

}  // namespace

void index_scores(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                  const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores) {
  if (nq <= 0 || n_keys <= 0) return;
  QueryInts qi;
  quantize_queries(q, nq, nh, K, qi);
  index_scores_integral(ex, q, weights, nq, nh, K, keys, n_keys, visible, qi, scores);
  // Queries whose values are not block integers: the fp32 kernel, one query at a time.
  for (int64_t i = 0; i < nq; ++i) {
    if (qi.integral[i]) continue;
    index_scores_avx512(ex, q + i * nh * K, weights + i * nh, 1, nh, K, keys, n_keys, visible + i,
                        scores + i * n_keys);
  }
}

}  // namespace dsv41::detail::index_score_vnni

namespace dsv41::detail {

void index_scores_avx512_vnni(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh,
                              int64_t K, const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                              float* scores) {
  index_score_vnni::index_scores(ex, q, weights, nq, nh, K, keys, n_keys, visible, scores);
}

// Per query: its pool's visible keys gathered and scored as a history of their own, as the fp32
// kernel does (index_score_simd_impl.h).
void index_scores_in_pool_avx512_vnni(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh,
                                      int64_t K, const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                                      const std::vector<int32_t>* pools, int64_t block_size, float* scores) {
  std::fill(scores, scores + nq * n_keys, -std::numeric_limits<float>::infinity());
  std::vector<const uint8_t*> pool_keys;
  std::vector<int64_t> pool_ids;
  std::vector<float> pool_scores;
  for (int64_t i = 0; i < nq; ++i) {
    pool_keys.clear();
    pool_ids.clear();
    for (int32_t b : pools[i]) {
      for (int64_t t = b * block_size; t < std::min({n_keys, visible[i], (b + 1) * block_size}); ++t) {
        pool_keys.push_back(keys[t]);
        pool_ids.push_back(t);
      }
    }
    const int64_t n = static_cast<int64_t>(pool_keys.size());
    if (n == 0) continue;
    pool_scores.resize(static_cast<size_t>(n));
    index_score_vnni::index_scores(ex, q + i * nh * K, weights + i * nh, 1, nh, K, pool_keys.data(), n, &n,
                                   pool_scores.data());
    for (int64_t j = 0; j < n; ++j) scores[i * n_keys + pool_ids[j]] = pool_scores[j];
  }
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
void index_scores_avx512_vnni(const Exec&, const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                              const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores) {
  reference::index_scores(q, weights, nq, nh, K, keys, n_keys, visible, scores);
}
void index_scores_in_pool_avx512_vnni(const Exec&, const float* q, const float* weights, int64_t nq, int64_t nh,
                                      int64_t K, const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                                      const std::vector<int32_t>* pools, int64_t block_size, float* scores) {
  reference::index_scores_in_pool(q, weights, nq, nh, K, keys, n_keys, visible, pools, block_size, scores);
}
}  // namespace dsv41::detail

#endif
