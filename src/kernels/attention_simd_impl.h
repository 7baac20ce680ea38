// The ISA-independent part of the fast sparse attention, included by simd_avx2.cpp and
// simd_avx512.cpp inside their target region and namespace, after `V` (see linear_simd_impl.h).
//
// Same operations in the same order as the reference (attention.cpp), vectorized where the order
// allows it:
//  * q·k: each logit is a sequential chain over d. Lanes are heads (q transposed once per call) and
//    each K row value is broadcast, so every lane runs its own head's chain; four rows at a time give
//    independent chains to hide the add latency.
//  * P·V: chunk_acc[i] is a chain over the chunk's rows for each i: lanes are i.
//  * products are rounded separately (mul, then add) as in the reference, so the results match it
//    even for inputs that are not bf16 values.
//  * the running max, exp, the sums and the rescale stay scalar per head, as written.
// The list's packed rows are decoded once per query into the calling thread's scratch (the values
// numeric/row_codecs.h unpacks), then every head reads them. Heads are split over the workers in
// groups of one vector; results do not depend on the split.
//
// No include guard on purpose: each ISA file includes it once, in its own namespace.

constexpr int64_t kAttnChunk = 64;      // the reference's block of indices (K41:328)
constexpr float kAttnMaxFloor = -1e30f;  // its finite floor for the running max (K41:352-355)

// Logits q·row for the heads of one vector (qt: [d][W], heads in lanes) against `count` rows, which
// are all non-null; out[j][W].
template <int R>
inline void logits_rows(const float* qt, int64_t d, const float* const* rows, float* out) {
  V::F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = V::zero();
  for (int64_t i = 0; i < d; ++i) {
    const V::F qv = V::load(qt + i * V::W);
    for (int r = 0; r < R; ++r) acc[r] = V::add(acc[r], V::mul(qv, V::set1(rows[r][i])));
  }
  for (int r = 0; r < R; ++r) V::store(out + r * V::W, acc[r]);
}

// The logits of attention_heads as the reference computes them: fp32 chains of rounded products.
// (A level whose unit computes the same chains faster brings its own, with the same two members.)
struct ChainLogits {
  const float* q;
  int64_t d;
  const float* const* rows;  // the decoded rows, by index
  // The heads [h0, h1) of q transposed, a group of W heads at a time.
  void prepare(int64_t h0, int64_t h1, Scratch& s) {
    const int64_t groups = (h1 - h0 + V::W - 1) / V::W;
    qt = s.get<float>(ScratchSlot::AttentionQuery, static_cast<size_t>(groups * d * V::W));  // [group][d][W]
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t i = 0; i < d; ++i) {
        for (int l = 0; l < V::W; ++l) {
          const int64_t h = h0 + g * V::W + l;
          qt[(g * d + i) * V::W + l] = h < h1 ? q[h * d + i] : 0.0f;
        }
      }
    }
  }
  // Group g's logits against the rows at `at` (count of them, non-null): out[r][W].
  void operator()(int64_t g, const int64_t* at, int64_t count, float* out) const {
    const float* qg = qt + g * d * V::W;
    const float* r4[4];
    int64_t r = 0;
    for (; r + 4 <= count; r += 4) {
      for (int j = 0; j < 4; ++j) r4[j] = rows[at[r + j]];
      logits_rows<4>(qg, d, r4, out + r * V::W);
    }
    for (; r < count; ++r) logits_rows<1>(qg, d, rows + at[r], out + r * V::W);
  }
  float* qt = nullptr;
};

// P·V for NV vectors of d from i0: each lane's chain over the live rows (weight·value, rounded, then
// added), then the head's running sums rescaled and the chunk's part added. NV is a constant so the
// chains stay in registers.
template <int NV>
inline void weighted_rows(const float* weights, const float* const* live, int64_t nlive, int64_t i0, V::F rescale,
                          float* acc) {
  V::F part[NV];
  for (int v = 0; v < NV; ++v) part[v] = V::zero();
  for (int64_t r = 0; r < nlive; ++r) {
    const V::F p = V::set1(weights[r]);
    const float* row = live[r] + i0;
    for (int v = 0; v < NV; ++v) part[v] = V::add(part[v], V::mul(p, V::load(row + v * V::W)));
  }
  for (int v = 0; v < NV; ++v) {
    float* a = acc + i0 + v * V::W;
    V::store(a, V::add(V::mul(V::load(a), rescale), part[v]));
  }
}

