#include "model/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "numeric/row_codecs.h"
#include "state/sequence_access.h"
#include "util/error.h"

namespace dsv41 {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void norm_rows(const Backend& be, float* x, int64_t rows, int64_t n, const Bf16Tensor& w, double eps) {
  be.rms_norm(x, rows, n, w.data(), static_cast<float>(eps), x, true);
}

// The rope lanes (the last rope_head_dim of each `width`-wide row) of `rows` rows, `per_position`
// consecutive rows sharing a position: first, first + step, ...
RotaryRows rope_tail(float* x, int64_t rows, int64_t width, int64_t rope_dim, int64_t per_position, int64_t first,
                     int64_t step = 1) {
  return {x + width - rope_dim, rows, width, per_position, first, step};
}

bool runs_compressor(const LayerRole& r, bool replay) { return r.compress_ratio > 0 && r.kv_source && !replay; }
bool runs_indexer(const LayerRole& r) { return r.compress_ratio > 0 && r.index_source; }

// Query heads through the q-LoRA; the normed low-rank rows are kept for the indexer's queries.
void project_queries(const Backend& be, const ModelConfig& c, const AttentionWeights& w, const float* x,
                     AttentionProjection& p) {
  const int64_t m = p.count, Q = c.q_lora_rank;
  p.qr.resize(static_cast<size_t>(m * Q));
  p.q.resize(static_cast<size_t>(m * c.n_heads * c.head_dim));
  be.linear_fp8(x, m, w.wq_a, p.qr.data());
  norm_rows(be, p.qr.data(), m, Q, w.q_norm, c.norm_eps);
  be.linear_fp8(p.qr.data(), m, w.wq_b, p.q.data());
}

// This layer's window KV: one row per token.
void project_window_kv(const Backend& be, const ModelConfig& c, const AttentionWeights& w, const float* x,
                       AttentionProjection& p) {
  const int64_t m = p.count, D = c.head_dim;
  p.kv.resize(static_cast<size_t>(m * D));
  be.linear_fp8(x, m, w.wkv, p.kv.data());
  norm_rows(be, p.kv.data(), m, D, w.kv_norm, c.norm_eps);
}

// The compressor's projections of each token (model-spec §3.3 step 3): ratio 1 is a plain bf16
// projection; ratio > 1 projects in fp32, with the gate scores its pooling needs.
void project_compressor_rows(const Backend& be, const ModelConfig& c, const LayerRole& r, const AttentionWeights& w,
                             const float* x, AttentionProjection& p) {
  const int64_t m = p.count, D = c.head_dim;
  p.compressor_kv.resize(static_cast<size_t>(m * D));
  if (r.compress_ratio == 1) {
    be.linear_bf16(x, m, w.comp_wkv.view(), p.compressor_kv.data());
    return;
  }
  p.compressor_score.resize(static_cast<size_t>(m * D));
  be.linear_f32(x, m, w.comp_wkv.view(), p.compressor_kv.data());
  be.linear_f32(x, m, w.comp_wgate.view(), p.compressor_score.data());
}

// The indexer's query heads (from the q-LoRA rows) and per-head weights (model-spec §3.3 step 4).
void project_indexer_rows(const Backend& be, const ModelConfig& c, const AttentionWeights& w, const float* x,
                          AttentionProjection& p) {
  const int64_t m = p.count, nh = c.index_n_heads;
  p.index_q.resize(static_cast<size_t>(m * nh * c.index_head_dim));
  p.index_weights.resize(static_cast<size_t>(m * nh));
  be.linear_fp8(p.qr.data(), m, w.idx_wq_b, p.index_q.data());
  be.linear_bf16(x, m, w.idx_weights_proj.view(), p.index_weights.data());
}

// The compressor of a KV source (model-spec §3.3 step 3): pools `ratio` consecutive tokens' projected
// rows into one latent row. Returns the latents of the groups this call completes (before RoPE) and
// their group indices; an incomplete group waits in the state's tail.
std::vector<float> compress(const Backend& be, const ModelConfig& c, const LayerRole& r, const AttentionWeights& w,
                            const SequenceRows& rows, ForwardContext& ctx, KvSourceState& src, int64_t& first_group,
                            int64_t& groups) {
  const int64_t D = c.head_dim, s = ctx.count, ratio = r.compress_ratio;
  first_group = ctx.start / ratio;
  groups = (ctx.start + s) / ratio - first_group;
  std::vector<float> latent(static_cast<size_t>(groups * D));
  if (ratio == 1) {  // one token per group: its projected row is the latent
    std::copy_n(rows.compressor_kv, s * D, latent.data());
  } else {
    // ratio > 1 pools with a softmax gate over the group's tokens, per channel
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
      be.compressor_pool(src.tail_kv.data(), src.tail_score.data(), ratio, D, &latent[(pos / ratio - first_group) * D]);
    }
  }
  norm_rows(be, latent.data(), groups, D, w.comp_norm, c.norm_eps);
  return latent;
}

