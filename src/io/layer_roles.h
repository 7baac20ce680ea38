// Layer roles and who feeds whom, derived from the config's source lists alone (model-spec §3.4):
// nothing here knows a layer number. The reference wires this through a "last writer wins"
// runtime; here the same wiring is explicit, so every reader can name the layer it reads from.
#pragma once

#include <string>
#include <vector>

#include "io/config.h"

namespace dsv41 {

enum class AttnRole {
  Swa,      // ratio 0: sliding window only
  Full,     // a KV source: owns compressed main KV and index keys, runs its own indexer
  Reindex,  // an index source that is not a KV source: own top-k over shared keys
  Reuse,    // compressed attention reusing the preceding source's KV and top-k
};
const char* role_name(AttnRole role);  // "swa", "full", "reindex", "reuse"

// Which index keys a KV source's indexer scores at a step where that source emitted no row.
enum class IndexKeysMode {
  Owner,      // every KV source scores its own keys at every step (dsv41's default; decode = prefill)
  Reference,  // as shipped: a source that emitted no row this call scores the last published keys
};

struct LayerRole {
  int layer = 0;          // 0.. n_layers-1 backbone, n_layers.. DSpark blocks
  bool dspark = false;    // an mtp.* block
  int compress_ratio = 0;
  AttnRole role = AttnRole::Swa;
  bool kv_source = false;
  bool index_source = false;
  bool candidate_source = false;
  bool candidate_user = false;  // an index source after the candidate source: scores inside the pool
  bool engram = false;          // Engram runs on the stream before this block
  bool dspark_tap = false;      // its input stream (mean over copies) feeds the drafter
  bool encoder = false;         // CED: must run on every prompt token (at or before the last KV source)
  int kv_from = -1;             // the KV source whose compressed rows this layer attends over
  int index_keys_from = -1;     // the KV source whose index keys this layer's indexer scores
  int topk_from = -1;           // the index source whose top-k this layer uses (itself if it is one)
  int candidates_from = -1;     // the candidate source whose pool this layer's indexer is limited to
  double rope_theta = 0;        // compress_rope_theta for ratio > 0, rope_theta otherwise
  bool yarn = false;            // YaRN only on layers with ratio > 0
};

std::vector<LayerRole> derive_layer_roles(const ModelConfig& config);

// First backbone layer that only needs the prompt's tail in prefill (CED): one past the last KV
// source. Layers from here on run on the last `window` prompt rows in tail mode.
int late_layer_start(const ModelConfig& config);

}  // namespace dsv41
