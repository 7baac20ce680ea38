#include "model/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/kernels.h"
#include "numeric/formats.h"

namespace dsv41 {

namespace {

struct Route {
  std::vector<int32_t> experts;  // chosen experts per token, k each, in selection order
  std::vector<float> weights;
};

Route route(const ModelConfig& c, int layer, const MoeWeights& w, const float* x, int64_t s) {
  const int64_t E = c.routed_experts(layer), k = c.activated_experts(layer);
  std::vector<float> logits(static_cast<size_t>(s * E));
  linear_f32(x, s, w.gate.view(), logits.data());
  Route r;
  r.experts.resize(static_cast<size_t>(s * k));
  r.weights.resize(static_cast<size_t>(s * k));
  std::vector<float> scores(static_cast<size_t>(E)), biased(static_cast<size_t>(E));
  std::vector<int32_t> order(static_cast<size_t>(E));
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t e = 0; e < E; ++e) {
      float v = logits[i * E + e] / static_cast<float>(c.gate_temp);
      if (c.score_func == "softmax") {
        scores[e] = v;  // normalised below
      } else if (c.score_func == "sigmoid") {
        scores[e] = 1.0f / (1.0f + std::exp(-v));
      } else {  // sqrt(softplus), torch's softplus switching to identity above 20
        scores[e] = std::sqrt(v > 20.0f ? v : std::log1p(std::exp(v)));
      }
    }
    if (c.score_func == "softmax") {
      float mx = *std::max_element(scores.begin(), scores.end()), sum = 0;
      for (float& v : scores) sum += (v = std::exp(v - mx));
      for (float& v : scores) v /= sum;
    }
    // the bias steers selection only; the weights come from the unbiased scores
    for (int64_t e = 0; e < E; ++e) biased[e] = scores[e] + w.gate_bias[e];
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int32_t a, int32_t b) { return biased[a] > biased[b] || (biased[a] == biased[b] && a < b); });
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += scores[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      float wt = scores[order[j]];
      if (c.norm_topk_prob && k > 1) wt /= sum + 1e-20f;  // this literal, as in training
      r.experts[i * k + j] = order[j];
      r.weights[i * k + j] = wt * static_cast<float>(c.route_scale);
    }
  }
  return r;
}

// One SwiGLU expert on `m` rows: w1/w3 outputs rounded to bf16 then widened, clamps, silu·up, the
// routing weight (if any) multiplied in, then w2 of the bf16-rounded product.
template <typename Matrix, typename Linear>
void expert(const ModelConfig& c, const Matrix& w1, const Matrix& w2, const Matrix& w3, Linear linear,
            const float* x, int64_t m, const float* weights, float* y) {
  const int64_t inter = c.moe_inter_dim;
  std::vector<float> g(static_cast<size_t>(m * inter)), u(static_cast<size_t>(m * inter));
  linear(x, m, w1, g.data());
  linear(x, m, w3, u.data());
  const float lim = static_cast<float>(c.swiglu_limit);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < inter; ++j) {
      float gv = g[i * inter + j], uv = u[i * inter + j];
      if (lim > 0) {
        uv = std::clamp(uv, -lim, lim);
        gv = std::min(gv, lim);
      }
      float h = gv / (1.0f + std::exp(-gv)) * uv;
      if (weights) h = weights[i] * h;
      g[i * inter + j] = round_bf16(h);
    }
  }
  linear(g.data(), m, w2, y);
}

}  // namespace

void moe_forward(const ModelConfig& c, int layer, const MoeWeights& w, const float* x, int64_t s, float* out) {
  const int64_t d = c.dim, E = c.routed_experts(layer), k = c.activated_experts(layer);
  Route r = route(c, layer, w, x, s);
  std::vector<float> acc(static_cast<size_t>(s * d), 0.0f);
  std::vector<float> xs, ws, ys;
  std::vector<int64_t> rows;
  for (int64_t e = 0; e < E; ++e) {  // ascending expert id, each expert's tokens in one batch
    rows.clear();
    ws.clear();
    for (int64_t i = 0; i < s; ++i)
      for (int64_t j = 0; j < k; ++j)
        if (r.experts[i * k + j] == e) {
          rows.push_back(i);
          ws.push_back(r.weights[i * k + j]);
        }
    if (rows.empty()) continue;
    const int64_t m = static_cast<int64_t>(rows.size());
    xs.resize(static_cast<size_t>(m * d));
    ys.resize(static_cast<size_t>(m * d));
    for (int64_t t = 0; t < m; ++t) std::copy_n(x + rows[t] * d, d, &xs[t * d]);
    const ExpertWeights& ex = w.experts[e];
    expert(c, ex.w1, ex.w2, ex.w3, linear_fp4, xs.data(), m, ws.data(), ys.data());
    for (int64_t t = 0; t < m; ++t)
      for (int64_t j = 0; j < d; ++j) acc[rows[t] * d + j] += ys[t * d + j];
  }
  std::vector<float> shared(static_cast<size_t>(s * d));
  expert(c, w.shared_w1, w.shared_w2, w.shared_w3, linear_fp8, x, s, nullptr, shared.data());
  for (int64_t i = 0; i < s * d; ++i) out[i] = round_bf16(acc[i] + shared[i]);
}

}  // namespace dsv41
