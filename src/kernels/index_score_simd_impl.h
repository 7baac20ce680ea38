// The ISA-independent part of the fast indexer scores, included by index_score_avx2.cpp and
// index_score_avx512.cpp inside their target region and namespace. The including file defines `S`:
//  * F / I: vectors of W fp32 / int32 lanes; zero, set1, load, loadi, store, add, mul;
//  * decode8(col, scale, key): the 8 values of lane-wise packed dwords (8 E2M1 nibbles, element j in
//    bits 4j..4j+3) as e2m1·scale, one vector per element;
//  * round_bf16, relu (std::max(x, 0) lane by lane, NaN kept), hide_from(v, n) (lanes >= n set to
//    -inf), store_first(p, v, count);
//  * kColumnsPerPass: packed dwords (8 elements each) decoded into registers at a time.
//
// Lanes are keys: a tile of W keys is walked once per group of queries, and every (query, head, key)
// keeps its own dot chain over e in order, so no chain is split (see index_score.h for the numerics).
// A tile's nibbles are first regrouped, still packed, so that the W keys' dword c sits in one vector;
// decoding them gives 8·kColumnsPerPass key vectors in registers, which every head of every query in
// the group then uses before the next ones are decoded. The dot chains live in a small accumulator
// buffer between passes (one load and one store per head and pass, against 8·kColumnsPerPass
// multiply-adds).
// Key tiles are split over the workers; a score does not depend on the tile split. Restricted to
// candidate pools, each query's pool rows are gathered (by pointer) and scored the same way.
//
// No include guard on purpose: each ISA file includes it once, in its own namespace.

// Accumulator floats a query group may hold: 32 KiB, so the chains stay in L1 between passes.
constexpr int64_t kAccFloats = 8192;
// Heads whose chains advance together: four independent adds hide the add latency.
constexpr int kHeadsPerStep = 4;

// Regroups keys [t0, t0 + count) (count <= W; missing lanes repeat the last key) lane-wise.
inline void pack_tile(const uint8_t* const* keys, int64_t t0, int count, int64_t K, uint32_t* cols, float* scales) {
  const float* e8m0 = e8m0_table();
  for (int l = 0; l < S::W; ++l) {
    const uint8_t* row = keys[t0 + std::min(l, count - 1)];
    for (int64_t c = 0; c < K / 8; ++c) std::memcpy(&cols[c * S::W + l], row + 4 * c, 4);
    for (int64_t b = 0; b < K / 32; ++b) scales[b * S::W + l] = e8m0[row[K / 2 + b]];
  }
}

// One element e of the pass for R heads: a[r] = a[r] + q_r[e]·key[e].
template <int R>
inline void accumulate_element(S::F* a, const float* const* q, const S::F* key, int e) {
  for (int r = 0; r < R; ++r) a[r] = S::add(a[r], S::mul(S::set1(q[r][e]), key[e]));
}

// acc[h] += Σ over the pass's elements of q_h[e]·key[e] in e order, for R heads side by side
// (q_h = q + h·K). The elements are spelled out (a fold over E, evaluated left to right) so the key
// vectors stay in registers instead of an array indexed at run time.
template <int R, int... E>
inline void accumulate_heads(const float* q, int64_t K, const S::F* key, float* acc,
                             std::integer_sequence<int, E...>) {
  S::F a[R];
  const float* qr[R];
  for (int r = 0; r < R; ++r) {
    a[r] = S::load(acc + r * S::W);
    qr[r] = q + r * K;
  }
  (accumulate_element<R>(a, qr, key, E), ...);
  for (int r = 0; r < R; ++r) S::store(acc + r * S::W, a[r]);
}
template <int R>
inline void accumulate_heads(const float* q, int64_t K, const S::F* key, float* acc) {
  accumulate_heads<R>(q, K, key, acc, std::make_integer_sequence<int, 8 * S::kColumnsPerPass>());
}

