// Per-sequence state of the forward pass, stored as the state graph says (state/state_graph.h): the
// global rows of each KV source as packed rows in shared, reference-counted pages (so sequences with a
// common prefix share them), the windows as packed FP8 rings, and the small per-sequence remainder.
//
// A SequenceState is opaque: the runtime, the server and the tools hold one, ask its length and the
// pages that hold its global rows, and hand it to the model and to state/. Its contents are written
// only by the forward pass (src/model) and by state/ (snapshot, restore, rollback, cache sections),
// through state/sequence_access.h, which no other layer may include (cmake/check_layers.cmake).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "state/paged_rows.h"
#include "state/state_pools.h"

namespace dsv41 {

// What a KV source layer owns.
struct KvSourceState {
  KvSourceState(PagePool& main_pool, PagePool& key_pool, int64_t main_row_bytes, int64_t key_row_bytes)
      : compressed(main_pool, static_cast<size_t>(main_row_bytes)), index_keys(key_pool, static_cast<size_t>(key_row_bytes)) {}
  PagedRows compressed;          // RoPE'd latents, FP4 with E4M3 scales per 16 (main_kv format)
  PagedRows index_keys;          // RoPE'd keys, FP4 with E8M0 scales per 32 (index_key format)
  std::vector<float> tail_kv;    // ratio × head_dim, fp32: projected rows of the group still filling
  std::vector<float> tail_score; // ratio × head_dim, fp32: their gate scores
};

// The contents of a sequence's state.
struct SequenceParts {
  int64_t length = 0;                          // tokens processed so far (the next token's position)
  std::vector<std::vector<uint8_t>> window;    // per layer: window × window_row_bytes ring, slot = position % window
  std::vector<int64_t> window_from;            // per layer: first position whose window row exists (tail
                                               // mode and replay leave earlier rows out)
  std::vector<std::unique_ptr<KvSourceState>> sources;  // per layer; only KV sources have one
  std::vector<int64_t> engram_recent;          // compressed ids of the last max_ngram-1 tokens, oldest first
  int last_index_keys_layer = -1;              // reference index-key mode: last layer that published keys
  int64_t dspark_observed = 0;                 // the drafter's rings hold target positions up to this one
};

// The pages that hold one block of a KV source's global rows (kTokensPerPage positions).
struct GlobalPages {
  int32_t main_kv = -1, index_keys = -1;
};

class SequenceState {
 public:
  SequenceState() = default;
  SequenceState(SequenceState&&) = default;
  SequenceState& operator=(SequenceState&&) = default;

  // Tokens processed so far: the next token's position.
  int64_t length() const { return parts_.length; }
  // Block `block` of KV source layer `layer`; an Error naming the layer or block when it has none.
  GlobalPages global_pages(int layer, int64_t block) const;

 private:
  friend class SequenceAccess;
  SequenceParts parts_;
};

// "" when the two states hold the same contents, else the first part that differs: for tests and
// consistency checks. All: rows, rings, tails, histories, counters; GlobalRows: the KV sources'
// compressed rows and index keys alone (what tail mode and replay must leave exact).
enum class StateScope { All, GlobalRows };
std::string first_difference(const SequenceState& a, const SequenceState& b, StateScope scope = StateScope::All);

}  // namespace dsv41
