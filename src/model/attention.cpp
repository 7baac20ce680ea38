#include "model/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/index_score.h"
#include "numeric/formats.h"
#include "numeric/quant.h"
#include "numeric/row_codecs.h"
#include "util/error.h"

namespace dsv41 {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void rms_rows(float* x, int64_t rows, int64_t n, const Bf16Tensor& w, float eps) {
  for (int64_t i = 0; i < rows; ++i) rms_norm(x + i * n, n, w.bits.data(), eps, x + i * n, true);
}

bool runs_compressor(const LayerRole& r, bool replay) { return r.compress_ratio > 0 && r.kv_source && !replay; }
bool runs_indexer(const LayerRole& r) { return r.compress_ratio > 0 && r.index_source; }

// Query heads through the q-LoRA; the normed low-rank rows are kept for the indexer's queries.
void project_queries(const ModelConfig& c, const AttentionWeights& w, const float* x, AttentionProjection& p) {
  const int64_t m = p.count, Q = c.q_lora_rank;
  p.qr.resize(static_cast<size_t>(m * Q));
  p.q.resize(static_cast<size_t>(m * c.n_heads * c.head_dim));
  linear_fp8(x, m, w.wq_a, p.qr.data());
  rms_rows(p.qr.data(), m, Q, w.q_norm, static_cast<float>(c.norm_eps));
  linear_fp8(p.qr.data(), m, w.wq_b, p.q.data());
}

// This layer's window KV: one row per token.
void project_window_kv(const ModelConfig& c, const AttentionWeights& w, const float* x, AttentionProjection& p) {
  const int64_t m = p.count, D = c.head_dim;
  p.kv.resize(static_cast<size_t>(m * D));
  linear_fp8(x, m, w.wkv, p.kv.data());
  rms_rows(p.kv.data(), m, D, w.kv_norm, static_cast<float>(c.norm_eps));
}

// The compressor's projections of each token (model-spec §3.3 step 3): ratio 1 is a plain bf16
// projection; ratio > 1 projects in fp32, with the gate scores its pooling needs.
void project_compressor_rows(const ModelConfig& c, const LayerRole& r, const AttentionWeights& w, const float* x,
                             AttentionProjection& p) {
  const int64_t m = p.count, D = c.head_dim;
  p.compressor_kv.resize(static_cast<size_t>(m * D));
  if (r.compress_ratio == 1) {
    linear_bf16(x, m, w.comp_wkv.view(), p.compressor_kv.data());
    return;
  }
  p.compressor_score.resize(static_cast<size_t>(m * D));
  linear_f32(x, m, w.comp_wkv.view(), p.compressor_kv.data());
  linear_f32(x, m, w.comp_wgate.view(), p.compressor_score.data());
}

// The indexer's query heads (from the q-LoRA rows) and per-head weights (model-spec §3.3 step 4).
void project_indexer_rows(const ModelConfig& c, const AttentionWeights& w, const float* x, AttentionProjection& p) {
  const int64_t m = p.count, nh = c.index_n_heads;
  p.index_q.resize(static_cast<size_t>(m * nh * c.index_head_dim));
  p.index_weights.resize(static_cast<size_t>(m * nh));
  linear_fp8(p.qr.data(), m, w.idx_wq_b, p.index_q.data());
  linear_bf16(x, m, w.idx_weights_proj.view(), p.index_weights.data());
}

// The compressor of a KV source (model-spec §3.3 step 3): pools `ratio` consecutive tokens' projected
// rows into one latent row. Returns the latents of the groups this call completes (before RoPE) and
// their group indices; an incomplete group waits in the state's tail.
std::vector<float> compress(const ModelConfig& c, const LayerRole& r, const AttentionWeights& w,
                            const SequenceRows& rows, ForwardContext& ctx, KvSourceState& src, int64_t& first_group,
                            int64_t& groups) {
  const int64_t D = c.head_dim, s = ctx.count, ratio = r.compress_ratio;
  first_group = ctx.start / ratio;
  groups = (ctx.start + s) / ratio - first_group;
  std::vector<float> latent(static_cast<size_t>(groups * D));
  if (ratio == 1) {  // one token per group: its projected row is the latent
    std::copy_n(rows.compressor_kv, s * D, latent.data());
  } else {
    // ratio > 1 pools in fp32 with a softmax gate over the group's tokens, per channel
    const float* kv = rows.compressor_kv;
    const float* score = rows.compressor_score;
    if (ctx.record_compressor_rows) {
      ctx.compressor_kv[r.layer].assign(kv, kv + s * D);
      ctx.compressor_score[r.layer].assign(score, score + s * D);
    }
    if (src.tail_kv.empty()) {
      src.tail_kv.assign(static_cast<size_t>(ratio * D), 0.0f);
      src.tail_score.assign(static_cast<size_t>(ratio * D), kNegInf);
    }
    for (int64_t i = 0; i < s; ++i) {  // every token goes to its slot in the group buffer
      const int64_t pos = ctx.start + i, slot = pos % ratio;
      std::copy_n(&kv[i * D], D, &src.tail_kv[slot * D]);
      std::copy_n(&score[i * D], D, &src.tail_score[slot * D]);
      if (slot != ratio - 1) continue;
      float* out = &latent[(pos / ratio - first_group) * D];
      for (int64_t ch = 0; ch < D; ++ch) {
        float mx = kNegInf;
        for (int64_t t = 0; t < ratio; ++t) mx = std::max(mx, src.tail_score[t * D + ch]);
        float sum = 0;
        for (int64_t t = 0; t < ratio; ++t) sum += std::exp(src.tail_score[t * D + ch] - mx);
        float acc = 0;
        for (int64_t t = 0; t < ratio; ++t) {
          acc += src.tail_kv[t * D + ch] * (std::exp(src.tail_score[t * D + ch] - mx) / sum);
        }
        out[ch] = round_bf16(acc);
      }
    }
  }
  rms_rows(latent.data(), groups, D, w.comp_norm, static_cast<float>(c.norm_eps));
  return latent;
}

// Index keys from un-rotated latents: k_norm(wk(latent)), RoPE at the group's first position, FP4
// (E8M0 per 32), appended to the owner's paged index-key rows.
void publish_index_keys(const ModelConfig& c, const LayerRole& r, const AttentionWeights& w, const RopeTable& rope,
                        const std::vector<float>& latent, int64_t first_group, int64_t groups, KvSourceState& src) {
  const int64_t K = c.index_head_dim, rd = c.rope_head_dim;
  if (src.index_keys.size() != first_group) fail("attention", "index keys are not contiguous with the sequence");
  std::vector<float> k(static_cast<size_t>(groups * K));
  linear_bf16(latent.data(), groups, w.idx_wk.view(), k.data());
  rms_rows(k.data(), groups, K, w.idx_k_norm, static_cast<float>(c.norm_eps));
  for (int64_t g = 0; g < groups; ++g) {
    rope.apply(&k[g * K + K - rd], (first_group + g) * r.compress_ratio, false);
    pack_index_key_row(&k[g * K], K, src.index_keys.append());
  }
}

// Main compressed rows: RoPE at the group's first position, FP4 with E4M3 scales per 16, appended to
// the owner's paged rows.
void publish_rows(const ModelConfig& c, const LayerRole& r, const RopeTable& rope, std::vector<float>& latent,
                  int64_t first_group, int64_t groups, KvSourceState& src) {
  const int64_t D = c.head_dim, rd = c.rope_head_dim;
  if (src.compressed.size() != first_group) fail("attention", "compressed rows are not contiguous with the sequence");
  for (int64_t g = 0; g < groups; ++g) {
    rope.apply(&latent[g * D + D - rd], (first_group + g) * r.compress_ratio, false);
    pack_main_kv_row(&latent[g * D], D, src.compressed.append());
  }
}

// The indexer of an index source (model-spec §3.3 step 4): scores every visible compressed row with
// fp4 query heads against the shared index keys, in bf16 as the reference does, and keeps the top-k.
// Its query and head-weight rows come projected (project_attention).
void run_indexer(const ModelConfig& c, const LayerRole& r, const RopeTable& rope, const SequenceRows& rows,
                 const PagedRows& keys, ForwardContext& ctx) {
  const int64_t s = ctx.count, nh = c.index_n_heads, K = c.index_head_dim, rd = c.rope_head_dim;
  const int64_t ratio = r.compress_ratio, n_keys = (ctx.start + s) / ratio;
  auto& selected = ctx.topk[r.layer];
  selected.assign(static_cast<size_t>(s), {});
  ctx.topk_written[r.layer] = true;
  if (r.candidate_source) {
    ctx.candidates.assign(static_cast<size_t>(s), {});
    ctx.candidates_written = true;
  }
  IndexCapture* cap = ctx.capture_index ? &ctx.index_captures[r.layer] : nullptr;
  if (cap) {
    cap->n_keys = n_keys;
    cap->k = std::min<int64_t>(c.index_topk, n_keys);
    cap->scores.assign(static_cast<size_t>(s * n_keys), 0.0f);
    cap->selected.assign(static_cast<size_t>(s * cap->k), -1);
    if (r.candidate_source) cap->candidates.assign(static_cast<size_t>(s * n_keys), 0);
  }
  if (n_keys == 0) return;  // nothing compressed yet: an empty selection
  if (keys.size() < n_keys) fail("indexer", "index keys read before they were written");

  // copies: RoPE and quantization below change them, and the scoring indexes them as vectors
  std::vector<float> q(rows.index_q, rows.index_q + s * nh * K);
  std::vector<float> wts(rows.index_weights, rows.index_weights + s * nh);
  const float head_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(K)) / std::sqrt(static_cast<double>(nh)));
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t h = 0; h < nh; ++h) rope.apply(&q[(i * nh + h) * K + K - rd], ctx.start + i, false);
    fp4_qdq_e8m0(&q[i * nh * K], nh * K);
    for (int64_t h = 0; h < nh; ++h) wts[i * nh + h] = round_bf16(wts[i * nh + h] * head_scale);
  }

  // Scores are computed for a block of queries at a time, walking the packed keys once per block: the
  // [queries × keys] matrix never exceeds kScoreBudget however long the context.
  constexpr int64_t kScoreBudget = int64_t{4} << 20;
  const int64_t block = std::clamp<int64_t>(kScoreBudget / (n_keys * 4), 1, s);
  std::vector<float> scores(static_cast<size_t>(block * n_keys));
  std::vector<float> score(static_cast<size_t>(n_keys));
  // The kernel reads the packed rows in place, and each query's keys up to the ones it can see
  // (a row is visible once its group is complete); the rest score -inf.
  std::vector<const uint8_t*> key_rows(static_cast<size_t>(n_keys));
  for (int64_t t = 0; t < n_keys; ++t) key_rows[t] = keys.row(t);
  std::vector<int64_t> visible_keys(static_cast<size_t>(s));
  for (int64_t i = 0; i < s; ++i) visible_keys[i] = (ctx.start + i + 1) / ratio;
  std::vector<uint8_t> in_pool;
  const int64_t bs = c.candidate_block_size;
  for (int64_t i = 0; i < s; ++i) {
    const int64_t visible = visible_keys[i];
    if (i % block == 0) {
      const int64_t q0 = i, q1 = std::min(s, i + block);
      index_scores(&q[q0 * nh * K], &wts[q0 * nh], q1 - q0, nh, K, key_rows.data(), n_keys, &visible_keys[q0],
                   scores.data());
    }
    std::copy_n(&scores[(i % block) * n_keys], n_keys, score.begin());
    if (r.candidate_source) {
      ctx.candidates[i] = select_candidate_blocks(score.data(), n_keys, visible, c.candidate_topk_blocks,
                                                  c.candidate_block_size);
    } else if (r.candidate_user) {
      if (!ctx.candidates_written) fail("indexer", "candidate pool read before the candidate source wrote it");
      // level two: only rows inside the pool's blocks keep their score
      in_pool.assign(static_cast<size_t>(n_keys), 0);
      for (int32_t b : ctx.candidates[i])
        for (int64_t t = b * bs; t < std::min(n_keys, (b + 1) * bs); ++t) in_pool[t] = 1;
      for (int64_t t = 0; t < n_keys; ++t) {
        if (!in_pool[t]) score[t] = kNegInf;
      }
    }
    std::vector<int32_t> top = topk_ascending(score.data(), n_keys, std::min<int64_t>(c.index_topk, n_keys));
    for (int32_t& t : top) {
      if (t >= visible) t = -1;
    }
    if (cap) {
      std::copy(score.begin(), score.end(), cap->scores.begin() + i * n_keys);
      std::copy(top.begin(), top.end(), cap->selected.begin() + i * cap->k);
      if (r.candidate_source) {
        for (int32_t b : ctx.candidates[i])
          for (int64_t t = b * bs; t < std::min(n_keys, (b + 1) * bs); ++t) cap->candidates[i * n_keys + t] = 1;
      }
    }
    selected[i] = std::move(top);
  }
}

