// The V4.1 forward pass (model-spec §3): embedding into hc_mult stream copies, Engram before its
// layers, blocks of mHC-wrapped attention and MoE with the single-pass handoff of `pre`, the final
// collapse, norm and fp32 head — model/blocks.h's skeleton, with every piece of math an op of the
// model's backend. A pure function of (weights, tokens, sequence state): everything that must
// outlive a call is in SequenceState.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/engram_store.h"
#include "io/layer_roles.h"
#include "kernels/backend.h"
#include "model/engram.h"
#include "model/forward_context.h"
#include "state/sequence_state.h"
#include "model/expert_cache.h"
#include "model/expert_peers.h"
#include "model/memory_plan.h"
#include "model/weights.h"

namespace dsv41 {

// Image spans in a call (vision-spec §6): which of the call's positions are span positions (START,
// IMAGE, NEW_LINE, END alike), and their embedding rows as the span assembly wrote them (bf16 values,
// dim each, in position order). They replace the token embeddings there, select experts with the
// gate's bias_vl, and are DEAD for Engram (gate 0, and a wall for every later n-gram, kept in the
// sequence's Engram history). A replay of span positions takes their rows again (runtime/prompt_images.h).
struct SpanEmbeddings {
  std::vector<uint8_t> mask;  // [count]: 1 at a span position
  std::vector<float> rows;    // [span positions, dim]
};

struct ForwardOptions {
  IndexKeysMode index_keys = IndexKeysMode::Owner;
  TopkTies topk_ties = TopkTies::LowerIndexFirst;  // kernels/op_types.h
  bool all_logits = false;      // logits for every token of the call, not only the last
  bool capture_blocks = false;  // keep the residual stream after every backbone block
  // Tail mode (CED, model-spec §4): layers from late_layer_start on run only on positions >= tail_start
  // (the prompt's last rows), and their windows start there. -1: every layer on every token (exact).
  // A call that ends before tail_start produces no logits.
  int64_t tail_start = -1;
  // The length, from position 0, of the prompt this call is a part of (a chunk of a prefill, the
  // rest of a prompt after a cache restore): its positions before the window fills then get the list
  // layout a one-shot prefill of that prompt gives them (ascending, padding at the end, width
  // min(length, window)) instead of the decode layout (the ring oldest first, padding at the start),
  // so a prefill in any chunks, or restored at any block, computes the one-shot prefill's bits. The two
  // layouts hold the same rows and differ in rounding only once a list spans several 64-row softmax
  // chunks (window 128). -1: a call starting at 0 is a one-shot prefill of its tokens, any other call
  // decodes (the reference's decode layout, which a verification must also reproduce).
  int64_t prefill_length = -1;
  bool capture_index = false;  // keep every index source's scores, selections and candidate pool
  // Bounded replay (model-spec §5): the tokens are re-run only to rebuild windows; the global rows of
  // these positions already exist and are read, never rewritten.
  bool replay = false;
  bool record_compressor_rows = false;  // speculative verification (ForwardResult::compressor_*)
  bool dspark_taps = false;             // the drafter's inputs (ForwardResult::dspark_taps)
  // Teacher forcing (forward_context.h), exact mode only: checks against another implementation.
  std::shared_ptr<const TeacherForcing> teacher;
  std::shared_ptr<const SpanEmbeddings> spans;  // image spans in this call, if any
};

struct ForwardResult {
  std::vector<float> logits;  // [rows, vocab], fp32
  int64_t rows = 0;
  std::vector<float> block_outputs;  // [n_layers, count, hc, dim] when captured
  std::vector<float> dspark_taps;    // [count, n_taps·dim]: mean over copies of the tapped layers' inputs
  int64_t first_tap_row = 0;         // rows before it were not computed (tail mode)
  std::vector<std::vector<float>> compressor_kv, compressor_score;  // when record_compressor_rows
  std::vector<IndexCapture> index;                                  // [layer] when capture_index
};

// One sequence's part of a forward over several: `tokens` at positions state->length.., which the
// call advances.
struct ForwardCall {
  SequenceState* state = nullptr;
  std::vector<int32_t> tokens;
  ForwardOptions options;
};

class Model {
 public:
  // `expert_cache_bytes` > 0: the routed experts come from an ExpertCache of that size (the memory
  // plan's streamed placement; the weights then hold them unpacked in the mapping, unread).
  // `expert_peers`: the other ranks of an expert-parallel job, holding the routed experts and Engram
  // rows outside the weights' share (null: a single process).
  Model(std::shared_ptr<const Backend> backend, std::shared_ptr<const ModelWeights> weights, EngramTokenMap token_map,
        uint64_t expert_cache_bytes = 0, std::shared_ptr<ExpertPeers> expert_peers = nullptr);
  const ModelConfig& config() const { return weights_->config(); }
  const std::vector<LayerRole>& roles() const { return roles_; }
  const ModelWeights& weights() const { return *weights_; }
  const Backend& backend() const { return *backend_; }
  // The routed experts' cache, when the memory plan streams them; null otherwise.
  const ExpertCache* expert_cache() const { return expert_cache_.get(); }
  // The other ranks of an expert-parallel job; null in a single process.
  ExpertPeers* expert_peers() const { return expert_peers_.get(); }
  // The config and the checkpoint's contents in 16 hex digits (io/config.h model_fingerprint): what
  // a prompt cache's files must carry to be this model's.
  const std::string& fingerprint() const { return fingerprint_; }
  // The rotary table of a layer: compress theta with YaRN for ratio > 0, the base theta otherwise.
  const RopeTable& rope(int layer) const { return roles_[layer].compress_ratio > 0 ? rope_compressed_ : rope_window_; }

