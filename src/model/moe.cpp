#include "model/moe.h"

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "util/error.h"

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

void run_routed_experts(const Backend& be, const ModelConfig& c, int layer, const MoeWeights& w, const float* x,
                        const MoeDispatch& d, int64_t first, int64_t end, const ExpertCache* cache, float* routed,
                        const std::function<void()>& meanwhile) {
  const int64_t dim = c.dim;
  const float limit = static_cast<float>(c.swiglu_limit);
  std::vector<float> xs;
  const auto run_expert = [&](int64_t e, const ExpertMatrices<Fp4Matrix>& m) {
    const int64_t row0 = d.offsets[static_cast<size_t>(e)], rows = d.offsets[static_cast<size_t>(e + 1)] - row0;
    xs.resize(static_cast<size_t>(rows * dim));
    be.gather_rows(x, dim, &d.token[static_cast<size_t>(row0)], rows, xs.data());
    be.expert_ffn(m, xs.data(), rows, &d.weight[static_cast<size_t>(row0)], limit, &routed[row0 * dim]);
  };
  std::vector<int32_t> used;
  for (int64_t e = first; e < end; ++e) {
    if (d.offsets[static_cast<size_t>(e + 1)] > d.offsets[static_cast<size_t>(e)]) used.push_back(static_cast<int32_t>(e));
  }
  if (cache == nullptr) {
    if (meanwhile) meanwhile();
    for (int32_t e : used) run_expert(e, w.experts[static_cast<size_t>(e)]);
    return;
  }
  // Streamed experts: in groups the cache holds two of, the next group read while this one computes.
  // Each expert writes its own rows, so the order of the groups changes no bit of the combine.
  const size_t group = static_cast<size_t>(std::max<int64_t>(1, cache->group_size(layer)));
  const auto ids_of = [&](size_t g) {
    return std::vector<int32_t>(used.begin() + static_cast<std::ptrdiff_t>(g),
                                used.begin() + static_cast<std::ptrdiff_t>(std::min(used.size(), g + group)));
  };
  ExpertCache::Pending next = cache->request(layer, ids_of(0));
  if (meanwhile) meanwhile();
  if (used.empty()) return;
  for (size_t g = 0; g < used.size(); g += group) {
    const ExpertCache::Lease lease = cache->wait(std::move(next));
    if (g + group < used.size()) next = cache->request(layer, ids_of(g + group));
    for (size_t i = g; i < std::min(used.size(), g + group); ++i) run_expert(used[i], lease[i - g]);
  }
}

void moe_forward(const Backend& be, const ModelConfig& c, int layer, const MoeWeights& w, const float* x, int64_t s,
                 const uint8_t* span, float* out, const ExpertCache* cache, ExpertPeers* peers) {
  const int64_t d = c.dim;
  const RouterParams rp = router_params(c, layer);
  const float limit = static_cast<float>(c.swiglu_limit);
  // route: fp32 router logits, then each token's experts and weights
  std::vector<float> logits(static_cast<size_t>(s * rp.experts));
  be.linear_f32(x, s, w.gate.view(), logits.data());
  std::vector<int32_t> experts(static_cast<size_t>(s * rp.k));
  std::vector<float> weights(static_cast<size_t>(s * rp.k));
  // the selection bias: bias_vl for image-span tokens, bias for text (vision-spec §6.3), one route call
  // per run of tokens of one kind
  for (int64_t t0 = 0; t0 < s;) {
    const bool image = span != nullptr && span[t0] != 0;
    int64_t t1 = t0 + 1;
    while (t1 < s && (span != nullptr && span[t1] != 0) == image) ++t1;
    if (image && w.gate_bias_vl.empty())
      fail("image span", "the checkpoint has no ffn.gate.bias_vl for layer " + std::to_string(layer));
    be.moe_route(&logits[t0 * rp.experts], t1 - t0, rp, image ? w.gate_bias_vl.data() : w.gate_bias.data(),
                 &experts[t0 * rp.k], &weights[t0 * rp.k]);
    t0 = t1;
  }
  // dispatch: each expert's tokens in one batch, experts in ascending order
  const MoeDispatch dispatch = be.moe_dispatch(experts.data(), weights.data(), s, rp.k, rp.experts);
  std::vector<float> routed(static_cast<size_t>(dispatch.entries() * d)), shared(static_cast<size_t>(s * d));
  // The shared expert and the routed experts held here (all of them, or this rank's share while the
  // owners of the others compute theirs). Every expert's rows are the ones a single process computes,
  // in the same batch, so the combine below sums the same bits.
  const auto [first, end] = peers ? peers->share().experts(rp.experts) : std::pair<int64_t, int64_t>{0, rp.experts};
  if (peers) peers->dispatch(layer, x, s, d, experts.data(), weights.data(), rp.k, dispatch);
  try {
    // (the shared expert first, while the first group of streamed experts is read)
    run_routed_experts(be, c, layer, w, x, dispatch, first, end, cache, routed.data(),
                       [&] { be.expert_ffn(w.shared, x, s, nullptr, limit, shared.data()); });
  } catch (...) {
    if (peers) peers->combine(layer, dispatch, d, routed.data());  // the owners wait for it
    throw;
  }
  if (peers) peers->combine(layer, dispatch, d, routed.data());
  // combine: routed outputs in ascending expert order, then the shared expert
  be.moe_combine(dispatch, routed.data(), shared.data(), s, d, out);
}

}  // namespace dsv41