// Query heads: RoPE on the last rd channels of each head, at each token's position.
void rotate_queries(const ModelConfig& c, const RopeTable& rope, const ForwardContext& ctx, float* q) {
  const int64_t H = c.n_heads, D = c.head_dim, rd = c.rope_head_dim;
  for (int64_t i = 0; i < ctx.count; ++i)
    for (int64_t h = 0; h < H; ++h) rope.apply(&q[(i * H + h) * D + D - rd], ctx.start + i, false);
}

// This call's window KV rows: RoPE at each position, then FP8 over all lanes (RoPE tail included).
// Returns the rows packed as the ring stores them; `kv` is left holding the values they decode to,
// which is what attention reads.
std::vector<uint8_t> quantize_window_rows(const ModelConfig& c, const RopeTable& rope, const ForwardContext& ctx,
                                          float* kv) {
  const int64_t D = c.head_dim, rd = c.rope_head_dim, wrb = window_row_bytes(D);
  std::vector<uint8_t> packed(static_cast<size_t>(ctx.count * wrb));
  for (int64_t i = 0; i < ctx.count; ++i) {
    rope.apply(&kv[i * D + D - rd], ctx.start + i, false);
    pack_window_row(&kv[i * D], D, &packed[i * wrb]);
    unpack_window_row(&packed[i * wrb], D, &kv[i * D]);
  }
  return packed;
}