// Heads [h0, h1) of the query (h0 a multiple of W); `logits` computes q·row as ChainLogits does.
template <class Logits>
inline void attention_heads(Logits logits, int64_t d, const float* const* rows, int64_t n_rows, const float* sink,
                            float scale, float* out, int64_t h0, int64_t h1, Scratch& s) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t nh = h1 - h0;
  const int64_t groups = (nh + V::W - 1) / V::W;
  logits.prepare(h0, h1, s);
  float* acc = s.get<float>(ScratchSlot::AttentionAcc, static_cast<size_t>(nh * d));             // [head][d]
  float* logit_buf =
      s.get<float>(ScratchSlot::AttentionLogits, static_cast<size_t>(groups * kAttnChunk * V::W));  // [group][j][W]
  std::fill(acc, acc + nh * d, 0.0f);
  std::vector<float> running_max(static_cast<size_t>(nh), kAttnMaxFloor), sum(static_cast<size_t>(nh), 0.0f);
  const int64_t dv = d / V::W * V::W;  // vector part of d; the rest runs scalar, in the same order
  float scores[kAttnChunk], probs[kAttnChunk];
  const float* live[kAttnChunk];
  int64_t live_at[kAttnChunk], live_index[kAttnChunk];
  for (int64_t t = 0; t < n_rows; t += kAttnChunk) {
    const int64_t len = std::min<int64_t>(kAttnChunk, n_rows - t);
    // The chunk's non-null rows, in order; null ones get -inf logits.
    int64_t nlive = 0;
    for (int64_t j = 0; j < len; ++j) {
      if (rows[t + j] != nullptr) {
        live[nlive] = rows[t + j];
        live_index[nlive] = t + j;
        live_at[nlive++] = j;
      }
    }
    for (int64_t g = 0; g < groups; ++g) logits(g, live_index, nlive, logit_buf + g * kAttnChunk * V::W);
    for (int64_t hl = 0; hl < nh; ++hl) {
      const float* lg = logit_buf + (hl / V::W) * kAttnChunk * V::W + hl % V::W;
      float chunk_max = neg_inf;
      for (int64_t j = 0; j < len; ++j) scores[j] = neg_inf * scale;
      for (int64_t r = 0; r < nlive; ++r) scores[live_at[r]] = lg[r * V::W] * scale;
      for (int64_t j = 0; j < len; ++j) chunk_max = std::max(chunk_max, scores[j]);
      const float new_max = std::max(running_max[hl], chunk_max);
      const float rescale = torch_exp(running_max[hl] - new_max);
      // torch's exp of (score - max), a vector at a time (x + (-max) is x - max exactly)
      int64_t j = 0;
      for (const V::F neg_max = V::set1(-new_max); j + V::W <= len; j += V::W)
        V::store(probs + j, V::exp(V::add(V::load(scores + j), neg_max)));
      for (; j < len; ++j) probs[j] = torch_exp(scores[j] - new_max);
      const float chunk_sum = reference::cascade_sum_of(probs, len);  // torch's order, as the reference's
      float weights[kAttnChunk];  // the live rows' probabilities as the reference multiplies them: bf16
      for (int64_t r = 0; r < nlive; ++r) weights[r] = round_bf16(probs[live_at[r]]);
      // P·V and the rescale of the running sums, eight vectors of d at a time.
      float* ah = acc + hl * d;
      const V::F rv = V::set1(rescale);
      int64_t i0 = 0;
      for (; i0 + 8 * V::W <= dv; i0 += 8 * V::W) weighted_rows<8>(weights, live, nlive, i0, rv, ah);
      for (; i0 < dv; i0 += V::W) weighted_rows<1>(weights, live, nlive, i0, rv, ah);
      for (int64_t i = dv; i < d; ++i) {
        float part = 0.0f;
        for (int64_t r = 0; r < nlive; ++r) {
          const float prod = weights[r] * live[r][i];
          part += prod;
        }
        const float kept = ah[i] * rescale;
        ah[i] = kept + part;
      }
      const float kept_sum = sum[hl] * rescale;
      sum[hl] = kept_sum + chunk_sum;
      running_max[hl] = new_max;
    }
  }
  for (int64_t hl = 0; hl < nh; ++hl) {
    const int64_t h = h0 + hl;
    const float total = sum[hl] + torch_exp(sink[h] - running_max[hl]);
    const float* ah = acc + hl * d;
    float* oh = out + h * d;
    const V::F tv = V::set1(total);
    int64_t i = 0;
    for (; i + V::W <= d; i += V::W) V::store(oh + i, V::round_bf16(V::div(V::load(ah + i), tv)));
    for (; i < d; ++i) oh[i] = round_bf16(ah[i] / total);
  }
}

// Decodes the list's rows once per query into the calling thread's scratch `mine`: values[j] is row j's
// values, null where the list has none. each(j, values[j]) runs after each row, on the worker that
// decoded it (the rows split over the workers when there are many; their buffers are disjoint).
template <class Each>
inline const float* const* decode_rows(const Exec& ex, const KvRows& rows, int64_t d, bool parallel, Scratch& mine,
                                       Each each) {
  const int64_t n = rows.size();
  float* decoded = mine.get<float>(ScratchSlot::AttentionRows, static_cast<size_t>(std::max<int64_t>(n * d, 1)));
  const float** values =
      mine.get<const float*>(ScratchSlot::AttentionRowList, static_cast<size_t>(std::max<int64_t>(n, 1)));
  ex.run(parallel && n * d >= (int64_t{1} << 15), n, 8, [&](int64_t j0, int64_t j1, Scratch&) {
    for (int64_t j = j0; j < j1; ++j) {
      const uint8_t* row = kv_row(rows, j);
      values[j] = row != nullptr ? decoded + j * d : nullptr;
      if (row == nullptr) continue;
      decode_kv_row_fast(kv_row_format(rows, j), row, d, decoded + j * d);
      each(j, decoded + j * d);
    }
  });
  return values;
}

// Work of one query: heads · rows · d multiply-adds, twice. Small ones stay on the calling thread.
inline bool attention_in_parallel(int64_t heads, int64_t rows, int64_t d) {
  return heads * rows * d >= (int64_t{1} << 16) && heads > V::W;
}

inline void sparse_attention_simd(const Exec& ex, const float* q, int64_t heads, int64_t d, const KvRows& rows,
                                  const float* sink, float scale, float* out) {
  if (heads <= 0) return;
  const int64_t n = rows.size();
  const bool parallel = attention_in_parallel(heads, n, d);
  ex.serial(1, [&](int64_t, int64_t, Scratch& mine) {
    const float* const* values = decode_rows(ex, rows, d, parallel, mine, [](int64_t, const float*) {});
    ex.run(parallel, heads, V::W, [&](int64_t h0, int64_t h1, Scratch& s) {
      attention_heads(ChainLogits{q, d, values}, d, values, n, sink, scale, out, h0, h1, s);
    });
  });
}
