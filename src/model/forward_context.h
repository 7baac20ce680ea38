// What the layers of one forward call hand down to later layers of the same call (the reference's
// "shared attention runtime", made explicit and per call): each index source's top-k per query, the
// candidate pool per query, and which KV sources emitted rows in this call.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "io/config.h"
#include "io/layer_roles.h"

namespace dsv41 {

// What an index source computed, kept for tests and debugging (ForwardOptions::capture_index).
struct IndexCapture {
  int64_t n_keys = 0;             // compressed rows scored per query
  int64_t k = 0;                  // selections per query
  std::vector<float> scores;      // [count, n_keys]: as fed to top-k (-inf: not visible / not in the pool)
  std::vector<int32_t> selected;  // [count, k]: ascending, -1 = none
  std::vector<uint8_t> candidates;  // [count, n_keys]: the pool (candidate source only)
};

// Teacher forcing (ForwardOptions::teacher), for checking each block against another
// implementation's per-block results (tests/golden): every block then runs on that implementation's
// input and choices, so what still differs is the block's own arithmetic.
struct TeacherForcing {
  // [n_layers, count, hc, dim]: before every block L > 0 the call's stream is replaced by entry L - 1
  // (block 0 runs on the embedding). The `pre` handed on, the KV and index keys are this forward's.
  std::vector<float> streams;
  // By index-source layer, [count, k] (k = min(index_topk, compressed rows), -1 = none): the rows
  // attended over instead of the layer's own top-k, which is still computed and captured.
  std::map<int, std::vector<int32_t>> selections;
  // By candidate-source layer, [count, compressed rows], 1 inside the pool: the pool handed to the
  // candidate users instead of the layer's own.
  std::map<int, std::vector<uint8_t>> pools;
};

struct ForwardContext {
  int64_t start = 0;  // position of the first token of this call
  int64_t count = 0;  // tokens in this call
  int64_t prefill_length = -1;  // ForwardOptions::prefill_length (-1 for a tail call's late layers)
  IndexKeysMode index_keys = IndexKeysMode::Owner;
  TopkTies topk_ties = TopkTies::LowerIndexFirst;
  bool replay = false;  // global rows are read-only: KV sources do not compress or publish
  std::vector<std::vector<std::vector<int32_t>>> topk;  // [layer][query]: compressed rows, -1 = none
  std::vector<std::vector<int32_t>> candidates;         // [query]: the pool's block ids, ascending
  std::vector<bool> topk_written;                       // [layer]: published in this call
  bool candidates_written = false;
  bool capture_index = false;
  std::vector<IndexCapture> index_captures;  // [layer], filled when capture_index
  const TeacherForcing* teacher = nullptr;
  // Speculative verification: the projected rows every ratio>1 compressor received in this call, so
  // a rollback can rebuild the compressor tails of the kept positions exactly.
  bool record_compressor_rows = false;
  std::vector<std::vector<float>> compressor_kv, compressor_score;  // [layer][count × head_dim]
};

}  // namespace dsv41
