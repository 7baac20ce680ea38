#include "model/moe.h"

#include <vector>

namespace dsv41 {

RouterParams router_params(const ModelConfig& c, int layer) {
  RouterParams p;
  p.experts = c.routed_experts(layer);
  p.k = c.activated_experts(layer);
  p.score = c.score_func == "softmax"   ? ScoreFunction::Softmax
            : c.score_func == "sigmoid" ? ScoreFunction::Sigmoid
                                        : ScoreFunction::SqrtSoftplus;
  p.temperature = static_cast<float>(c.gate_temp);
  p.norm_topk = c.norm_topk_prob;
  p.route_scale = static_cast<float>(c.route_scale);
  return p;
}

void moe_forward(const Backend& be, const ModelConfig& c, int layer, const MoeWeights& w, const float* x, int64_t s,
                 float* out) {
  const int64_t d = c.dim;
  const RouterParams rp = router_params(c, layer);
  const float limit = static_cast<float>(c.swiglu_limit);
  // route: fp32 router logits, then each token's experts and weights
  std::vector<float> logits(static_cast<size_t>(s * rp.experts));
  be.linear_f32(x, s, w.gate.view(), logits.data());
  std::vector<int32_t> experts(static_cast<size_t>(s * rp.k));
  std::vector<float> weights(static_cast<size_t>(s * rp.k));
  be.moe_route(logits.data(), s, rp, w.gate_bias.data(), experts.data(), weights.data());
  // dispatch: each expert's tokens in one batch, experts in ascending order
  const MoeDispatch dispatch = be.moe_dispatch(experts.data(), weights.data(), s, rp.k, rp.experts);
  std::vector<float> routed(static_cast<size_t>(dispatch.entries() * d)), xs;
  for (int64_t e = 0; e < rp.experts; ++e) {
    const int64_t first = dispatch.offsets[static_cast<size_t>(e)],
                  m = dispatch.offsets[static_cast<size_t>(e + 1)] - first;
    if (m == 0) continue;
    xs.resize(static_cast<size_t>(m * d));
    be.gather_rows(x, d, &dispatch.token[static_cast<size_t>(first)], m, xs.data());
    be.expert_ffn(w.experts[static_cast<size_t>(e)], xs.data(), m, &dispatch.weight[static_cast<size_t>(first)], limit,
                  &routed[static_cast<size_t>(first * d)]);
  }
  std::vector<float> shared(static_cast<size_t>(s * d));
  be.expert_ffn(w.shared, x, s, nullptr, limit, shared.data());
  // combine: routed outputs in ascending expert order, then the shared expert
  be.moe_combine(dispatch, routed.data(), shared.data(), s, d, out);
}

}  // namespace dsv41