// Index keys from un-rotated latents: k_norm(wk(latent)), RoPE at the group's first position, FP4
// (E8M0 per 32), appended to the owner's paged index-key rows.
void publish_index_keys(const Backend& be, const ModelConfig& c, const LayerRole& r, const AttentionWeights& w,
                        const RopeTable& rope, const std::vector<float>& latent, int64_t first_group, int64_t groups,
                        KvSourceState& src) {
  const int64_t K = c.index_head_dim;
  if (src.index_keys.size() != first_group) fail("attention", "index keys are not contiguous with the sequence");
  std::vector<float> k(static_cast<size_t>(groups * K));
  be.linear_bf16(latent.data(), groups, w.idx_wk.view(), k.data());
  norm_rows(be, k.data(), groups, K, w.idx_k_norm, c.norm_eps);
  be.rope(rope, rope_tail(k.data(), groups, K, c.rope_head_dim, 1, first_group * r.compress_ratio, r.compress_ratio),
          false);
  for (int64_t g = 0; g < groups; ++g) {
    uint8_t* row = src.index_keys.append();
    be.pack_kv_rows(KvFormat::IndexKey, &k[g * K], 1, K, &row);
  }
}

// Main compressed rows: RoPE at the group's first position, FP4 with E4M3 scales per 16, appended to
// the owner's paged rows.
void publish_rows(const Backend& be, const ModelConfig& c, const LayerRole& r, const RopeTable& rope,
                  std::vector<float>& latent, int64_t first_group, int64_t groups, KvSourceState& src) {
  const int64_t D = c.head_dim;
  if (src.compressed.size() != first_group) fail("attention", "compressed rows are not contiguous with the sequence");
  be.rope(rope,
          rope_tail(latent.data(), groups, D, c.rope_head_dim, 1, first_group * r.compress_ratio, r.compress_ratio),
          false);
  for (int64_t g = 0; g < groups; ++g) {
    uint8_t* row = src.compressed.append();
    be.pack_kv_rows(KvFormat::MainKv, &latent[g * D], 1, D, &row);
  }
}

// Below these, a call's queries stay on the calling thread: scores a selection pass reads, and
// multiply-adds of attention (rows × heads × head_dim, per query, summed over the call's queries).
constexpr int64_t kSplitSelectionScores = int64_t{1} << 14;
constexpr int64_t kSplitAttentionWork = int64_t{1} << 18;

