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

// Keys [t0, t0 + count) (count <= W; missing lanes repeat the last key) into `tile`: each row's nibble
// bytes copied side by side into `rows`, then gathered lane-wise one packed dword (8 elements) at a
// time and split into its even and odd elements' biased bytes; the scale codes likewise.
void pack_keys(const uint8_t* const* keys, int64_t t0, int count, int64_t K, const QueryInts& qi, uint8_t* rows,
               KeyTile& tile) {
  const int64_t nb = K / kBlock, row_bytes = K / 2 + nb;
  for (int l = 0; l < W; ++l) {  // 16 nibble bytes at a time (K/2 is a multiple of 16), then the scales
    const uint8_t* key = keys[t0 + std::min(l, count - 1)];
    uint8_t* to = rows + l * row_bytes;
    for (int64_t c = 0; c < K / 2; c += 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(to + c), _mm_loadu_si128(reinterpret_cast<const __m128i*>(key + c)));
    }
    for (int64_t b = 0; b < nb; ++b) to[K / 2 + b] = key[K / 2 + b];
  }
  const __m512i lane_offset =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int>(row_bytes)));
  // E2M1 code (bit 3 = sign) -> biased integer 12 ± 2·|value|, looked up by vpshufb per byte.
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t c = 0; c < K / 8; ++c) {
    const __m512i packed =
        _mm512_i32gather_epi32(_mm512_add_epi32(lane_offset, _mm512_set1_epi32(static_cast<int>(4 * c))), rows, 1);
    const __m512i even = _mm512_and_si512(packed, nibble);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(packed, 4), nibble);
    _mm512_store_si512(tile.kb + (2 * c) * W, _mm512_shuffle_epi8(lut, even));
    _mm512_store_si512(tile.kb + (2 * c + 1) * W, _mm512_shuffle_epi8(lut, odd));
  }
  __m512i lo = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
  __m512i hi = _mm512_set1_epi32(std::numeric_limits<int32_t>::min());
  __mmask16 finite = 0xFFFF;
  for (int64_t b = 0; b < nb; ++b) {
    // The scale byte sits in the last byte of the dword gathered here.
    const __m512i at = _mm512_add_epi32(lane_offset, _mm512_set1_epi32(static_cast<int>(K / 2 + b - 3)));
    const __m512i code = _mm512_srli_epi32(_mm512_i32gather_epi32(at, rows, 1), 24);
    // 12·2^(code-128) overflows fp32 past 252; 255 is NaN.
    const __mmask16 ok = _mm512_cmple_epi32_mask(code, _mm512_set1_epi32(252));
    finite = static_cast<__mmask16>(finite & ok);
    const __m512i ek = _mm512_sub_epi32(code, _mm512_set1_epi32(128));
    lo = _mm512_min_epi32(lo, ek);
    hi = _mm512_max_epi32(hi, ek);
    // 2^ek: biased exponent code - 1 from code 2 on; 2^-127 and 2^-128 (codes 1, 0) are subnormal.
    const __mmask16 normal = _mm512_cmpge_epi32_mask(code, _mm512_set1_epi32(2));
    const __m512i sub = _mm512_srlv_epi32(_mm512_set1_epi32(0x00400000), _mm512_sub_epi32(_mm512_set1_epi32(1), code));
    const __m512i biased = _mm512_slli_epi32(_mm512_sub_epi32(code, _mm512_set1_epi32(1)), 23);
    const __m512i bits = _mm512_mask_blend_epi32(normal, sub, biased);
    _mm512_store_ps(tile.scale + b * W, _mm512_maskz_mov_ps(ok, _mm512_castsi512_ps(bits)));
  }
  tile.ek_min = lo;
  tile.ek_max = hi;
  tile.ek_span = _mm512_sub_epi32(hi, lo);
  tile.finite = finite;
  tile.exact_for_all = finite == 0xFFFF && _mm512_reduce_max_epi32(tile.ek_span) <= qi.all_span_max &&
                       _mm512_reduce_min_epi32(lo) >= qi.all_ek_min && _mm512_reduce_max_epi32(hi) <= qi.all_ek_max;
}

