// What an expert-parallel job of N ranks costs for a config, from the config alone (`dsv41 plan
// --ranks N`): each rank's weight bytes, the bytes the ranks exchange per decode token, and the
// persistent state a prefill/decode handover of a long prompt carries. The exchange counts the wire
// format of parallel/ (bf16 rows, int64 ids, FP8 Engram rows with their scales) under uniform routing
// (a token's k experts drawn without replacement from the E of a layer, each rank holding E/N).
#pragma once

#include <cstdint>
#include <vector>

#include "io/config.h"

namespace dsv41 {

struct ParallelProjection {
  int ranks = 1;
  uint64_t dense_bytes = 0, routed_bytes = 0, engram_bytes = 0;  // the whole checkpoint's
  uint64_t rank0_bytes = 0;  // rank 0: every dense weight, its share of the experts and Engram rows
  uint64_t other_rank_bytes = 0;  // every other rank: its share of the experts and Engram rows
  // One decode token (a batch of one), summed over the backbone's MoE and Engram layers: the token's
  // rows to the owners of its experts and their outputs back, the routing and the per-step commands,
  // the Engram ids and rows held elsewhere.
  double exchanged_bytes_per_decode_token = 0;
  int64_t prompt_tokens = 0;
  // What a prefill server hands a decode server for the prompt: the global rows of every token and
  // the fixed per-sequence state (compressor tails, Engram history, the drafter's rings), with the
  // window rings (exact) or without them (the decode side replays the last window).
  uint64_t handover_exact_bytes = 0, handover_replay_bytes = 0;
};

ParallelProjection project_parallel(const ModelConfig& config, int ranks, int64_t prompt_tokens);

}  // namespace dsv41