// The ring's rows from earlier calls that this call's queries can read, decoded once for all of them
// into their slots: positions from the first query's window reach (and the layer's first window
// row) up to the call's start. Short contexts leave most slots unread, so they are not decoded.
std::vector<float> decode_ring(const ModelConfig& c, const std::vector<uint8_t>& ring, int64_t window_from,
                               const ForwardContext& ctx) {
  const int64_t D = c.head_dim, W = c.window_size, wrb = window_row_bytes(D);
  std::vector<float> rows;
  if (ctx.start == 0) return rows;
  rows.resize(static_cast<size_t>(W * D));
  for (int64_t p = std::max({int64_t{0}, window_from, ctx.start - W + 1}); p < ctx.start; ++p) {
    unpack_window_row(&ring[(p % W) * wrb], D, &rows[(p % W) * D]);
  }
  return rows;
}

// The last window of this call's packed rows replace the ring's slots of their positions.
void store_window_rows(const ModelConfig& c, const std::vector<uint8_t>& packed, const ForwardContext& ctx,
                       std::vector<uint8_t>& ring) {
  const int64_t W = c.window_size, s = ctx.count, wrb = window_row_bytes(c.head_dim);
  for (int64_t i = std::max<int64_t>(0, s - W); i < s; ++i) {
    std::copy_n(&packed[i * wrb], wrb, &ring[((ctx.start + i) % W) * wrb]);
  }
}