// dots[t][r] (W lanes each) of rows row0 .. row0+R-1 (consecutive heads of one query) against tiles
// tile[0 .. T): Σ_b I_b·2^sq·2^ek, exact where the lanes' checks hold (the caller patches the rest).
// R·T chains of vpdpbusd advance together to cover its latency.
template <int R, int T>
inline void integer_dots(const QueryInts& qi, int64_t row0, int64_t K, const KeyTile* tile, float* dots) {
  const int64_t nb = K / kBlock, dwords = K / 4;
  __m512 dot[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) dot[t][r] = _mm512_setzero_ps();
  const int32_t* q = reinterpret_cast<const int32_t*>(qi.dwords.data() + row0 * dwords);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[T][R];
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_si512();
    for (int d = 0; d < 8; ++d) {
      for (int t = 0; t < T; ++t) {
        const __m512i kv = _mm512_load_si512(tile[t].kb + (b * 8 + d) * W);
        for (int r = 0; r < R; ++r) {
          acc[t][r] = _mm512_dpbusd_epi32(acc[t][r], kv, _mm512_set1_epi32(q[r * dwords + b * 8 + d]));
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m512 ks = _mm512_load_ps(tile[t].scale + b * W);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (row0 + r) * nb + b;
        const __m512 block = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[t][r], _mm512_set1_epi32(qi.bias[at])));
        dot[t][r] = _mm512_add_ps(dot[t][r], _mm512_mul_ps(block, _mm512_mul_ps(ks, _mm512_set1_ps(qi.scale[at]))));
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) _mm512_store_ps(dots + (t * R + r) * W, dot[t][r]);
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
// The same rounding for inputs that are no NaN but the default one (0x7FC00000 with either sign),
// which it leaves as it is: three instructions fewer.
inline __m512 round_bf16_no_payload(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __mmask16 first(int64_t n) { return static_cast<__mmask16>(n >= W ? 0xFFFFu : (1u << n) - 1u); }

// Keys per chunk: a chunk's tiles (biased bytes and scales) stay in L2, about 128 KiB, while every
// query of the call scores them and writes its scores for them in one run.
constexpr int64_t kChunkBytes = 128 << 10;

// Every query's `n` tiles from tiles[0] (keys t0 ..), its nh heads R at a time, T tiles at a time:
// dots (buffer [T][nh][W]) then the patched lanes, the head sums in the reference's order, the scores.
// bf16(Σ_h bf16(relu(bf16(dot_h))·w_h)) in h order, as the reference's head sum; dots as score_query
// lays them out, `round` the bf16 rounding to use.
template <int R, int T, class Round>
inline __m512 head_sum(const float* d, const float* w, int64_t nh, Round round) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t h = 0; h < nh; ++h) {
    const __m512 dot = _mm512_max_ps(_mm512_setzero_ps(), round(_mm512_load_ps(d + ((h / R) * R * T + h % R) * W)));
    sum = _mm512_add_ps(sum, round(_mm512_mul_ps(dot, _mm512_set1_ps(w[h]))));
  }
  return round(sum);
}

template <int R, int T>
void score_query(const float* q, const float* weights, int64_t i, int64_t nh, int64_t K, const QueryInts& qi,
                 const uint8_t* const* keys, const KeyTile* tiles, int64_t n_tiles, int64_t t0, int64_t n_keys,
                 int64_t visible, float* dots, float* key, float* scores) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float* w = weights + i * nh;
  const bool weights_finite = std::all_of(w, w + nh, [](float x) { return std::isfinite(x); });
  for (int64_t tile = 0; tile < n_tiles; tile += T) {
    const int64_t k0 = t0 + tile * W;
    if (k0 >= visible) {
      std::fill(scores + i * n_keys + k0, scores + i * n_keys + std::min(n_keys, t0 + n_tiles * W), neg_inf);
      return;
    }
    const int tiles_now = static_cast<int>(std::min<int64_t>(T, n_tiles - tile));
    if (tiles_now == T) {
      for (int64_t h = 0; h < nh; h += R) integer_dots<R, T>(qi, i * nh + h, K, tiles + tile, dots + h * T * W);
    } else {
      for (int t = 0; t < tiles_now; ++t) {
        for (int64_t h = 0; h < nh; h += R) {
          integer_dots<R, 1>(qi, i * nh + h, K, tiles + tile + t, dots + (h * T + t * R) * W);
        }
      }
    }
    for (int t = 0; t < tiles_now; ++t) {
      const KeyTile& kt = tiles[tile + t];
      const int64_t k = k0 + t * W;
      const int64_t count = std::min<int64_t>(W, n_keys - k);
      float* out = scores + i * n_keys + k;
      if (k >= visible) {
        std::fill(out, out + count, neg_inf);
        continue;
      }
      const int64_t seen = std::min<int64_t>(visible - k, count);
      const float* d = dots + t * R * W;  // head h at d + ((h / R)·R·T + h % R)·W
      __m512 score;
      if (kt.exact_for_all && weights_finite) {
        // Every dot is finite and every weight too: the only NaN that can arise is the default one
        // (inf - inf), so the roundings need no NaN case.
        score = head_sum<R, T>(d, w, nh, round_bf16_no_payload);
      } else {
        for (int64_t h = 0; h < nh; ++h) {
          float* dh = dots + ((h / R) * R * T + t * R + h % R) * W;
          const unsigned patch =
              kt.exact_for_all ? 0u : first(seen) & ~static_cast<unsigned>(exact_lanes(qi, i * nh + h, kt));
          for (unsigned m = patch; m != 0; m &= m - 1) {
            const int l = std::countr_zero(m);
            dh[l] = chain_dot(q + (i * nh + h) * K, keys[k + l], K, key);
          }
        }
        score = head_sum<R, T>(d, w, nh, round_bf16);
      }
      _mm512_mask_storeu_ps(out, first(count), _mm512_mask_blend_ps(first(seen), _mm512_set1_ps(neg_inf), score));
    }
  }
}

