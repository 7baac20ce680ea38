// Per-sequence state of the forward pass, in plain containers. Each piece has one owner layer (see
// state/state_graph.h for who reads what); the KV state graph replaces these containers with paged,
// packed storage without changing what they hold.
#pragma once

#include <cstdint>
#include <vector>

namespace dsv41 {

// What a KV source layer owns.
struct KvSourceState {
  int64_t rows = 0;                // compressed rows written so far (= tokens seen / ratio)
  std::vector<float> compressed;   // rows × head_dim: RoPE'd latents, FP4 (E4M3/16) quantize-dequantized
  std::vector<float> index_keys;   // rows × index_head_dim: FP4 (E8M0/32) quantize-dequantized, RoPE'd
  std::vector<float> tail_kv;      // ratio × head_dim, fp32: projected rows of the group still filling
  std::vector<float> tail_score;   // ratio × head_dim, fp32: their gate scores
};

struct SequenceState {
  int64_t length = 0;                        // tokens processed so far (the next token's position)
  std::vector<std::vector<float>> window;    // per layer: window × head_dim ring, slot = position % window
  std::vector<int64_t> window_from;          // per layer: first position whose window row exists (tail mode
                                             // skips the prompt's head in late layers; their windows start later)
  std::vector<KvSourceState> sources;        // per layer; used only by KV sources
  std::vector<int64_t> engram_recent;        // compressed ids of the last max_ngram-1 tokens, oldest first
  int last_index_keys_layer = -1;            // reference index-key mode: last layer that published keys
};

}  // namespace dsv41
