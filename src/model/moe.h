// The MoE feed-forward (model-spec §3.5): sqrtsoftplus router with a selection-only bias, top-k
// renormalised and scaled, clamped SwiGLU experts (FP4 routed, FP8 shared), routing weight applied
// before w2, routed outputs summed in ascending expert order in fp32, then the shared expert — as
// the backend's route, dispatch, expert and combine ops.
#pragma once

#include <cstdint>
#include <functional>

#include "io/config.h"
#include "kernels/backend.h"
#include "model/expert_cache.h"
#include "model/expert_peers.h"
#include "model/weights.h"

namespace dsv41 {

// The router's settings for `layer` (DSpark blocks have their own expert count).
RouterParams router_params(const ModelConfig& config, int layer);

// x: [count, dim] (ffn_norm output, bf16 values); out: [count, dim] bf16 values. span: [count], 1 at
// an image-span token (its experts are selected with bias_vl), or null for none. `cache`: where the
// routed experts come from when the memory plan streams them (null: the weights' own). `peers`: the
// ranks holding the routed experts outside this rank's share (null: this rank holds them all).
void moe_forward(const Backend& be, const ModelConfig& config, int layer, const MoeWeights& w, const float* x,
                 int64_t count, const uint8_t* span, float* out, const ExpertCache* cache = nullptr,
                 ExpertPeers* peers = nullptr);

// The routed experts [first, end) of `layer` over their entries of `d`: each expert's rows gathered
// from x [tokens, dim], its SwiGLU with the routing weights, into routed [d.entries(), dim] at the
// expert's entries (the others are left as they are). What moe_forward runs for the experts a rank
// holds; an expert-parallel rank runs it for its share on the rows the leading rank sent it.
// `meanwhile` (if given) runs once, while the first streamed experts are read.
void run_routed_experts(const Backend& be, const ModelConfig& config, int layer, const MoeWeights& w, const float* x,
                        const MoeDispatch& d, int64_t first, int64_t end, const ExpertCache* cache, float* routed,
                        const std::function<void()>& meanwhile = nullptr);

}  // namespace dsv41