// Steps 3-4 of a compressed layer: a KV source compresses this call's tokens and publishes rows and
// index keys; an index source selects rows for each query. Afterwards the top-k this layer reads
// must have been published.
void compressed_kv_and_selection(const ModelConfig& c, const LayerRole& r, const AttentionWeights& w,
                                 const RopeTable& rope, const SequenceRows& rows, ForwardContext& ctx,
                                 SequenceState& st) {
  if (r.kv_source) {
    KvSourceState& src = *st.sources[r.layer];
    int64_t first = 0, groups = 0;
    std::vector<float> latent;
    if (!ctx.replay) {
      latent = compress(c, r, w, rows, ctx, src, first, groups);
    } else if (src.compressed.size() < (ctx.start + ctx.count) / r.compress_ratio) {
      fail("attention", "replay over positions whose compressed rows are not cached");
    }
    if (groups > 0) {
      publish_index_keys(c, r, w, rope, latent, first, groups, src);
      st.last_index_keys_layer = r.layer;
    }
    if (r.index_source) {
      // Owner keys by default; the shipped decode path scores whatever was published last when this
      // source emitted nothing in this call (model-spec §7 item 11).
      int keys_layer = r.layer;
      if (ctx.index_keys == IndexKeysMode::Reference && groups == 0 && st.last_index_keys_layer >= 0) {
        keys_layer = st.last_index_keys_layer;
      }
      run_indexer(c, r, rope, rows, st.sources[keys_layer]->index_keys, ctx);
    }
    if (groups > 0) publish_rows(c, r, rope, latent, first, groups, src);
  } else if (r.index_source) {
    int keys_layer = ctx.index_keys == IndexKeysMode::Reference && st.last_index_keys_layer >= 0
                         ? st.last_index_keys_layer
                         : r.index_keys_from;
    run_indexer(c, r, rope, rows, st.sources[keys_layer]->index_keys, ctx);
  }
  if (!ctx.topk_written[r.topk_from]) fail("attention", "top-k read before its index source wrote it");
}