  // A fresh sequence whose global rows live in `pools` (which must outlive it).
  SequenceState new_sequence(StatePools& pools) const;
  // The Engram n-gram history after `tokens` (the compressed ids of the last max_ngram-1 of them). A
  // negative id stands for an image-span position (a prompt's key tokens, runtime/prompt_images.h):
  // DEAD, as the forward pass marked it.
  std::vector<int64_t> engram_history(const std::vector<int32_t>& tokens) const;

  // Runs every call in one pass through the layers: only the state-dependent parts (attention's
  // core: RoPE, windows, compressed rows, the indexer, sparse attention; Engram history) run per
  // sequence; every weight-streaming part (the projections, the MoE, the head) runs once over the
  // rows of all of them, so its weights are read once. Row by row the results are those of each call
  // run alone. The calls must be of distinct sequences.
  std::vector<ForwardResult> forward(std::vector<ForwardCall>& calls) const;
  // One call.
  ForwardResult forward(SequenceState& state, const std::vector<int32_t>& tokens, const ForwardOptions& options) const;

 private:
  std::shared_ptr<const Backend> backend_;
  std::shared_ptr<const ModelWeights> weights_;
  std::vector<LayerRole> roles_;
  EngramHasher hasher_;
  RopeTable rope_window_;      // theta for ratio-0 layers, no YaRN
  RopeTable rope_compressed_;  // compress theta with YaRN for ratio > 0 layers
  std::string fingerprint_;
  std::unique_ptr<ExpertCache> expert_cache_;
  std::shared_ptr<ExpertPeers> expert_peers_;
};

struct ModelOptions {
  std::shared_ptr<const Backend> backend;  // null: make_backend() with its defaults
  EngramTier engram = EngramTier::Mmap;
  // The memory budget the load follows (model/memory_plan.h); 0: what the host and its cgroup allow.
  // Above the memory cgroup's limit it is refused (an Error naming --ram and both numbers).
  uint64_t ram_bytes = 0;
  // What the runtime will hold beside the weights, for the plan: KV pages, the prompt cache's RAM
  // (granted up to this), prompt tokens per forward call.
  uint64_t kv_bytes = 0;
  uint64_t prompt_cache_bytes = 0;
  int64_t prefill_chunk = 512;
  // An expert-parallel job's other ranks (parallel/): the load binds only this rank's share.
  std::shared_ptr<ExpertPeers> expert_peers = nullptr;
};

// The plan a load with these options follows (model/memory_plan.h), for the backend's packing.
MemoryPlan plan_model_memory(const ModelConfig& config, const Backend& backend, const ModelOptions& options);

// Loads a model folder: config, weights (checked against the config, packed for the backend as far as
// the memory plan allows) and the Engram token map built from its tokenizer.json. An Error before
// anything large is read when even the minimal plan does not fit the budget; `plan` (optional)
// receives the plan followed.
std::unique_ptr<Model> load_model(const std::string& dir, const ModelOptions& options = {}, MemoryPlan* plan = nullptr);

}  // namespace dsv41
