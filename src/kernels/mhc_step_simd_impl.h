// The ISA-independent part of the fast mHC kernels (mhc_step.h), included by mhc_step_avx2.cpp and
// mhc_step_avx512.cpp inside their target region and namespace. The including file defines `V`: the
// vector type F with W fp32 lanes, kTokens (tokens whose chains run interleaved) and the operations
// used below, and includes cascade_sum_simd_impl.h first.
//
// Layout of the mixes. Lanes are dot products, so every chain stays one sequential chain: for each
// value x[j] of a token (in index order), x[j] is broadcast and multiplied by row j of a transposed
// block of fn (fnT[j][o] = fn[o][j]), and the products are added to the token's accumulators. Row j
// has kLanes = 32 lanes: the 24 mixes and zero padding. Several tokens share each fnT row, which
// keeps the chains' add latency hidden and the row loads few. The sum of squares is not a chain of
// its own: the reference sums the squares in torch's cascade (cascade_sum.h), which runs over the
// token's finished stream after the mixes' pass (cascade_sum_simd_impl.h).
//
// One pass over the stream: tokens are taken in tiles, and the hc·dim values in blocks of kBlock.
// Each block of fn is transposed into an L1-sized buffer once per tile (fn itself is read once per
// tile, from wherever it lies), and every token of the tile runs its chains over it. During the
// sweep of copy 0, each block of the stream is first expanded for all copies (in place: the four new
// copies at j need only the old ones at j) and collapsed, then its values feed the chains; the sweeps
// of copies 1..3 read back what copy 0's sweep wrote.
//
// No include guard on purpose: each ISA file includes it once, in its own namespace.

constexpr int64_t kHc = 4;                     // the kernels are specialised for the released hc
constexpr int64_t kMix = (2 + kHc) * kHc;      // 24 dot products
constexpr int64_t kLanes = 32;                 // fnT row: 24 mixes, padding
constexpr int64_t kVecs = (kMix + V::W - 1) / V::W;  // vectors that cover the 24 chains
constexpr int64_t kBlock = 256;                // values per block: 32 KiB of fnT
constexpr int64_t kTile = 64;                  // tokens whose accumulators live on the stack
constexpr int64_t kMinChunk = 16;              // fewest tokens a thread-pool chunk gets
static_assert(kLanes - kMix == 8 && kVecs * V::W <= kLanes);

struct Step {
  HcShape s;
  float* X = nullptr;
  const float* y = nullptr;
  HcCoefficients prev;
  HcMixWeights next;
  HcCoefficientsOut out;
  float* u = nullptr;
};

// ---- expand and collapse, lanes = consecutive j ---------------------------------------------------

inline V::F load_part(const float* p, int64_t lanes) { return lanes == V::W ? V::load(p) : V::load_first(p, lanes); }
inline void store_part(float* p, V::F v, int64_t lanes) {
  if (lanes == V::W) {
    V::store(p, v);
  } else {
    V::store_first(p, v, lanes);
  }
}

// u[j] = Σ_c pre[c]·x[c][j] for j in [j0, j0 + jn) of one token.
inline void collapse_span(const float* x, int64_t d, const float* pre, float* u, int64_t j0, int64_t jn) {
  V::F p[kHc];
  for (int64_t c = 0; c < kHc; ++c) p[c] = V::set1(pre[c]);
  for (int64_t j = j0; j < j0 + jn; j += V::W) {
    const int64_t lanes = std::min<int64_t>(V::W, j0 + jn - j);
    V::F acc = V::zero();
    for (int64_t c = 0; c < kHc; ++c) acc = V::add(acc, V::mul(p[c], load_part(x + c * d + j, lanes)));
    store_part(u + j, V::round_bf16(acc), lanes);
  }
}

// x[k][j] ← post[k]·y[j] + Σ_src comb[src][k]·x[src][j] for every copy k and j in [j0, j0 + jn) of one
// token, in place; with Collapse also u[j] = Σ_k pre[k]·x'[k][j] from the new values.
template <bool Collapse>
inline void expand_span(float* x, int64_t d, const float* y, const float* post, const float* comb, const float* pre,
                        float* u, int64_t j0, int64_t jn) {
  V::F c[kHc][kHc], p[kHc], q[kHc];
  for (int64_t k = 0; k < kHc; ++k) {
    p[k] = V::set1(post[k]);
    q[k] = V::set1(Collapse ? pre[k] : 0.0f);
    for (int64_t src = 0; src < kHc; ++src) c[src][k] = V::set1(comb[src * kHc + k]);
  }
  for (int64_t j = j0; j < j0 + jn; j += V::W) {
    const int64_t lanes = std::min<int64_t>(V::W, j0 + jn - j);
    V::F old[kHc], fresh[kHc];
    for (int64_t src = 0; src < kHc; ++src) old[src] = load_part(x + src * d + j, lanes);
    const V::F yv = load_part(y + j, lanes);
    for (int64_t k = 0; k < kHc; ++k) {
      V::F acc = V::zero();
      for (int64_t src = 0; src < kHc; ++src) acc = V::add(acc, V::mul(c[src][k], old[src]));
      fresh[k] = V::round_bf16(V::add(V::mul(p[k], yv), acc));
    }
    for (int64_t k = 0; k < kHc; ++k) store_part(x + k * d + j, fresh[k], lanes);
    if constexpr (Collapse) {
      V::F acc = V::zero();
      for (int64_t k = 0; k < kHc; ++k) acc = V::add(acc, V::mul(q[k], fresh[k]));
      store_part(u + j, V::round_bf16(acc), lanes);
    }
  }
}