// Scores of queries [i0, i1) against the packed tile of keys [t0, t0 + count).
inline void score_tile(const float* q, const float* weights, int64_t nh, int64_t K, const uint32_t* cols,
                       const float* scales, int64_t t0, int count, int64_t i0, int64_t i1, const int64_t* visible,
                       int64_t n_keys, float* acc, float* scores) {
  using F = S::F;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::fill(acc, acc + (i1 - i0) * nh * S::W, 0.0f);
  for (int64_t c = 0; c < K / 8; c += S::kColumnsPerPass) {
    const F scale = S::load(scales + (c / 4) * S::W);  // a pass stays inside one 32-element block
    F key[8 * S::kColumnsPerPass];
    for (int p = 0; p < S::kColumnsPerPass; ++p) S::decode8(S::loadi(cols + (c + p) * S::W), scale, key + 8 * p);
    for (int64_t i = i0; i < i1; ++i) {
      if (visible[i] <= t0) continue;
      const float* qi = q + i * nh * K + 8 * c;
      float* ai = acc + (i - i0) * nh * S::W;
      int64_t h = 0;
      for (; h + kHeadsPerStep <= nh; h += kHeadsPerStep) {
        accumulate_heads<kHeadsPerStep>(qi + h * K, K, key, ai + h * S::W);
      }
      for (; h < nh; ++h) accumulate_heads<1>(qi + h * K, K, key, ai + h * S::W);
    }
  }
  for (int64_t i = i0; i < i1; ++i) {
    float* out = scores + i * n_keys + t0;
    if (visible[i] <= t0) {
      std::fill(out, out + count, neg_inf);
      continue;
    }
    const float* ai = acc + (i - i0) * nh * S::W;
    const float* wi = weights + i * nh;
    F sum = S::zero();
    for (int64_t h = 0; h < nh; ++h) {
      const F dot = S::relu(S::round_bf16(S::load(ai + h * S::W)));
      sum = S::add(sum, S::round_bf16(S::mul(dot, S::set1(wi[h]))));
    }
    const int64_t seen = visible[i] - t0;
    S::store_first(out, S::hide_from(S::round_bf16(sum), static_cast<int>(std::min<int64_t>(seen, S::W))), count);
  }
}

inline void index_scores_simd(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh,
                              int64_t K, const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                              float* scores) {
  if (nq <= 0 || n_keys <= 0) return;
  const int64_t tiles = (n_keys + S::W - 1) / S::W;
  const int64_t group = std::clamp<int64_t>(kAccFloats / (nh * S::W), 1, nq);
  int64_t last_visible = 0;  // keys at or past it are seen by no query
  for (int64_t i = 0; i < nq; ++i) last_visible = std::max(last_visible, visible[i]);
  const bool parallel = nq * n_keys * nh * K >= kIndexScoreParallelWork;
  ex.run(parallel, tiles, 1, [&](int64_t tile_begin, int64_t tile_end, Scratch& s) {
    uint32_t* cols = s.get<uint32_t>(ScratchSlot::IndexColumns, static_cast<size_t>(K / 8 * S::W));  // [K/8][W]
    float* sc = s.get<float>(ScratchSlot::IndexScales, static_cast<size_t>(K / 32 * S::W));          // [K/32][W]
    float* acc = s.get<float>(ScratchSlot::IndexAcc, static_cast<size_t>(group * nh * S::W));  // [query][head][W]
    for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
      const int64_t t0 = tile * S::W;
      const int count = static_cast<int>(std::min<int64_t>(S::W, n_keys - t0));
      if (t0 >= last_visible) {
        for (int64_t i = 0; i < nq; ++i) {
          std::fill_n(scores + i * n_keys + t0, count, -std::numeric_limits<float>::infinity());
        }
        continue;
      }
      pack_tile(keys, t0, count, K, cols, sc);
      for (int64_t i0 = 0; i0 < nq; i0 += group) {
        score_tile(q, weights, nh, K, cols, sc, t0, count, i0, std::min(nq, i0 + group), visible, n_keys, acc, scores);
      }
    }
  });
}

// Candidate pools: each query's pool scored as a history of its own (index_score.h).
inline void index_scores_in_pool_simd(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh,
                                      int64_t K, const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                                      const std::vector<int32_t>* pools, int64_t block_size, float* scores) {
  index_scores_in_pools(q, weights, nq, nh, K, keys, n_keys, visible, pools, block_size, scores,
                        [&](const float* qi, const float* wi, const uint8_t* const* pool, int64_t n, float* out) {
                          index_scores_simd(ex, qi, wi, 1, nh, K, pool, n, &n, out);
                        });
}