// The indexer of an index source (model-spec §3.3 step 4): scores the visible compressed rows with
// fp4 query heads against the shared index keys, in bf16 as the reference does, and keeps the top-k.
// A candidate user scores only its queries' candidate pools. Its query and head-weight rows come
// projected (project_attention).
void run_indexer(const Backend& be, const ModelConfig& c, const LayerRole& r, const RopeTable& rope,
                 const SequenceRows& rows, const PagedRows& keys, ForwardContext& ctx) {
  const int64_t s = ctx.count, nh = c.index_n_heads, K = c.index_head_dim;
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
  // teacher forcing: another implementation's choices replace ours once ours are captured
  const int64_t k = std::min<int64_t>(c.index_topk, n_keys);
  const std::vector<int32_t>* teacher_selection = nullptr;
  const std::vector<uint8_t>* teacher_pool = nullptr;
  if (ctx.teacher != nullptr) {
    if (auto it = ctx.teacher->selections.find(r.layer); it != ctx.teacher->selections.end()) {
      if (static_cast<int64_t>(it->second.size()) != s * k) fail("teacher forcing", "a selection is not [count, k]");
      teacher_selection = &it->second;
    }
    if (auto it = ctx.teacher->pools.find(r.layer); r.candidate_source && it != ctx.teacher->pools.end()) {
      if (static_cast<int64_t>(it->second.size()) != s * n_keys) fail("teacher forcing", "a pool is not [count, keys]");
      teacher_pool = &it->second;
    }
  }
  if (keys.size() < n_keys) fail("indexer", "index keys read before they were written");
  if (r.candidate_user && !ctx.candidates_written)
    fail("indexer", "candidate pool read before the candidate source wrote it");

  // copies: RoPE and quantization below change them
  std::vector<float> q(rows.index_q, rows.index_q + s * nh * K);
  std::vector<float> wts(rows.index_weights, rows.index_weights + s * nh);
  const float head_scale =
      static_cast<float>(1.0 / std::sqrt(static_cast<double>(K)) / std::sqrt(static_cast<double>(nh)));
  be.rope(rope, rope_tail(q.data(), s * nh, K, c.rope_head_dim, nh, ctx.start), false);
  be.quantize_index_queries(q.data(), wts.data(), s, nh, K, head_scale);

  // Scores are computed for a block of queries at a time: the [queries × keys] matrix never exceeds
  // kScoreBudget however long the context.
  constexpr int64_t kScoreBudget = int64_t{4} << 20;
  const int64_t block = std::clamp<int64_t>(kScoreBudget / (n_keys * 4), 1, s);
  std::vector<float> scores(static_cast<size_t>(block * n_keys));
  // The ops read the packed rows in place, and each query's keys up to the ones it can see (a row is
  // visible once its group is complete); the rest score -inf.
  std::vector<const uint8_t*> key_rows(static_cast<size_t>(n_keys));
  keys.row_addresses(n_keys, key_rows.data());
  std::vector<int64_t> visible_keys(static_cast<size_t>(s));
  for (int64_t i = 0; i < s; ++i) visible_keys[i] = (ctx.start + i + 1) / ratio;
  const int64_t bs = c.candidate_block_size;
  for (int64_t q0 = 0; q0 < s; q0 += block) {
    const int64_t q1 = std::min(s, q0 + block);
    if (r.candidate_user) {  // level two: only rows inside the pool's blocks are scored
      be.index_scores_in_pool(&q[q0 * nh * K], &wts[q0 * nh], q1 - q0, nh, K, key_rows.data(), n_keys,
                              &visible_keys[q0], &ctx.candidates[q0], bs, scores.data());
    } else {
      be.index_scores(&q[q0 * nh * K], &wts[q0 * nh], q1 - q0, nh, K, key_rows.data(), n_keys, &visible_keys[q0],
                      scores.data());
    }
    // Each query's selection reads its own row of scores and writes its own entries, so the queries
    // are split over the pool (one pass over the history per query: at long contexts the selection
    // costs as much as the scoring), unless too few scores pay for waking it. The ops inside run on
    // their worker's thread.
    const bool split = q1 - q0 > 1 && (q1 - q0) * n_keys >= kSplitSelectionScores;
    be.exec().run(split, q1 - q0, 1, [&](int64_t b, int64_t e, Scratch&) {
      for (int64_t i = q0 + b; i < q0 + e; ++i) {
        const float* score = &scores[(i - q0) * n_keys];
        if (r.candidate_source) {
          ctx.candidates[i] =
              be.select_candidate_blocks(score, n_keys, visible_keys[i], c.candidate_topk_blocks, bs, ctx.topk_ties);
        }
        std::vector<int32_t> top = be.topk_ascending(score, n_keys, k, ctx.topk_ties);
        for (int32_t& t : top) {
          if (t >= visible_keys[i]) t = -1;
        }
        selected[i] = std::move(top);
      }
    });
    for (int64_t i = q0; i < q1; ++i) {
      const float* score = &scores[(i - q0) * n_keys];
      const int64_t visible = visible_keys[i];
      if (cap) {
        std::copy(score, score + n_keys, cap->scores.begin() + i * n_keys);
        std::copy(selected[i].begin(), selected[i].end(), cap->selected.begin() + i * cap->k);
        if (r.candidate_source) {
          for (int32_t b : ctx.candidates[i])
            for (int64_t t = b * bs; t < std::min(n_keys, (b + 1) * bs); ++t) cap->candidates[i * n_keys + t] = 1;
        }
      }
      if (teacher_selection != nullptr) {
        const int32_t* forced = &(*teacher_selection)[static_cast<size_t>(i * k)];
        selected[i].assign(forced, forced + k);
        for (const int32_t t : selected[i])
          if (t < -1 || t >= visible) fail("teacher forcing", "a selection names a row its query cannot see");
      }
      if (teacher_pool != nullptr) {
        ctx.candidates[i].clear();
        for (int64_t b = 0; b * bs < n_keys; ++b) {
          if ((*teacher_pool)[static_cast<size_t>(i * n_keys + b * bs)] != 0)
            ctx.candidates[i].push_back(static_cast<int32_t>(b));
        }
      }
    }
  }
}