// ---- the mixes, lanes = dot products -------------------------------------------------------------

// fnT[j·kLanes + o] = fn[o·n + col0 + j] for j in [0, jn) and the mixes o; the other lanes are left
// as they are (zero_padding set them). 8×8 transposes in ymm registers, with the step that crosses
// 128-bit halves done by the loads (rows r and r+4 into the two halves of one register).
inline void transpose_block(const float* fn, int64_t n, int64_t col0, int64_t jn, float* fnT) {
  const int64_t full = jn / 8 * 8;
  for (int64_t tile = 0; tile < kMix / 8; ++tile) {  // outputs 8·tile .. 8·tile + 7
    const float* rows[8];
    for (int64_t i = 0; i < 8; ++i) rows[i] = fn + (tile * 8 + i) * n + col0;
    for (int64_t j = 0; j < full; j += 8) {
      for (int64_t half = 0; half < 2; ++half) {  // columns j + 4·half .. j + 4·half + 3
        const int64_t c = j + 4 * half;
        __m256 q[4];  // q[i]: row i in the low 128 bits, row i + 4 in the high
        for (int64_t i = 0; i < 4; ++i) {
          const __m256 low = _mm256_castps128_ps256(_mm_loadu_ps(rows[i] + c));
          q[i] = _mm256_insertf128_ps(low, _mm_loadu_ps(rows[i + 4] + c), 1);
        }
        const __m256 t0 = _mm256_unpacklo_ps(q[0], q[1]), t1 = _mm256_unpackhi_ps(q[0], q[1]);
        const __m256 t2 = _mm256_unpacklo_ps(q[2], q[3]), t3 = _mm256_unpackhi_ps(q[2], q[3]);
        float* out = fnT + c * kLanes + tile * 8;
        _mm256_store_ps(out + 0 * kLanes, _mm256_shuffle_ps(t0, t2, 0x44));
        _mm256_store_ps(out + 1 * kLanes, _mm256_shuffle_ps(t0, t2, 0xEE));
        _mm256_store_ps(out + 2 * kLanes, _mm256_shuffle_ps(t1, t3, 0x44));
        _mm256_store_ps(out + 3 * kLanes, _mm256_shuffle_ps(t1, t3, 0xEE));
      }
    }
  }
  for (int64_t j = full; j < jn; ++j) {
    for (int64_t o = 0; o < kMix; ++o) fnT[j * kLanes + o] = fn[o * n + col0 + j];
  }
}

inline void zero_padding(float* fnT) {
  for (int64_t j = 0; j < kBlock; ++j) std::fill(fnT + j * kLanes + kMix, fnT + (j + 1) * kLanes, 0.0f);
}

// G tokens' chains over jn values: acc[g·kLanes ..] += x[g][j]·fnT row j, for j in order.
template <int G>
inline void accumulate(const float* fnT, int64_t jn, const float* const* x, float* acc) {
  V::F a[G][kVecs];
  for (int g = 0; g < G; ++g)
    for (int64_t v = 0; v < kVecs; ++v) a[g][v] = V::load(acc + g * kLanes + v * V::W);
  for (int64_t j = 0; j < jn; ++j) {
    const float* row = fnT + j * kLanes;
    V::F f[kVecs];
    for (int64_t v = 0; v < kVecs; ++v) f[v] = V::load(row + v * V::W);
    for (int g = 0; g < G; ++g) {
      const V::F xb = V::set1(x[g][j]);
      for (int64_t v = 0; v < kVecs; ++v) a[g][v] = V::add(a[g][v], V::mul(xb, f[v]));
    }
  }
  for (int g = 0; g < G; ++g)
    for (int64_t v = 0; v < kVecs; ++v) V::store(acc + g * kLanes + v * V::W, a[g][v]);
}

inline void accumulate_group(int g, const float* fnT, int64_t jn, const float* const* x, float* acc) {
  static_assert(V::kTokens >= 1 && V::kTokens <= 4);
  switch (g) {
    case 1:
      return accumulate<1>(fnT, jn, x, acc);
    case 2:
      if constexpr (V::kTokens >= 2) return accumulate<2>(fnT, jn, x, acc);
      break;
    case 3:
      if constexpr (V::kTokens >= 3) return accumulate<3>(fnT, jn, x, acc);
      break;
    case 4:
      if constexpr (V::kTokens >= 4) return accumulate<4>(fnT, jn, x, acc);
      break;
  }
}

