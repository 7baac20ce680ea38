// Snapshot, restore and rollback of a sequence's state (state/sequence_state.h), the only code outside
// the forward pass that edits one: the prefix cache keeps the short-lived state at a block boundary
// (ShortState) and restores global rows (adopt_global_rows, load_global_rows), speculative
// verification keeps what its forward overwrites and puts back what the rejected positions changed
// (VerifyCheckpoint), and bounded replay rewinds a restored sequence to the first position it re-runs
// (rewind_for_replay).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "io/config.h"
#include "state/sequence_state.h"

namespace dsv41 {

// Everything of a sequence but its global rows: the window rings and where they start, the
// compressor tails of the KV sources, the Engram history and the last key publisher.
struct ShortState {
  std::vector<std::vector<uint8_t>> window;              // per layer, packed ring (empty: none)
  std::vector<int64_t> window_from;                      // per layer
  std::vector<std::vector<float>> tail_kv, tail_score;   // per layer (KV sources with ratio > 1)
  std::vector<int64_t> engram_recent;
  int last_index_keys_layer = -1;

  static ShortState of(const SequenceState& state);
  // Puts this back into `state`, whose layers and sources must match the snapshot's.
  void apply_to(SequenceState& state) const;
  size_t bytes() const;
};

// Bytes of the packed global rows a sequence holds (page slack excluded): main KV and index keys.
struct GlobalRowBytes {
  uint64_t main_kv = 0, index_keys = 0;
};
GlobalRowBytes global_row_bytes(const SequenceState& state);

// A fresh sequence's global rows restored from a prefix cache, and its length set to the `tokens`
// they cover. adopt_global_rows takes over page references the caller holds (a RAM-tier block);
// load_global_rows copies packed rows into fresh pages and returns false, leaving the layer empty,
// when `main` or `keys` holds fewer than `rows` whole rows (a file that does not fit this model).
void adopt_global_rows(SequenceState& state, int layer, std::vector<int32_t> main_pages, std::vector<int32_t> key_pages,
                       int64_t rows);
bool load_global_rows(SequenceState& state, int layer, const std::vector<uint8_t>& main, const std::vector<uint8_t>& keys,
                      int64_t rows);
void set_restored_length(SequenceState& state, int64_t tokens);

// Rewinds a sequence whose global rows are restored up to some boundary so that a replay re-runs
// positions [start, boundary): its windows start at `start`, with the given Engram history (of the
// tokens before `start`) and key publisher.
void rewind_for_replay(SequenceState& state, int64_t start, std::vector<int64_t> engram_recent,
                       int last_index_keys_layer);

// What a speculative verification forward of `positions` tokens at state.length overwrites and a
// rollback must restore: the window slots of those positions, the compressor tails, the key publisher.
class VerifyCheckpoint {
 public:
  VerifyCheckpoint() = default;
  VerifyCheckpoint(const ModelConfig& config, const SequenceState& state, int64_t positions);

  // After the verify forward ran (state.length == first + positions): keeps positions [first, kept)
  // and makes the state exactly what running only those would have left. `compressor_kv` and
  // `compressor_score` are the forward's recorded projected rows per layer (ForwardResult), from which
  // the compressor tails of the kept positions are rebuilt; `engram_recent` is the Engram history
  // after the kept tokens (Model::engram_history).
  void roll_back(SequenceState& state, int64_t kept, const std::vector<std::vector<float>>& compressor_kv,
                 const std::vector<std::vector<float>>& compressor_score, std::vector<int64_t> engram_recent) const;
  int64_t first() const { return first_; }
  int64_t positions() const { return positions_; }

 private:
  const ModelConfig* config_ = nullptr;
  int64_t first_ = 0, positions_ = 0;
  std::vector<std::vector<uint8_t>> slots_;  // per layer: the window slots of the verified positions
  std::vector<std::vector<float>> tail_kv_, tail_score_;
  int last_index_keys_layer_ = -1;
};

}  // namespace dsv41
