// The state-ownership graph (model-spec §3.4, §5, §6.1): which layer owns each kind of per-sequence
// state, which layers read it, how it is stored and how long it has to live. V4.1's cache is not
// "layer i owns KV[i]": four layers own the global rows that all compressed layers read, every layer
// owns a short window, and some state is recomputed every step.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/config.h"
#include "io/layer_roles.h"

namespace dsv41 {

enum class Lifetime {
  Global,  // grows with the sequence; the only state a prefix cache must keep (persisted)
  Window,  // a fixed ring of recent positions; rebuilt by bounded replay of the last `window` tokens
  Step,    // recomputed by its owner in every forward, read by later layers of the same forward
  Tokens,  // a pure function of the token ids; recomputed from them
};
const char* lifetime_name(Lifetime lifetime);

struct StateOwner {
  int layer = -1;                 // -1: owned by the token stream itself
  int compress_ratio = 0;         // tokens per row for per-token classes
  std::vector<int> consumers;     // layers that read this owner's state (including itself)
  int64_t row_bytes = 0;          // one stored row, packed
  double bytes_per_token = 0;     // row_bytes / compress_ratio, for per-token classes
  int64_t bytes_per_sequence = 0; // fixed-size classes
};

struct StateClass {
  std::string name;     // main_kv, index_keys, window, compressor_tail, topk, candidates, engram_history, dspark_window
  std::string format;   // element format as stored
  Lifetime lifetime = Lifetime::Global;
  bool per_token = false;  // grows with the sequence (bytes_per_token) or fixed (bytes_per_sequence)
  std::vector<StateOwner> owners;

  std::vector<int> owner_layers() const;
  std::vector<int> consumer_layers() const;
  double bytes_per_token() const;
  int64_t bytes_per_sequence() const;
};

struct StateGraph {
  std::vector<StateClass> classes;
  double global_bytes_per_token() const;    // sum over Global classes
  int64_t fixed_bytes_per_sequence() const; // sum over fixed-size classes kept between steps
  const StateClass* find(const std::string& name) const;
};

StateGraph build_state_graph(const ModelConfig& config, const std::vector<LayerRole>& roles);

}  // namespace dsv41