// The sum of squares, rsqrt, scaling and Sinkhorn of one token (its stream already expanded), as the
// reference does them after its chains.
inline void finish_token(const Step& a, const float* acc, int64_t t) {
  const int64_t n = a.s.width();
  const float mean = cascade_sum_of_squares(a.X + t * n, n) / static_cast<float>(n);
  const float rsqrt = 1.0f / std::sqrt(mean + a.s.norm_eps);
  float mixes[kMix];
  for (int64_t o = 0; o < kMix; ++o) mixes[o] = acc[o] * rsqrt;
  reference::hc_split_sinkhorn(mixes, a.next.scale, a.next.base, static_cast<int>(kHc), a.s.sinkhorn_iters, a.s.hc_eps,
                    a.out.pre + t * kHc, a.out.post + t * kHc, a.out.comb + t * kHc * kHc);
}

// Tokens [t0, t1): (Expand: expand with a.prev and a.y; Collapse: collapse with a.prev.pre into a.u)
// and the mixes of a.next, in one pass.
template <bool Expand, bool Collapse>
void step_tokens(const Step& a, int64_t t0, int64_t t1) {
  const int64_t d = a.s.dim, n = a.s.width();
  alignas(64) float acc[kTile * kLanes];
  alignas(64) float fnT[kBlock * kLanes];
  zero_padding(fnT);
  for (int64_t tile = t0; tile < t1; tile += kTile) {
    const int64_t tn = std::min(kTile, t1 - tile);
    std::fill(acc, acc + tn * kLanes, 0.0f);
    for (int64_t k = 0; k < kHc; ++k) {
      for (int64_t j0 = 0; j0 < d; j0 += kBlock) {
        const int64_t jn = std::min(kBlock, d - j0);
        transpose_block(a.next.fn, n, k * d + j0, jn, fnT);
        for (int64_t g = 0; g < tn; g += V::kTokens) {
          const int gn = static_cast<int>(std::min<int64_t>(V::kTokens, tn - g));
          const float* x[V::kTokens];
          for (int i = 0; i < gn; ++i) {
            const int64_t t = tile + g + i;
            float* xt = a.X + t * n;
            if (k == 0 && Expand) {
              expand_span<Collapse>(xt, d, a.y + t * d, a.prev.post + t * kHc, a.prev.comb + t * kHc * kHc,
                                    a.prev.pre + t * kHc, a.u + t * d, j0, jn);
            } else if (k == 0 && Collapse) {
              collapse_span(xt, d, a.prev.pre + t * kHc, a.u + t * d, j0, jn);
            }
            x[i] = xt + k * d + j0;
          }
          accumulate_group(gn, fnT, jn, x, acc + g * kLanes);
        }
      }
    }
    for (int64_t i = 0; i < tn; ++i) finish_token(a, acc + i * kLanes, tile + i);
  }
}

// ---- entry points ---------------------------------------------------------------------------------

template <bool Expand, bool Collapse>
void run_step(const Exec& ex, const Step& a, int64_t count) {
  if (count <= 0) return;
  // Each chunk reads and transposes fn once per tile: whole tiles per chunk when there are tokens
  // enough, and no split below kMinChunk tokens, where the extra read of fn costs more than the
  // second core saves.
  const int64_t threads = ex.threads();
  const int64_t grain = std::clamp((count + threads - 1) / threads, kMinChunk, kTile);
  ex.parallel_for(count, grain, [&](int64_t b, int64_t e, Scratch&) { step_tokens<Expand, Collapse>(a, b, e); });
}

inline void mixes(const Exec& ex, const HcShape& s, const float* X, int64_t count, const HcMixWeights& w, HcCoefficientsOut out) {
  Step a;
  a.s = s;
  a.X = const_cast<float*>(X);  // read only: no expand
  a.next = w;
  a.out = out;
  run_step<false, false>(ex, a, count);
}

inline void collapse(const Exec& ex, const HcShape& s, const float* X, const float* pre, int64_t count, float* u) {
  const int64_t d = s.dim;
  ex.parallel_for(count, 1, [&](int64_t b, int64_t e, Scratch&) {
    for (int64_t t = b; t < e; ++t) collapse_span(X + t * kHc * d, d, pre + t * kHc, u + t * d, 0, d);
  });
}

inline void expand(const Exec& ex, const HcShape& s, float* X, const float* y, const float* post, const float* comb,
                   int64_t count) {
  const int64_t d = s.dim;
  ex.parallel_for(count, 1, [&](int64_t b, int64_t e, Scratch&) {
    for (int64_t t = b; t < e; ++t) {
      expand_span<false>(X + t * kHc * d, d, y + t * d, post + t * kHc, comb + t * kHc * kHc, nullptr, nullptr, 0, d);
    }
  });
}

inline void step(const Exec& ex, const HcShape& s, float* X, const float* y, const HcCoefficients& prev, const HcMixWeights& next,
                 int64_t count, HcCoefficientsOut out, float* u) {
  run_step<true, true>(ex, Step{s, X, y, prev, next, out, u}, count);
}
