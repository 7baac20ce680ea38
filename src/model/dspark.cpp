#include "model/dspark.h"

#include <algorithm>
#include <cmath>

#include "model/attention.h"
#include "model/mhc.h"
#include "model/moe.h"
#include "numeric/formats.h"
#include "numeric/row_codecs.h"
#include "util/error.h"

namespace dsv41 {

namespace {

void norm_rows(const float* x, int64_t count, int64_t d, const Bf16Tensor& w, double eps, float* y) {
  for (int64_t i = 0; i < count; ++i) rms_norm(x + i * d, d, w.bits.data(), static_cast<float>(eps), y + i * d, true);
}

// main_x = main_norm(main_proj(taps)): the target context every DSpark block projects into its ring.
std::vector<float> main_x(const Model& m, const float* taps, int64_t count) {
  const ModelConfig& c = m.config();
  std::vector<float> x(static_cast<size_t>(count * c.dim));
  linear_fp8(taps, count, m.weights().dspark.main_proj, x.data());
  norm_rows(x.data(), count, c.dim, m.weights().dspark.main_norm, c.norm_eps, x.data());
  return x;
}

// One DSpark block's attention over the draft (model-spec §3.8): queries and keys of the draft rows at
// positions p+1.., the list = the ring's valid slots in slot order, then every draft row
// (bidirectional within the block), the same for each query.
void draft_attention(const Model& m, int layer, const float* x, int64_t B, int64_t p, const std::vector<uint8_t>& ring,
                     int64_t ring_from, float* out) {
  const ModelConfig& c = m.config();
  const AttentionWeights& w = m.weights().layers[layer].attn;
  const RopeTable& rope = m.rope(layer);
  const int64_t H = c.n_heads, D = c.head_dim, rd = c.rope_head_dim, W = c.window_size, Q = c.q_lora_rank;
  const float eps = static_cast<float>(c.norm_eps);
  std::vector<float> qr(static_cast<size_t>(B * Q)), q(static_cast<size_t>(B * H * D)), kv(static_cast<size_t>(B * D));
  linear_fp8(x, B, w.wq_a, qr.data());
  norm_rows(qr.data(), B, Q, w.q_norm, c.norm_eps, qr.data());
  linear_fp8(qr.data(), B, w.wq_b, q.data());
  linear_fp8(x, B, w.wkv, kv.data());
  norm_rows(kv.data(), B, D, w.kv_norm, c.norm_eps, kv.data());
  std::vector<uint8_t> packed(static_cast<size_t>(window_row_bytes(D)));
  for (int64_t i = 0; i < B; ++i) {
    for (int64_t h = 0; h < H; ++h) rope.apply(&q[(i * H + h) * D + D - rd], p + 1 + i, false);
    rope.apply(&kv[i * D + D - rd], p + 1 + i, false);
    pack_window_row(&kv[i * D], D, packed.data());  // FP8 QDQ, as the ring rows are
    unpack_window_row(packed.data(), D, &kv[i * D]);
  }
  const int64_t valid = std::min(W, p + 1), wrb = window_row_bytes(D);
  std::vector<float> ring_rows(static_cast<size_t>(valid * D));
  std::vector<const float*> rows;
  for (int64_t z = 0; z < valid; ++z) {
    const int64_t pos = p - ((p - z) % W);  // the newest position held in slot z
    if (pos < ring_from) continue;          // never observed (the sequence's start came from a cache)
    unpack_window_row(&ring[z * wrb], D, &ring_rows[z * D]);
    rows.push_back(&ring_rows[z * D]);
  }
  for (int64_t i = 0; i < B; ++i) rows.push_back(&kv[i * D]);
  std::vector<float> o(static_cast<size_t>(B * H * D));
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  for (int64_t i = 0; i < B; ++i) {
    sparse_attention(&q[i * H * D], H, D, rows, w.attn_sink.data(), scale, &o[i * H * D]);
    for (int64_t h = 0; h < H; ++h) rope.apply(&o[(i * H + h) * D + D - rd], p + 1 + i, true);
  }
  output_projection(c, w, o.data(), B, out);
  (void)eps;
}

}  // namespace

Drafter::Drafter(const Model& model) : model_(model) {
  if (!model.config().has_dspark()) fail("speculative", "this model has no DSpark blocks");
}

void Drafter::observe(SequenceState& st, const std::vector<float>& taps, int64_t first_row, int64_t start,
                      int64_t count) const {
  const ModelConfig& c = model_.config();
  if (count <= 0) return;
  const int64_t n_taps = static_cast<int64_t>(c.dspark_target_layer_ids.size()), D = c.head_dim, W = c.window_size;
  if (static_cast<int64_t>(taps.size()) < (first_row + count) * n_taps * c.dim) fail("speculative", "missing target taps");
  std::vector<float> x = main_x(model_, &taps[first_row * n_taps * c.dim], count);
  // a gap (a prefix restored from the cache, a tail-mode prompt) leaves older slots without rows
  if (start != st.dspark_observed) {
    for (int layer = c.n_layers; layer < c.total_layers(); ++layer) st.window_from[layer] = start;
  }
  st.dspark_observed = start + count;
  const int64_t wrb = window_row_bytes(D);
  std::vector<float> kv(static_cast<size_t>(count * D));
  for (int layer = c.n_layers; layer < c.total_layers(); ++layer) {
    const AttentionWeights& w = model_.weights().layers[layer].attn;
    linear_fp8(x.data(), count, w.wkv, kv.data());
    norm_rows(kv.data(), count, D, w.kv_norm, c.norm_eps, kv.data());
    std::vector<uint8_t>& ring = st.window[layer];
    if (ring.empty()) ring.assign(static_cast<size_t>(W * wrb), 0);
    for (int64_t i = std::max<int64_t>(0, count - W); i < count; ++i) {  // only the last W matter
      model_.rope(layer).apply(&kv[i * D + D - c.rope_head_dim], start + i, false);
      pack_window_row(&kv[i * D], D, &ring[((start + i) % W) * wrb]);
    }
  }
}

Draft Drafter::draft(const SequenceState& st, int32_t next, TokenPicker& picker) const {
  const ModelConfig& c = model_.config();
  const ModelWeights& W = model_.weights();
  const int64_t B = c.dspark_block_size, d = c.dim, hc = c.hc_mult, V = c.vocab_size, p = st.length - 1;
  if (p < 0) fail("speculative", "drafting needs at least one processed token");
  if (st.dspark_observed != st.length) fail("speculative", "the drafter has not observed every target position");
  // the block input: [next, noise × (B-1)] embedded into hc copies, identity pre
  std::vector<float> X(static_cast<size_t>(B * hc * d)), pre(static_cast<size_t>(B * hc), 0.0f);
  for (int64_t i = 0; i < B; ++i) {
    const int32_t tok = i == 0 ? next : static_cast<int32_t>(c.dspark_noise_token_id);
    for (int64_t cp = 0; cp < hc; ++cp)
      for (int64_t j = 0; j < d; ++j) X[(i * hc + cp) * d + j] = bf16_to_f32(W.embed.bits[static_cast<size_t>(tok) * d + j]);
    pre[i * hc] = 1.0f;
  }
  std::vector<float> u(static_cast<size_t>(B * d)), y(static_cast<size_t>(B * d));
  for (int layer = c.n_layers; layer < c.total_layers(); ++layer) {
    const LayerWeights& L = W.layers[layer];
    Mixes a = hc_mixes(c, X.data(), B, L.hc_attn_fn, L.hc_attn_scale, L.hc_attn_base);
    hc_pre(c, X.data(), pre.data(), B, u.data());
    norm_rows(u.data(), B, d, L.attn_norm, c.norm_eps, u.data());
    if (st.window[layer].empty()) fail("speculative", "the drafter's ring is empty (observe the prompt first)");
    draft_attention(model_, layer, u.data(), B, p, st.window[layer], st.window_from[layer], y.data());
    // expand the attention's output, the FFN's mixes and its input: one pass over the stream
    Mixes f = hc_step(c, X.data(), y.data(), a, L.hc_ffn_fn, L.hc_ffn_scale, L.hc_ffn_base, B, u.data());
    norm_rows(u.data(), B, d, L.ffn_norm, c.norm_eps, u.data());
    moe_forward(c, layer, L.ffn, u.data(), B, y.data());
    hc_post(c, X.data(), y.data(), f, B);
    pre = f.pre;
  }
  // head: collapse with the last block's pre, the stage's own norm, the backbone's fp32 head
  std::vector<float> h(static_cast<size_t>(B * d)), hn(static_cast<size_t>(B * d));
  hc_pre(c, X.data(), pre.data(), B, h.data());
  norm_rows(h.data(), B, d, W.dspark.norm, c.norm_eps, hn.data());
  Draft out;
  out.logits.resize(static_cast<size_t>(B * V));
  linear_f32(hn.data(), B, W.head.view(), out.logits.data());
  // sequentially: the Markov bias of the previous token, then the drafted token
  const int64_t R = c.dspark_markov_rank;
  std::vector<float> e(static_cast<size_t>(R)), bias(static_cast<size_t>(V)), conf_in(static_cast<size_t>(d + R));
  int32_t prev = next;
  for (int64_t i = 0; i < B; ++i) {
    for (int64_t r = 0; r < R; ++r) e[r] = bf16_to_f32(W.dspark.markov_embed.bits[static_cast<size_t>(prev) * R + r]);
    linear_f32(e.data(), 1, W.dspark.markov_head.view(), bias.data());
    float* row = &out.logits[i * V];
    for (int64_t v = 0; v < V; ++v) row[v] += bias[v];
    prev = picker.sample(row, V);
    out.tokens.push_back(prev);
    std::copy_n(&h[i * d], d, conf_in.begin());
    std::copy(e.begin(), e.end(), conf_in.begin() + d);
    float conf = 0;
    linear_f32(conf_in.data(), 1, W.dspark.confidence.view(), &conf);
    out.confidence.push_back(conf);
  }
  return out;
}

}  // namespace dsv41
