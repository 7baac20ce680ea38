#include "model/dspark.h"

#include <algorithm>
#include <cmath>

#include "model/blocks.h"
#include "numeric/row_codecs.h"
#include "state/sequence_access.h"
#include "util/error.h"

namespace dsv41 {

namespace {

// The rope lanes of `rows` rows of `width`, `per_position` consecutive rows per position from `first`.
RotaryRows rope_tail(float* x, int64_t rows, int64_t width, int64_t rope_dim, int64_t per_position, int64_t first) {
  return {x + width - rope_dim, rows, width, per_position, first, 1};
}

// main_x = main_norm(main_proj(taps)): the target context every DSpark block projects into its ring.
std::vector<float> main_x(const Model& m, const float* taps, int64_t count) {
  const ModelConfig& c = m.config();
  const Backend& be = m.backend();
  std::vector<float> x(static_cast<size_t>(count * c.dim));
  be.linear_fp8(taps, count, m.weights().dspark.main_proj, x.data());
  be.rms_norm(x.data(), count, c.dim, m.weights().dspark.main_norm.data(), static_cast<float>(c.norm_eps),
              x.data(), true);
  return x;
}

// One DSpark block's attention over the draft (model-spec §3.8), from the block's projected rows:
// queries and keys of the draft rows at positions p+1.., the list = the ring's valid slots in slot
// order, then every draft row (bidirectional within the block), the same for each query.
void draft_attention(const Model& m, int layer, AttentionProjection& projected, int64_t p,
                     const std::vector<uint8_t>& ring, int64_t ring_from, float* o) {
  const ModelConfig& c = m.config();
  const Backend& be = m.backend();
  const AttentionWeights& w = m.weights().layers[layer].attn;
  const RopeTable& rope = m.rope(layer);
  const int64_t B = projected.count, H = c.n_heads, D = c.head_dim, rd = c.rope_head_dim, W = c.window_size;
  const int64_t wrb = window_row_bytes(D);
  float* q = projected.q.data();
  float* kv = projected.kv.data();
  be.rope(rope, rope_tail(q, B * H, D, rd, H, p + 1), false);
  be.rope(rope, rope_tail(kv, B, D, rd, 1, p + 1), false);
  std::vector<uint8_t> packed(static_cast<size_t>(B * wrb));  // FP8, as the ring rows are
  std::vector<const uint8_t*> rows;
  std::vector<uint8_t*> draft_rows;
  for (int64_t i = 0; i < B; ++i) draft_rows.push_back(&packed[i * wrb]);
  be.pack_kv_rows(KvFormat::Window, kv, B, D, draft_rows.data());
  const int64_t valid = std::min(W, p + 1);
  for (int64_t z = 0; z < valid; ++z) {
    const int64_t pos = p - ((p - z) % W);  // the newest position held in slot z
    if (pos < ring_from) continue;          // never observed (the sequence's start came from a cache)
    rows.push_back(&ring[z * wrb]);
  }
  rows.insert(rows.end(), draft_rows.begin(), draft_rows.end());
  const KvRows list{rows.data(), static_cast<int64_t>(rows.size()), nullptr, 0};
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  for (int64_t i = 0; i < B; ++i) {
    be.sparse_attention(&q[i * H * D], H, D, list, w.attn_sink.data(), scale, &o[i * H * D]);
    be.rope(rope, rope_tail(&o[i * H * D], H, D, rd, H, p + 1 + i), true);
  }
}

}  // namespace

Drafter::Drafter(const Model& model) : model_(model) {
  if (!model.config().has_dspark()) fail("speculative", "this model has no DSpark blocks");
}

void Drafter::observe(SequenceState& seq, const std::vector<float>& taps, int64_t first_row, int64_t start,
                      int64_t count) const {
  SequenceParts& st = parts_of(seq);
  const ModelConfig& c = model_.config();
  const Backend& be = model_.backend();
  if (count <= 0) return;
  const int64_t n_taps = static_cast<int64_t>(c.dspark_target_layer_ids.size()), D = c.head_dim, W = c.window_size;
  if (static_cast<int64_t>(taps.size()) < (first_row + count) * n_taps * c.dim)
    fail("speculative", "missing target taps");
  std::vector<float> x = main_x(model_, &taps[first_row * n_taps * c.dim], count);
  // a gap (a prefix restored from the cache, a tail-mode prompt) leaves older slots without rows
  if (start != st.dspark_observed) {
    for (int layer = c.n_layers; layer < c.total_layers(); ++layer) st.window_from[layer] = start;
  }
  st.dspark_observed = start + count;
  const int64_t wrb = window_row_bytes(D);
  const int64_t first = std::max<int64_t>(0, count - W), n = count - first;  // only the last W matter
  std::vector<float> kv(static_cast<size_t>(count * D));
  std::vector<uint8_t*> slots(static_cast<size_t>(n));
  for (int layer = c.n_layers; layer < c.total_layers(); ++layer) {
    const AttentionWeights& w = model_.weights().layers[layer].attn;
    be.linear_fp8(x.data(), count, w.wkv, kv.data());
    be.rms_norm(kv.data(), count, D, w.kv_norm.data(), static_cast<float>(c.norm_eps), kv.data(), true);
    std::vector<uint8_t>& ring = st.window[layer];
    if (ring.empty()) ring.assign(static_cast<size_t>(W * wrb), 0);
    be.rope(model_.rope(layer), rope_tail(&kv[first * D], n, D, c.rope_head_dim, 1, start + first), false);
    for (int64_t i = 0; i < n; ++i) slots[i] = &ring[((start + first + i) % W) * wrb];
    be.pack_kv_rows(KvFormat::Window, &kv[first * D], n, D, slots.data());
  }
}

Draft Drafter::draft(const SequenceState& seq, int32_t next, TokenPicker& picker) const {
  const SequenceParts& st = parts_of(seq);
  const ModelConfig& c = model_.config();
  const Backend& be = model_.backend();
  const ModelWeights& W = model_.weights();
  const int64_t B = c.dspark_block_size, d = c.dim, V = c.vocab_size, p = st.length - 1;
  if (p < 0) fail("speculative", "drafting needs at least one processed token");
  if (st.dspark_observed != st.length) fail("speculative", "the drafter has not observed every target position");
  // the block input: [next, noise × (B-1)]. Drafts are text (vision-spec §6.3): the stream carries no
  // span mask, so the blocks route with their text bias and their bias_vl is never read; image
  // positions reach the drafter only through the taps its windows were seeded from.
  std::vector<int32_t> tokens(static_cast<size_t>(B), static_cast<int32_t>(c.dspark_noise_token_id));
  tokens[0] = next;
  Stream x = embed_tokens(be, c, W.embed, tokens.data(), B);
  for (int layer = c.n_layers; layer < c.total_layers(); ++layer) {
    if (st.window[layer].empty()) fail("speculative", "the drafter's ring is empty (observe the prompt first)");
    run_block(be, c, model_.roles()[layer], W.layers[layer], x, false, [&](AttentionProjection& projected, float* o) {
      draft_attention(model_, layer, projected, p, st.window[layer], st.window_from[layer], o);
    }, model_.expert_cache(), model_.expert_peers());
  }
  // head: collapse with the last block's pre, the stage's own norm, the backbone's fp32 head
  Draft out;
  out.logits.resize(static_cast<size_t>(B * V));
  std::vector<float> h;
  run_head(be, c, x, 0, B, W.dspark.norm, W.head, out.logits.data(), &h);
  // sequentially: the Markov bias of the previous token, then the drafted token
  const int64_t R = c.dspark_markov_rank;
  std::vector<float> e(static_cast<size_t>(R)), bias(static_cast<size_t>(V)), conf_in(static_cast<size_t>(d + R));
  int32_t prev = next;
  for (int64_t i = 0; i < B; ++i) {
    be.embed(W.dspark.markov_embed.data(), R, &prev, 1, 1, e.data());
    be.linear_f32(e.data(), 1, W.dspark.markov_head.view(), bias.data());
    float* row = &out.logits[i * V];
    be.add(row, bias.data(), V);
    prev = picker.sample(row, V);
    out.tokens.push_back(prev);
    std::copy_n(&h[i * d], d, conf_in.begin());
    std::copy(e.begin(), e.end(), conf_in.begin() + d);
    float conf = 0;
    be.linear_f32(conf_in.data(), 1, W.dspark.confidence.view(), &conf);
    out.confidence.push_back(conf);
  }
  return out;
}

}  // namespace dsv41