// Step 5: each query attends over [window rows, selected compressed rows] in the reference's list
// layout; the output's RoPE tail is rotated back at the query's position.
void sparse_attention_per_query(const ModelConfig& c, const LayerRole& r, const AttentionWeights& w,
                                const RopeTable& rope, const float* q, const float* kv,
                                const std::vector<float>& ring_rows, const ForwardContext& ctx,
                                const SequenceState& st, float* o) {
  const int64_t s = ctx.count, H = c.n_heads, D = c.head_dim, rd = c.rope_head_dim, W = c.window_size;
  std::vector<const float*> rows;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const KvSourceState* kv_src = r.compress_ratio > 0 ? st.sources[r.kv_from].get() : nullptr;
  std::vector<float> selected_rows;  // this query's compressed rows, decoded
  for (int64_t i = 0; i < s; ++i) {
    const int64_t pos = ctx.start + i;
    rows.clear();
    auto row_at = [&](int64_t p) -> const float* {
      if (p < 0 || p > pos || p < st.window_from[r.layer]) return nullptr;
      return p >= ctx.start ? &kv[(p - ctx.start) * D] : &ring_rows[(p % W) * D];
    };
    if (ctx.start == 0) {  // prefill layout: ascending from the window start, -1 padding at the end
      const int64_t width = std::min(s, W), first = std::max<int64_t>(0, pos - W + 1);
      for (int64_t j = 0; j < width; ++j) rows.push_back(row_at(first + j));
    } else {  // decode layout: the whole ring oldest first, unfilled slots (-1) at the start
      for (int64_t j = 0; j < W; ++j) rows.push_back(row_at(pos - W + 1 + j));
    }
    if (kv_src) {
      const std::vector<int32_t>& top = ctx.topk[r.topk_from][i];
      selected_rows.resize(top.size() * static_cast<size_t>(D));
      for (size_t j = 0; j < top.size(); ++j) {
        const int32_t t = top[j];
        if (t >= kv_src->compressed.size()) fail("attention", "compressed row read before it was written");
        if (t < 0) {
          rows.push_back(nullptr);
          continue;
        }
        unpack_main_kv_row(kv_src->compressed.row(t), D, &selected_rows[j * D]);
        rows.push_back(&selected_rows[j * D]);
      }
    }
    sparse_attention(&q[i * H * D], H, D, rows, w.attn_sink.data(), scale, &o[i * H * D]);
    for (int64_t h = 0; h < H; ++h) rope.apply(&o[(i * H + h) * D + D - rd], pos, true);
  }
}

}  // namespace