using ScoreQuery = void (*)(const float*, const float*, int64_t, int64_t, int64_t, const QueryInts&,
                            const uint8_t* const*, const KeyTile*, int64_t, int64_t, int64_t, int64_t, float*, float*,
                            float*);

// Heads R at a time (up to 8, whatever divides nh), and tiles enough to keep 8 chains going.
struct QueryKernel {
  ScoreQuery fn;
  int tiles;
};
QueryKernel query_kernel(int64_t nh) {
  if (nh % 8 == 0) return {score_query<8, 1>, 1};
  if (nh % 4 == 0) return {score_query<4, 2>, 2};
  if (nh % 2 == 0) return {score_query<2, 4>, 4};
  return {score_query<1, 8>, 8};
}

void index_scores_integral(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                           const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, const QueryInts& qi,
                           float* scores) {
  int64_t last_visible = 0;  // keys at or past it are seen by no query
  for (int64_t i = 0; i < nq; ++i) last_visible = std::max(last_visible, visible[i]);
  const int64_t tiles = (n_keys + W - 1) / W;
  const bool parallel = nq * n_keys * nh * K >= kIndexScoreParallelWork;
  // Chunks no larger than L2 allows, and at least one per worker where the work is split.
  const int64_t tile_bytes = K / 4 * W * 4 + K / kBlock * W * 4;
  const int64_t per_worker = parallel ? (tiles + ex.threads() - 1) / ex.threads() : tiles;
  const int64_t chunk_tiles = std::clamp<int64_t>(kChunkBytes / tile_bytes, 1, std::max<int64_t>(per_worker, 1));
  const int64_t chunks = (tiles + chunk_tiles - 1) / chunk_tiles;
  const QueryKernel kernel = query_kernel(nh);
  ex.run(parallel, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end, Scratch& s) {
    uint8_t* rows = s.get<uint8_t>(ScratchSlot::IndexColumns, static_cast<size_t>(W * (K / 2 + K / kBlock) + 64));
    uint32_t* kb = s.get<uint32_t>(ScratchSlot::IndexKeyBytes, static_cast<size_t>(chunk_tiles * K / 4 * W));
    float* scale = s.get<float>(ScratchSlot::IndexScales, static_cast<size_t>(chunk_tiles * (K / kBlock) * W));
    KeyTile* tile = s.get<KeyTile>(ScratchSlot::IndexTiles, static_cast<size_t>(chunk_tiles));
    float* dots = s.get<float>(ScratchSlot::IndexAcc, static_cast<size_t>(kernel.tiles * nh * W + K));
    float* key = dots + kernel.tiles * nh * W;
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      const int64_t first_tile = chunk * chunk_tiles, n_tiles = std::min(chunk_tiles, tiles - first_tile);
      const int64_t t0 = first_tile * W, t1 = std::min(n_keys, t0 + n_tiles * W);
      if (t0 >= last_visible) {
        for (int64_t i = 0; i < nq; ++i) {
          if (!qi.integral[i]) continue;
          std::fill(scores + i * n_keys + t0, scores + i * n_keys + t1, -std::numeric_limits<float>::infinity());
        }
        continue;
      }
      for (int64_t t = 0; t < n_tiles; ++t) {
        tile[t].kb = kb + t * (K / 4) * W;
        tile[t].scale = scale + t * (K / kBlock) * W;
        const int64_t k = t0 + t * W;
        pack_keys(keys, k, static_cast<int>(std::min<int64_t>(W, n_keys - k)), K, qi, rows, tile[t]);
      }
      for (int64_t i = 0; i < nq; ++i) {
        if (!qi.integral[i]) continue;
        kernel.fn(q, weights, i, nh, K, qi, keys, tile, n_tiles, t0, n_keys, visible[i], dots, key, scores);
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

// Candidate pools: each query's pool scored as a history of its own (index_score.h).
void index_scores_in_pool_avx512_vnni(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh,
                                      int64_t K, const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                                      const std::vector<int32_t>* pools, int64_t block_size, float* scores) {
  index_scores_in_pools(q, weights, nq, nh, K, keys, n_keys, visible, pools, block_size, scores,
                        [&](const float* qi, const float* wi, const uint8_t* const* pool, int64_t n, float* out) {
                          index_score_vnni::index_scores(ex, qi, wi, 1, nh, K, pool, n, &n, out);
                        });
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
