// CSA2 attention for one layer over one call's tokens (model-spec §3.3): q-LoRA, the layer's own
// sliding-window KV, and for compressed layers the shared compressed KV with the rows the indexer
// selects. A KV source also runs its compressor and publishes rows and index keys; an index source
// publishes its top-k; everyone else reads what their source published (LayerRole says which).
//
// It runs in three stages so that a step over several sequences reads each projection's weights
// once: project_attention (everything that depends only on a token's own row) and
// output_projection run once over the rows of all sequences; attention_core (everything that depends
// on the sequence's position and state) runs per sequence on its rows. Every piece of math is an op
// of the backend.
#pragma once

#include <cstdint>
#include <vector>

#include "io/config.h"
#include "kernels/backend.h"
#include "model/forward_context.h"
#include "io/layer_roles.h"
#include "state/sequence_state.h"
#include "model/weights.h"

namespace dsv41 {

// The rows of a call's tokens (of one or several sequences, one after the other) after the linear
// projections and their norms, before anything position- or state-dependent (RoPE, quantization,
// the compressor's pooling). Vectors a layer's role does not need stay empty.
struct AttentionProjection {
  int64_t count = 0;
  std::vector<float> qr;                // [count, q_lora_rank] after q_norm: input of wq_b and the indexer
  std::vector<float> q;                 // [count, n_heads·head_dim]
  std::vector<float> kv;                // [count, head_dim] after kv_norm
  std::vector<float> compressor_kv;     // KV sources, not in replay: [count, head_dim] (ratio 1: bf16)
  std::vector<float> compressor_score;  // ratio > 1 KV sources, not in replay: [count, head_dim] gate scores
  std::vector<float> index_q;           // index sources: [count, index_n_heads·index_head_dim]
  std::vector<float> index_weights;     // index sources: [count, index_n_heads]
};

// One sequence's rows inside an AttentionProjection (null where the projection has none). The core
// rotates q and kv in place.
struct SequenceRows {
  float* q = nullptr;
  float* kv = nullptr;
  const float* compressor_kv = nullptr;
  const float* compressor_score = nullptr;
  const float* index_q = nullptr;
  const float* index_weights = nullptr;
};

// x: [count, dim] (attn_norm outputs, bf16 values). `replay` leaves out the compressor's rows (a
// replayed call does not compress).
AttentionProjection project_attention(const Backend& be, const ModelConfig& config, const LayerRole& role,
                                      const AttentionWeights& w, const float* x, int64_t count, bool replay);

// The rows from `first` on (a sequence's share of a projection over several sequences).
SequenceRows sequence_rows(const ModelConfig& config, AttentionProjection& p, int64_t first);

// The state-dependent part for one sequence's ctx.count rows at positions ctx.start..: RoPE, the
// window ring, the compressor and what a source publishes, the indexer, sparse attention.
// o: [count, n_heads·head_dim], the attention output before output_projection.
void attention_core(const Backend& be, const ModelConfig& config, const LayerRole& role, const AttentionWeights& w,
                    const RopeTable& rope, const SequenceRows& rows, ForwardContext& ctx, SequenceState& state,
                    float* o);

// The attention output [count, heads·head_dim] (bf16 values) through the grouped O-LoRA: out[count, dim].
void output_projection(const Backend& be, const ModelConfig& config, const AttentionWeights& w, const float* o,
                       int64_t count, float* out);

}  // namespace dsv41