// This call's window KV rows: RoPE at each position, then FP8 over all lanes (RoPE tail included),
// packed as the ring stores them; attention reads them packed.
std::vector<uint8_t> pack_window_rows(const Backend& be, const ModelConfig& c, const RopeTable& rope,
                                      const ForwardContext& ctx, float* kv) {
  const int64_t D = c.head_dim, wrb = window_row_bytes(D);
  std::vector<uint8_t> packed(static_cast<size_t>(ctx.count * wrb));
  be.rope(rope, rope_tail(kv, ctx.count, D, c.rope_head_dim, 1, ctx.start), false);
  std::vector<uint8_t*> out(static_cast<size_t>(ctx.count));
  for (int64_t i = 0; i < ctx.count; ++i) out[i] = &packed[i * wrb];
  be.pack_kv_rows(KvFormat::Window, kv, ctx.count, D, out.data());
  return packed;
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
void compressed_kv_and_selection(const Backend& be, const ModelConfig& c, const LayerRole& r, const AttentionWeights& w,
                                 const RopeTable& rope, const SequenceRows& rows, ForwardContext& ctx,
                                 SequenceParts& st) {
  if (r.kv_source) {
    KvSourceState& src = *st.sources[r.layer];
    int64_t first = 0, groups = 0;
    std::vector<float> latent;
    if (!ctx.replay) {
      latent = compress(be, c, r, w, rows, ctx, src, first, groups);
    } else if (src.compressed.size() < (ctx.start + ctx.count) / r.compress_ratio) {
      fail("attention", "replay over positions whose compressed rows are not cached");
    }
    if (groups > 0) {
      publish_index_keys(be, c, r, w, rope, latent, first, groups, src);
      st.last_index_keys_layer = r.layer;
    }
    if (r.index_source) {
      // Owner keys by default; the shipped decode path scores whatever was published last when this
      // source emitted nothing in this call (model-spec §7 item 11).
      int keys_layer = r.layer;
      if (ctx.index_keys == IndexKeysMode::Reference && groups == 0 && st.last_index_keys_layer >= 0) {
        keys_layer = st.last_index_keys_layer;
      }
      run_indexer(be, c, r, rope, rows, st.sources[keys_layer]->index_keys, ctx);
    }
    if (groups > 0) publish_rows(be, c, r, rope, latent, first, groups, src);
  } else if (r.index_source) {
    int keys_layer = ctx.index_keys == IndexKeysMode::Reference && st.last_index_keys_layer >= 0
                         ? st.last_index_keys_layer
                         : r.index_keys_from;
    run_indexer(be, c, r, rope, rows, st.sources[keys_layer]->index_keys, ctx);
  }
  if (!ctx.topk_written[r.topk_from]) fail("attention", "top-k read before its index source wrote it");
}

// Step 5: each query attends over [window rows, selected compressed rows] in the reference's list
// layout, all read packed; the output's RoPE tail is rotated back at the query's position.
void sparse_attention_per_query(const Backend& be, const ModelConfig& c, const LayerRole& r, const AttentionWeights& w,
                                const RopeTable& rope, const float* q, const std::vector<uint8_t>& packed,
                                const std::vector<uint8_t>& ring, const ForwardContext& ctx, const SequenceParts& st,
                                float* o) {
  const int64_t s = ctx.count, H = c.n_heads, D = c.head_dim, W = c.window_size, wrb = window_row_bytes(D);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const KvSourceState* kv_src = r.compress_ratio > 0 ? st.sources[r.kv_from].get() : nullptr;
  const auto query = [&](int64_t i, std::vector<const uint8_t*>& window, std::vector<const uint8_t*>& compressed) {
    const int64_t pos = ctx.start + i;
    window.clear();
    compressed.clear();
    auto row_at = [&](int64_t p) -> const uint8_t* {
      if (p < 0 || p > pos || p < st.window_from[r.layer]) return nullptr;
      return p >= ctx.start ? &packed[(p - ctx.start) * wrb] : &ring[(p % W) * wrb];
    };
    // The prefill layout for a one-shot prefill (ForwardOptions::prefill_length: also for a prefill's
    // later chunks); the two coincide wherever the window is full.
    const int64_t prompt = ctx.prefill_length >= 0 ? ctx.prefill_length : ctx.start == 0 ? s : -1;
    if (prompt >= 0) {  // prefill layout: ascending from the window start, -1 padding at the end
      const int64_t width = std::min(prompt, W), first = std::max<int64_t>(0, pos - W + 1);
      for (int64_t j = 0; j < width; ++j) window.push_back(row_at(first + j));
    } else {  // decode layout: the whole ring oldest first, unfilled slots (-1) at the start
      for (int64_t j = 0; j < W; ++j) window.push_back(row_at(pos - W + 1 + j));
    }
    if (kv_src) {
      for (const int32_t t : ctx.topk[r.topk_from][i]) {
        if (t >= kv_src->compressed.size()) fail("attention", "compressed row read before it was written");
        compressed.push_back(t < 0 ? nullptr : kv_src->compressed.row(t));
      }
      // A one-shot prefill selects min(top-k, prompt / ratio) rows for every query, the ones its
      // early queries cannot see yet padded (-1) at the end; a later chunk of it has fewer keys and
      // so a narrower selection. The padding adds no row but does widen the last softmax chunk, whose
      // probabilities the reference sums in torch's cascade order over the chunk's whole length, so a
      // chunk pads to the one-shot width (seen at head_dim 512, where more outputs expose the sum's
      // rounding: a 300-token prefill in 1-token chunks differed from one-shot at position 89).
      if (prompt >= 0) {
        const int64_t one_shot_k = std::min<int64_t>(c.index_topk, prompt / r.compress_ratio);
        if (static_cast<int64_t>(compressed.size()) < one_shot_k) compressed.resize(static_cast<size_t>(one_shot_k), nullptr);
      }
    }
    const KvRows list{window.data(), static_cast<int64_t>(window.size()), compressed.data(),
                      static_cast<int64_t>(compressed.size())};
    be.sparse_attention(&q[i * H * D], H, D, list, w.attn_sink.data(), scale, &o[i * H * D]);
    be.rope(rope, rope_tail(&o[i * H * D], H, D, c.rope_head_dim, H, pos), true);
  };
  // A prefill's queries are split over the pool, each query's op on its worker's thread; one query (a
  // decode step), or too little work to pay for waking the pool, runs on the calling thread, where
  // the op may still split its heads. Every output is computed the same either way, so the bits do
  // not depend on the split.
  const int64_t rows_per_query = std::min(W, ctx.start + s) + (kv_src ? c.index_topk : 0);
  const bool split = s > 1 && s * rows_per_query * H * D >= kSplitAttentionWork;
  be.exec().run(split, s, 1, [&](int64_t b, int64_t e, Scratch&) {
    std::vector<const uint8_t*> window, compressed;
    for (int64_t i = b; i < e; ++i) query(i, window, compressed);
  });
}

}  // namespace

