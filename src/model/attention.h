// CSA2 attention for one layer over one call's tokens (model-spec §3.3): q-LoRA, the layer's own
// sliding-window KV, and for compressed layers the shared compressed KV with the rows the indexer
// selects. A KV source also runs its compressor and publishes rows and index keys; an index source
// publishes its top-k; everyone else reads what their source published (LayerRole says which).
#pragma once

#include <cstdint>

#include "io/config.h"
#include "kernels/kernels.h"
#include "model/forward_context.h"
#include "model/layer_roles.h"
#include "model/sequence_state.h"
#include "model/weights.h"

namespace dsv41 {

// x: [count, dim] (attn_norm output, bf16 values) at positions ctx.start.. ; out: [count, dim].
void attention_forward(const ModelConfig& config, const LayerRole& role, const AttentionWeights& w,
                       const RopeTable& rope, const float* x, ForwardContext& ctx, SequenceState& state,
                       float* out);

// The attention output [count, heads·head_dim] (bf16 values) through the grouped O-LoRA: out[count, dim].
void output_projection(const ModelConfig& config, const AttentionWeights& w, const float* o, int64_t count, float* out);

}  // namespace dsv41
