// Parameter counts from the config and the checkpoint layout (model-spec §4, §6.2).
#pragma once

#include <cstdint>

#include "io/config.h"

namespace dsv41 {

struct ParamCounts {
  int64_t total = 0;           // every parameter in the checkpoint (scales excluded)
  int64_t engram = 0;          // the Engram hash tables
  int64_t dspark = 0;          // the mtp.* drafter blocks (embedding and head are shared, not counted)
  int64_t vision = 0;          // the vision tower (ViT, aligner, span vectors) and every layer's bias_vl
  int64_t active_prefill = 0;  // read per prompt token under CED: layers up to the last KV source
  int64_t active_decode = 0;   // read per generated token: every backbone layer and the head
  int64_t checkpoint_bytes = 0;  // bytes of all tensors, scales included
};

// Active counts take top-k of the routed experts, the gathered Engram rows (not whole tables) and,
// for decode, the LM head; the embedding lookup (one row), the drafter and the vision tower (which
// runs once per image, not per token) are left out.
ParamCounts count_params(const ModelConfig& config);

// FLOPs of a prefill of `prompt_tokens` beyond the weights' (2 per active weight per row, above): the
// work that grows with the context. Per query and layer: the indexer's scores, 2·index_n_heads·
// index_head_dim per scored compressed row (every visible row; a candidate user only its pool), and
// the attention, 4·n_heads·head_dim per attended row (QK and PV over the shared latent: the window's
// rows plus min(top-k, visible) compressed ones). In tail mode the layers from late_layer_start on
// run for the last `window` queries only. The drafter is left out.
double context_flops(const ModelConfig& config, int64_t prompt_tokens, bool tail);

}  // namespace dsv41
