// The MoE ops' scalar references (model-spec §3.5): the router's scores and top-k, the grouping of
// tokens by expert, SwiGLU, and the combine in ascending expert order.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/reference.h"
#include "numeric/formats.h"
#include "kernels/torch_math.h"

namespace dsv41::reference {

void moe_route(const float* logits, int64_t s, const RouterParams& p, const float* bias, int32_t* experts,
               float* weights) {
  const int64_t E = p.experts, k = p.k;
  std::vector<float> scores(static_cast<size_t>(E)), biased(static_cast<size_t>(E));
  std::vector<int32_t> order(static_cast<size_t>(E));
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t e = 0; e < E; ++e) {
      const float v = logits[i * E + e] / p.temperature;
      switch (p.score) {
        case ScoreFunction::Softmax:
          scores[e] = v;  // normalised below
          break;
        case ScoreFunction::Sigmoid:
          scores[e] = torch_sigmoid(v);
          break;
        case ScoreFunction::SqrtSoftplus:  // torch's softplus switches to identity above 20
          scores[e] = std::sqrt(torch_softplus(v));
          break;
      }
    }
    if (p.score == ScoreFunction::Softmax) {
      float mx = *std::max_element(scores.begin(), scores.end()), sum = 0;
      for (float& v : scores) sum += (v = torch_exp(v - mx));
      for (float& v : scores) v /= sum;
    }
    // the bias steers selection only; the weights come from the unbiased scores
    for (int64_t e = 0; e < E; ++e) biased[e] = scores[e] + bias[e];
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int32_t a, int32_t b) { return biased[a] > biased[b] || (biased[a] == biased[b] && a < b); });
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += scores[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      float wt = scores[order[j]];
      if (p.norm_topk && k > 1) wt /= sum + 1e-20f;  // this literal, as in training
      experts[i * k + j] = order[j];
      weights[i * k + j] = wt * p.route_scale;
    }
  }
}

MoeDispatch moe_dispatch(const int32_t* experts, const float* weights, int64_t tokens, int64_t k, int64_t n_experts) {
  MoeDispatch d;
  d.offsets.assign(static_cast<size_t>(n_experts + 1), 0);
  for (int64_t e = 0; e < n_experts; ++e) {
    for (int64_t i = 0; i < tokens; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        if (experts[i * k + j] != e) continue;
        d.token.push_back(i);
        d.weight.push_back(weights[i * k + j]);
      }
    }
    d.offsets[static_cast<size_t>(e + 1)] = d.entries();
  }
  return d;
}

void gather_rows(const float* x, int64_t dim, const int64_t* rows, int64_t count, float* out) {
  for (int64_t t = 0; t < count; ++t) std::copy_n(x + rows[t] * dim, dim, out + t * dim);
}

void swiglu(float* g, const float* u, int64_t m, int64_t n, float lim, const float* row_weights) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float gv = g[i * n + j], uv = u[i * n + j];
      if (lim > 0) {
        uv = std::clamp(uv, -lim, lim);
        gv = std::min(gv, lim);
      }
      float h = torch_silu(gv) * uv;
      if (row_weights) h = row_weights[i] * h;
      g[i * n + j] = round_bf16(h);
    }
  }
}

void moe_combine(const MoeDispatch& d, const float* expert_out, const float* shared, int64_t tokens, int64_t dim,
                 float* out) {
  std::vector<float> acc(static_cast<size_t>(tokens * dim), 0.0f);
  for (int64_t t = 0; t < d.entries(); ++t) {  // dispatch order: ascending expert id
    const int64_t row = d.token[static_cast<size_t>(t)];
    for (int64_t j = 0; j < dim; ++j) acc[row * dim + j] += expert_out[t * dim + j];
  }
  for (int64_t i = 0; i < tokens * dim; ++i) out[i] = round_bf16(acc[i] + shared[i]);
}

}  // namespace dsv41::reference