AttentionProjection project_attention(const ModelConfig& c, const LayerRole& r, const AttentionWeights& w,
                                      const float* x, int64_t count, bool replay) {
  AttentionProjection p;
  p.count = count;
  project_queries(c, w, x, p);
  project_window_kv(c, w, x, p);
  if (runs_compressor(r, replay)) project_compressor_rows(c, r, w, x, p);
  if (runs_indexer(r)) project_indexer_rows(c, w, x, p);
  return p;
}

SequenceRows sequence_rows(const ModelConfig& c, AttentionProjection& p, int64_t first) {
  const int64_t HD = c.n_heads * c.head_dim, D = c.head_dim, nh = c.index_n_heads, K = c.index_head_dim;
  auto at = [first](std::vector<float>& v, int64_t width) { return v.empty() ? nullptr : &v[first * width]; };
  SequenceRows rows;
  rows.q = at(p.q, HD);
  rows.kv = at(p.kv, D);
  rows.compressor_kv = at(p.compressor_kv, D);
  rows.compressor_score = at(p.compressor_score, D);
  rows.index_q = at(p.index_q, nh * K);
  rows.index_weights = at(p.index_weights, nh);
  return rows;
}

void attention_core(const ModelConfig& c, const LayerRole& r, const AttentionWeights& w, const RopeTable& rope,
                    const SequenceRows& rows, ForwardContext& ctx, SequenceState& st, float* o) {
  rotate_queries(c, rope, ctx, rows.q);
  const std::vector<uint8_t> packed = quantize_window_rows(c, rope, ctx, rows.kv);
  std::vector<uint8_t>& ring = st.window[r.layer];
  if (ring.empty()) ring.assign(static_cast<size_t>(c.window_size * window_row_bytes(c.head_dim)), 0);
  const std::vector<float> ring_rows = decode_ring(c, ring, st.window_from[r.layer], ctx);
  if (r.compress_ratio > 0) compressed_kv_and_selection(c, r, w, rope, rows, ctx, st);
  sparse_attention_per_query(c, r, w, rope, rows.q, rows.kv, ring_rows, ctx, st, o);
  store_window_rows(c, packed, ctx, ring);
}

void attention_forward(const ModelConfig& c, const LayerRole& r, const AttentionWeights& w, const RopeTable& rope,
                       const float* x, ForwardContext& ctx, SequenceState& st, float* out) {
  AttentionProjection p = project_attention(c, r, w, x, ctx.count, ctx.replay);
  std::vector<float> o(static_cast<size_t>(ctx.count * c.n_heads * c.head_dim));
  attention_core(c, r, w, rope, sequence_rows(c, p, 0), ctx, st, o.data());
  output_projection(c, w, o.data(), ctx.count, out);
}

void output_projection(const ModelConfig& c, const AttentionWeights& w, const float* o, int64_t s, float* out) {
  // grouped O-LoRA: block-diagonal wo_a (bf16) per group of heads, then wo_b over all groups
  const int64_t H = c.n_heads, D = c.head_dim, G = c.o_groups, R = c.o_lora_rank, Kg = H * D / G;
  std::vector<float> og(static_cast<size_t>(s * G * R)), xg(static_cast<size_t>(s * Kg)), yg(static_cast<size_t>(s * R));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < s; ++i) std::copy_n(&o[i * H * D + g * Kg], Kg, &xg[i * Kg]);
    linear_bf16(xg.data(), s, w.wo_a.rows(g * R, R), yg.data());
    for (int64_t i = 0; i < s; ++i) std::copy_n(&yg[i * R], R, &og[(i * G + g) * R]);
  }
  linear_fp8(og.data(), s, w.wo_b, out);
}

}  // namespace dsv41
