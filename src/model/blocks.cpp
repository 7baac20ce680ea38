#include "model/blocks.h"

#include <algorithm>

#include "model/mhc.h"
#include "model/moe.h"

namespace dsv41 {

void Stream::keep(const std::vector<int64_t>& kept, int64_t hc, int64_t dim) {
  const int64_t width = hc * dim;
  for (size_t j = 0; j < kept.size(); ++j) {
    const int64_t from = kept[j], to = static_cast<int64_t>(j);
    if (from == to) continue;
    std::copy_n(&X[from * width], width, &X[to * width]);
    std::copy_n(&pre[from * hc], hc, &pre[to * hc]);
    if (!span.empty()) span[to] = span[from];
  }
  rows = static_cast<int64_t>(kept.size());
  if (!span.empty()) span.resize(static_cast<size_t>(rows));
  X.resize(static_cast<size_t>(rows * width));
  pre.resize(static_cast<size_t>(rows * hc));
}

Stream embed_tokens(const Backend& be, const ModelConfig& c, const Bf16Tensor& table, const int32_t* tokens,
                    int64_t count) {
  const int64_t hc = c.hc_mult;
  Stream x;
  x.rows = count;
  x.X.resize(static_cast<size_t>(count * hc * c.dim));
  be.embed(table.data(), c.dim, tokens, count, hc, x.X.data());
  x.pre.assign(static_cast<size_t>(count * hc), 0.0f);
  for (int64_t i = 0; i < count; ++i) x.pre[i * hc] = 1.0f;
  return x;
}

void run_block(const Backend& be, const ModelConfig& c, const LayerRole& r, const LayerWeights& L, Stream& x,
               bool replay, const AttentionCore& core, const ExpertCache* experts, ExpertPeers* peers) {
  const int64_t n = x.rows, d = c.dim;
  const float eps = static_cast<float>(c.norm_eps);
  // attention sublayer: post/comb from this stream, the input collapsed with the previous sublayer's pre
  Mixes a = hc_mixes(be, c, x.X.data(), n, L.hc_attn_fn, L.hc_attn_scale, L.hc_attn_base);
  std::vector<float> u(static_cast<size_t>(n * d)), y(static_cast<size_t>(n * d));
  hc_pre(be, c, x.X.data(), x.pre.data(), n, u.data());
  be.rms_norm(u.data(), n, d, L.attn_norm.data(), eps, u.data(), true);
  AttentionProjection projected = project_attention(be, c, r, L.attn, u.data(), n, replay);
  std::vector<float> o(static_cast<size_t>(n * c.n_heads * c.head_dim));
  core(projected, o.data());
  output_projection(be, c, L.attn, o.data(), n, y.data());
  // FFN sublayer, one pass: expand the attention's output into the stream (a's post/comb), the FFN's
  // mixes from the new stream, its input collapsed with the attention's pre; its own pre goes to the
  // next block
  Mixes f = hc_step(be, c, x.X.data(), y.data(), a, L.hc_ffn_fn, L.hc_ffn_scale, L.hc_ffn_base, n, u.data());
  be.rms_norm(u.data(), n, d, L.ffn_norm.data(), eps, u.data(), true);
  moe_forward(be, c, r.layer, L.ffn, u.data(), n, x.span.empty() ? nullptr : x.span.data(), y.data(), experts,
              peers);
  hc_post(be, c, x.X.data(), y.data(), f, n);
  x.pre = std::move(f.pre);
}

void run_head(const Backend& be, const ModelConfig& c, const Stream& x, int64_t first, int64_t count,
              const Bf16Tensor& norm, const Bf16Tensor& head, float* logits, std::vector<float>* hidden) {
  const int64_t hc = c.hc_mult, d = c.dim;
  std::vector<float> h(static_cast<size_t>(count * d)), normed(static_cast<size_t>(count * d));
  hc_pre(be, c, &x.X[first * hc * d], &x.pre[first * hc], count, h.data());
  be.rms_norm(h.data(), count, d, norm.data(), static_cast<float>(c.norm_eps), normed.data(), true);
  be.linear_f32(normed.data(), count, head.view(), logits);
  if (hidden != nullptr) *hidden = std::move(h);
}

}  // namespace dsv41
