// Parameter counts from the config and the checkpoint layout (model-spec §4, §6.2).
#pragma once

#include <cstdint>

#include "io/config.h"

namespace dsv41 {

struct ParamCounts {
  int64_t total = 0;           // every parameter in the checkpoint (scales excluded)
  int64_t engram = 0;          // the Engram hash tables
  int64_t dspark = 0;          // the mtp.* drafter blocks (embedding and head are shared, not counted)
  int64_t active_prefill = 0;  // read per prompt token under CED: layers up to the last KV source
  int64_t active_decode = 0;   // read per generated token: every backbone layer and the head
  int64_t checkpoint_bytes = 0;  // bytes of all tensors, scales included
};

// Active counts take top-k of the routed experts, the gathered Engram rows (not whole tables) and,
// for decode, the LM head; the embedding lookup (one row) and the drafter are left out.
ParamCounts count_params(const ModelConfig& config);

}  // namespace dsv41
