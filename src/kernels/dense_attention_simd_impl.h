// The ISA-independent part of the ViT's bidirectional attention (Backend::dense_attention), included
// by simd_avx2.cpp, simd_avx512.cpp and simd_avx512_bf16.cpp inside their target region and
// namespace, after `V`.
//
// The reference (vision_ops.cpp) runs one query at a time: a q·k chain per key in lane order, the
// max, exp(s − max), the sum and o = Σ p·v, each a sequential fp32 chain in key order. Here the W
// lanes of a vector are W queries of one head, so every lane runs exactly the reference's chains
// (same operations, same order, a product rounded before its add) and the results are its bits:
//  * q·k (DenseScores): queries transposed once per block (qt[e][W]); each key value is broadcast;
//    four keys at a time give independent chains to hide the add latency. A level may bring its own
//    (simd_avx512_bf16.cpp: the same chains two products at a time).
//  * the max, exp (V::exp is torch's exp, as in the sparse attention) and the sum: per lane, in key order.
//  * P·V: sixteen of the head's d output values at a time, each a chain over the keys.
// Blocks of W queries × one head are split over the workers; results do not depend on the split.
//
// No include guard on purpose: each ISA file includes it once, in its own namespace.

// q·k for queries [i0, i0 + count) of head h against every key: sc[t][W] = chain · scale; returns
// each lane's max (std::max(mx, s) in key order: s only when it is greater).
struct DenseScores {
  const float* q;
  const float* k;
  int64_t heads, d, stride;
  V::F operator()(int64_t n, float scale, int64_t i0, int64_t count, int64_t h, float* sc, Scratch& s) const {
    float* qt = s.get<float>(ScratchSlot::DenseQuery, static_cast<size_t>(d * V::W));  // [e][W]
    for (int64_t e = 0; e < d; ++e) {
      for (int l = 0; l < V::W; ++l) qt[e * V::W + l] = l < count ? q[(i0 + l) * stride + h * d + e] : 0.0f;
    }
    const float* kh = k + h * d;
    const V::F sv = V::set1(scale);
    V::F mx = V::set1(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      V::F acc[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
      for (int64_t e = 0; e < d; ++e) {
        const V::F qv = V::load(qt + e * V::W);
        for (int r = 0; r < 4; ++r) acc[r] = V::add(acc[r], V::mul(qv, V::set1(kh[(t + r) * stride + e])));
      }
      for (int r = 0; r < 4; ++r) {
        const V::F sr = V::mul(acc[r], sv);
        V::store(sc + (t + r) * V::W, sr);
        mx = V::max(sr, mx);
      }
    }
    for (; t < n; ++t) {
      V::F acc = V::zero();
      for (int64_t e = 0; e < d; ++e) acc = V::add(acc, V::mul(V::load(qt + e * V::W), V::set1(kh[t * stride + e])));
      const V::F sr = V::mul(acc, sv);
      V::store(sc + t * V::W, sr);
      mx = V::max(sr, mx);
    }
    return mx;
  }
};

// Queries [i0, i0 + count) (count ≤ W) of head h: their scores, then softmax and P·V.
template <class Scores>
inline void dense_attention_block(const Scores& scores, const float* v, int64_t n, int64_t heads, int64_t d,
                                  int64_t stride, float scale, int64_t i0, int64_t count, int64_t h, float* out,
                                  Scratch& s) {
  float* sc = s.get<float>(ScratchSlot::DenseScores, static_cast<size_t>(n * V::W));  // [t][W]
  float* ot = s.get<float>(ScratchSlot::DenseOut, static_cast<size_t>(d * V::W));     // [e][W]
  const V::F mx = scores(n, scale, i0, count, h, sc, s);
  const float* vh = v + h * d;
  // exp(s − max) as s + (−max), which is the same subtraction; the sum in key order
  const V::F neg_mx = V::xor_bits(mx, V::set1(-0.0f));
  V::F sum = V::zero();
  for (int64_t t = 0; t < n; ++t) {
    const V::F p = V::exp(V::add(V::load(sc + t * V::W), neg_mx));
    V::store(sc + t * V::W, p);
    sum = V::add(sum, p);
  }
  // P·V, up to sixteen output values (vectors of W queries) per pass over the keys
  for (int64_t e0 = 0; e0 < d; e0 += 16) {
    const int ne = static_cast<int>(std::min<int64_t>(16, d - e0));
    V::F o[16];
    for (int e = 0; e < 16; ++e) o[e] = V::zero();
    for (int64_t t = 0; t < n; ++t) {
      const V::F p = V::load(sc + t * V::W);
      const float* vt = vh + t * stride + e0;
      for (int e = 0; e < ne; ++e) o[e] = V::add(o[e], V::mul(p, V::set1(vt[e])));
    }
    for (int e = 0; e < ne; ++e) V::store(ot + (e0 + e) * V::W, V::round_bf16(V::div(o[e], sum)));
  }
  for (int l = 0; l < count; ++l) {
    float* row = out + (i0 + l) * heads * d + h * d;
    for (int64_t e = 0; e < d; ++e) row[e] = ot[e * V::W + l];
  }
}

template <class Scores>
inline void dense_attention_simd(const Exec& ex, const Scores& scores, const float* v, int64_t n, int64_t heads,
                                 int64_t d, int64_t stride, float scale, float* out) {
  // head-major work items: consecutive blocks of a worker read the same head's keys and values, which
  // stay in cache (all heads' are n·heads·d·8 bytes: 71 MB for the largest released image)
  const int64_t blocks = (n + V::W - 1) / V::W;
  ex.run(n * n * heads * d >= (int64_t{1} << 18), blocks * heads, 1, [&](int64_t b0, int64_t b1, Scratch& s) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = (b % blocks) * V::W;
      dense_attention_block(scores, v, n, heads, d, stride, scale, i0, std::min<int64_t>(V::W, n - i0), b / blocks,
                            out, s);
    }
  });
}

inline void dense_attention_simd(const Exec& ex, const float* q, const float* k, const float* v, int64_t n,
                                 int64_t heads, int64_t d, int64_t stride, float scale, float* out) {
  dense_attention_simd(ex, DenseScores{q, k, heads, d, stride}, v, n, heads, d, stride, scale, out);
}