AttentionProjection project_attention(const Backend& be, const ModelConfig& c, const LayerRole& r,
                                      const AttentionWeights& w, const float* x, int64_t count, bool replay) {
  AttentionProjection p;
  p.count = count;
  project_queries(be, c, w, x, p);
  project_window_kv(be, c, w, x, p);
  if (runs_compressor(r, replay)) project_compressor_rows(be, c, r, w, x, p);
  if (runs_indexer(r)) project_indexer_rows(be, c, w, x, p);
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

void attention_core(const Backend& be, const ModelConfig& c, const LayerRole& r, const AttentionWeights& w,
                    const RopeTable& rope, const SequenceRows& rows, ForwardContext& ctx, SequenceState& seq, float* o) {
  SequenceParts& st = parts_of(seq);
  be.rope(rope, rope_tail(rows.q, ctx.count * c.n_heads, c.head_dim, c.rope_head_dim, c.n_heads, ctx.start), false);
  const std::vector<uint8_t> packed = pack_window_rows(be, c, rope, ctx, rows.kv);
  std::vector<uint8_t>& ring = st.window[r.layer];
  if (ring.empty()) ring.assign(static_cast<size_t>(c.window_size * window_row_bytes(c.head_dim)), 0);
  if (r.compress_ratio > 0) compressed_kv_and_selection(be, c, r, w, rope, rows, ctx, st);
  sparse_attention_per_query(be, c, r, w, rope, rows.q, packed, ring, ctx, st, o);
  store_window_rows(c, packed, ctx, ring);
}

void output_projection(const Backend& be, const ModelConfig& c, const AttentionWeights& w, const float* o, int64_t s,
                       float* out) {
  // grouped O-LoRA: block-diagonal wo_a (bf16) per group of heads, then wo_b over all groups
  const int64_t H = c.n_heads, D = c.head_dim, G = c.o_groups, R = c.o_lora_rank, Kg = H * D / G;
  std::vector<float> og(static_cast<size_t>(s * G * R)), xg(static_cast<size_t>(s * Kg)),
      yg(static_cast<size_t>(s * R));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < s; ++i) std::copy_n(&o[i * H * D + g * Kg], Kg, &xg[i * Kg]);
    be.linear_bf16(xg.data(), s, w.wo_a.rows(g * R, R), yg.data());
    for (int64_t i = 0; i < s; ++i) std::copy_n(&yg[i * R], R, &og[(i * G + g) * R]);
  }
  be.linear_fp8(og.data(), s, w.wo_b, out);
}

}  // namespace dsv41
