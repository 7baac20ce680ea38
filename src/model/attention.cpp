#include "model/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "numeric/formats.h"
#include "numeric/quant.h"
#include "state/row_formats.h"
#include "util/error.h"

namespace dsv41 {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void rms_rows(float* x, int64_t rows, int64_t n, const Bf16Tensor& w, float eps) {
  for (int64_t i = 0; i < rows; ++i) rms_norm(x + i * n, n, w.bits.data(), eps, x + i * n, true);
}

// The compressor of a KV source (model-spec §3.3 step 3): pools `ratio` consecutive tokens into one
// latent row. Returns the latents of the groups this call completes (before RoPE) and their group
// indices; an incomplete group waits in the state's tail.
std::vector<float> compress(const ModelConfig& c, const LayerRole& r, const AttentionWeights& w, const float* x,
                            ForwardContext& ctx, KvSourceState& src, int64_t& first_group, int64_t& groups) {
  const int64_t D = c.head_dim, d = c.dim, s = ctx.count, ratio = r.compress_ratio;
  first_group = ctx.start / ratio;
  groups = (ctx.start + s) / ratio - first_group;
  std::vector<float> latent(static_cast<size_t>(groups * D));
  if (ratio == 1) {  // one token per group: a plain bf16 projection, no gate, no fp32
    linear_bf16(x, s, w.comp_wkv.view(), latent.data());
  } else {
    // ratio > 1 runs in fp32 with a softmax gate over the group's tokens, per channel
    std::vector<float> kv(static_cast<size_t>(s * D)), score(static_cast<size_t>(s * D));
    linear_f32(x, s, w.comp_wkv.view(), kv.data());
    linear_f32(x, s, w.comp_wgate.view(), score.data());
    if (ctx.record_compressor_rows) {
      ctx.compressor_kv[r.layer] = kv;
      ctx.compressor_score[r.layer] = score;
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
    (void)d;
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
void run_indexer(const ModelConfig& c, const LayerRole& r, const AttentionWeights& w, const RopeTable& rope,
                 const float* x, const float* qr, const PagedRows& keys, ForwardContext& ctx) {
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

  std::vector<float> q(static_cast<size_t>(s * nh * K)), wts(static_cast<size_t>(s * nh));
  linear_fp8(qr, s, w.idx_wq_b, q.data());
  linear_bf16(x, s, w.idx_weights_proj.view(), wts.data());
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
  std::vector<float> scores(static_cast<size_t>(block * n_keys)), key(static_cast<size_t>(K));
  std::vector<float> score(static_cast<size_t>(n_keys));
  std::vector<uint8_t> in_pool;
  const int64_t bs = c.candidate_block_size;
  for (int64_t i = 0; i < s; ++i) {
    const int64_t visible = (ctx.start + i + 1) / ratio;  // a row is visible once its group is complete
    if (i % block == 0) {
      const int64_t q0 = i, q1 = std::min(s, i + block);
      for (int64_t t = 0; t < n_keys; ++t) {
        unpack_index_key_row(keys.row(t), K, key.data());
        for (int64_t qi = q0; qi < q1; ++qi) {
          if (t >= (ctx.start + qi + 1) / ratio) {
            scores[(qi - q0) * n_keys + t] = kNegInf;
            continue;
          }
          float sum = 0;  // bf16 ops, fp32 accumulation: dot -> bf16, relu, × weight -> bf16, head sum -> bf16
          for (int64_t h = 0; h < nh; ++h) {
            const float* qh = &q[(qi * nh + h) * K];
            float dot = 0;
            for (int64_t e = 0; e < K; ++e) dot += qh[e] * key[e];
            dot = std::max(round_bf16(dot), 0.0f);
            sum += round_bf16(dot * wts[qi * nh + h]);
          }
          scores[(qi - q0) * n_keys + t] = round_bf16(sum);
        }
      }
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

}  // namespace

void attention_forward(const ModelConfig& c, const LayerRole& r, const AttentionWeights& w, const RopeTable& rope,
                       const float* x, ForwardContext& ctx, SequenceState& st, float* out) {
  const int64_t s = ctx.count, d = c.dim, H = c.n_heads, D = c.head_dim, rd = c.rope_head_dim;
  const int64_t W = c.window_size, Q = c.q_lora_rank;
  const float eps = static_cast<float>(c.norm_eps);

  // 1. query: q-LoRA, RoPE on the last rd channels of each head
  std::vector<float> qr(static_cast<size_t>(s * Q)), q(static_cast<size_t>(s * H * D));
  linear_fp8(x, s, w.wq_a, qr.data());
  rms_rows(qr.data(), s, Q, w.q_norm, eps);
  linear_fp8(qr.data(), s, w.wq_b, q.data());
  for (int64_t i = 0; i < s; ++i)
    for (int64_t h = 0; h < H; ++h) rope.apply(&q[(i * H + h) * D + D - rd], ctx.start + i, false);

  // 2. this layer's window KV: one row per token, FP8 over all lanes (RoPE tail included); the rows
  // are packed as the ring stores them and used here as the values they decode to
  const int64_t wrb = window_row_bytes(D);
  std::vector<float> kv(static_cast<size_t>(s * D));
  std::vector<uint8_t> kv_packed(static_cast<size_t>(s * wrb));
  linear_fp8(x, s, w.wkv, kv.data());
  rms_rows(kv.data(), s, D, w.kv_norm, eps);
  for (int64_t i = 0; i < s; ++i) {
    rope.apply(&kv[i * D + D - rd], ctx.start + i, false);
    pack_window_row(&kv[i * D], D, &kv_packed[i * wrb]);
    unpack_window_row(&kv_packed[i * wrb], D, &kv[i * D]);
  }
  std::vector<uint8_t>& ring = st.window[r.layer];
  if (ring.empty()) ring.assign(static_cast<size_t>(W * wrb), 0);
  // the ring's rows from earlier calls, decoded once for all of this call's queries
  std::vector<float> ring_rows;
  if (ctx.start > 0) {
    ring_rows.resize(static_cast<size_t>(W * D));
    for (int64_t z = 0; z < W; ++z) unpack_window_row(&ring[z * wrb], D, &ring_rows[z * D]);
  }

  // 3-4. compressed KV and the selection of its rows
  if (r.compress_ratio > 0) {
    if (r.kv_source) {
      KvSourceState& src = *st.sources[r.layer];
      int64_t first = 0, groups = 0;
      std::vector<float> latent;
      if (!ctx.replay) {
        latent = compress(c, r, w, x, ctx, src, first, groups);
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
        run_indexer(c, r, w, rope, x, qr.data(), st.sources[keys_layer]->index_keys, ctx);
      }
      if (groups > 0) publish_rows(c, r, rope, latent, first, groups, src);
    } else if (r.index_source) {
      int keys_layer = ctx.index_keys == IndexKeysMode::Reference && st.last_index_keys_layer >= 0
                           ? st.last_index_keys_layer
                           : r.index_keys_from;
      run_indexer(c, r, w, rope, x, qr.data(), st.sources[keys_layer]->index_keys, ctx);
    }
    if (!ctx.topk_written[r.topk_from]) fail("attention", "top-k read before its index source wrote it");
  }

  // 5. sparse attention over [window rows, selected compressed rows], in the reference's list layout
  std::vector<float> o(static_cast<size_t>(s * H * D));
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
  for (int64_t i = std::max<int64_t>(0, s - W); i < s; ++i) {
    std::copy_n(&kv_packed[i * wrb], wrb, &ring[((ctx.start + i) % W) * wrb]);
  }

  output_projection(c, w, o.data(), s, out);
  (void)d;
}

void output_projection(const ModelConfig& c, const AttentionWeights& w, const float* o, int64_t s, float* out) {
  // grouped O-LoRA: block-diagonal wo_a (bf16) per group of heads, then wo_b over all groups
  const int64_t H = c.n_heads, D = c.head_dim, G = c.o_groups, R = c.o_lora_rank, Kg = H * D / G;
  std::vector<float> og(static_cast<size_t>(s * G * R)), xg(static_cast<size_t>(s * Kg)), yg(static_cast<size_t>(s * R));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < s; ++i) std::copy_n(&o[i * H * D + g * Kg], Kg, &xg[i * Kg]);
    linear_bf16(xg.data(), s, Bf16Matrix{&w.wo_a.bits[static_cast<size_t>(g * R * Kg)], R, Kg}, yg.data());
    for (int64_t i = 0; i < s; ++i) std::copy_n(&yg[i * R], R, &og[(i * G + g) * R]);
  }
  linear_fp8(og.data(), s, w.wo_b, out);
}

}  // namespace dsv41
