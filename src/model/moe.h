// The MoE feed-forward (model-spec §3.5): sqrtsoftplus router with a selection-only bias, top-k
// renormalised and scaled, clamped SwiGLU experts (FP4 routed, FP8 shared), routing weight applied
// before w2, routed outputs summed in ascending expert order in fp32, then the shared expert — as
// the backend's route, dispatch, expert and combine ops.
#pragma once

#include <cstdint>

#include "io/config.h"
#include "kernels/backend.h"
#include "model/expert_cache.h"
#include "model/weights.h"

namespace dsv41 {

// The router's settings for `layer` (DSpark blocks have their own expert count).
RouterParams router_params(const ModelConfig& config, int layer);

// x: [count, dim] (ffn_norm output, bf16 values); out: [count, dim] bf16 values. span: [count], 1 at
// an image-span token (its experts are selected with bias_vl), or null for none. `cache`: where the
// routed experts come from when the memory plan streams them (null: the weights' own).
void moe_forward(const Backend& be, const ModelConfig& config, int layer, const MoeWeights& w, const float* x,
                 int64_t count, const uint8_t* span, float* out, const ExpertCache* cache = nullptr);

}  // namespace dsv41
