// The MoE feed-forward (model-spec §3.5): sqrtsoftplus router with a selection-only bias, top-k
// renormalised and scaled, clamped SwiGLU experts (FP4 routed, FP8 shared), routing weight applied
// before w2, routed outputs summed in ascending expert order in fp32, then the shared expert.
#pragma once

#include <cstdint>

#include "io/config.h"
#include "model/weights.h"

namespace dsv41 {

// x: [count, dim] (ffn_norm output, bf16 values); out: [count, dim] bf16 values.
void moe_forward(const ModelConfig& config, int layer, const MoeWeights& w, const float* x, int64_t count, float* out);

}  // namespace dsv41
