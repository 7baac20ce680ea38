// One sequence being generated: the narrow API the tools and the server use. It owns the sequence's
// state and hides tensors: feed a prompt (in chunks, exact or tail mode), then one token at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/model.h"
#include "runtime/prefix_cache.h"
#include "runtime/prompt_images.h"
#include "runtime/sequence_options.h"
#include "state/sequence_snapshot.h"
#include "state/state_pools.h"

namespace dsv41 {

struct SessionOptions {
  PrefillMode prefill_mode = PrefillMode::Exact;
  // Prompt tokens per forward call: activations grow with the call, not the context, so this bounds
  // a long prefill's working memory. 0 = kDefaultPrefillChunk.
  int64_t chunk = 0;
  IndexKeysMode index_keys = IndexKeysMode::Owner;
  // The prompt cache's namespace this sequence finds and keeps its prefixes in (io/cache_namespace.h):
  // "" or its request's cache salt's digest.
  std::string cache_namespace;
};

class Session {
 public:
  // The sequence's global rows live in `pools`, which must outlive the session. With a prefix cache,
  // the first prefill restores what the cache holds of the prompt and stores the prompt's state for
  // later requests.
  Session(const Model& model, StatePools& pools, SessionOptions options, PrefixCache* cache = nullptr);

  // Runs the prompt (appended to what the session already holds) and returns the logits at its last
  // position. `progress(done, total)` is called after every chunk.
  std::vector<float> prefill(const std::vector<int32_t>& tokens,
                             const std::function<void(int64_t, int64_t)>& progress = {});
  // The same in steps, so a scheduler can interleave other sequences between them: begin_prefill
  // restores what the cache holds, then every prefill_step runs at most `max_tokens` prompt tokens
  // (returning how many it ran) until prefill_pending() is false and last_logits() holds the logits
  // at the prompt's last position. `handed`: the state of a prefix of the prompt that a prefill
  // server computed (PrefixCache::restore_handed), restored in place of what the cache holds; one
  // that does not fit is set aside (handover_refusal() says why) and the cache serves as usual.
  // `images`: the prompt's image spans (runtime/prompt_images.h), whose rows replace the token
  // embeddings there; a span is prefilled in one chunk, and the cache keys it by its image.
  void begin_prefill(const std::vector<int32_t>& tokens, const CacheEntry* handed = nullptr,
                     std::shared_ptr<const PromptImages> images = nullptr);
  const std::string& handover_refusal() const { return handover_refusal_; }
  // Asks the prefill under way to store its state at `boundary` too (a block boundary ahead of it,
  // past the first window, outside image spans), where another prompt waiting to start leaves this
  // one: returns whether it will (false: not caching, or not such a boundary).
  bool store_also_at(int64_t boundary);
  bool prefill_pending() const { return pending_done_ < static_cast<int64_t>(pending_.size()); }
  int64_t prefill_step(int64_t max_tokens);
  const std::vector<float>& last_logits() const { return last_logits_; }

  // Appends one token and returns the logits that predict the next.
  std::vector<float> decode(int32_t token);
  // decode() for several sessions of one model in one step: the same logits, with every projection's
  // and expert's weights read once for all of them.
  static std::vector<std::vector<float>> decode_batch(const std::vector<Session*>& sessions,
                                                      const std::vector<int32_t>& tokens);

  // A step planned per session and run for several in one forward (what decode_batch does, open to a
  // scheduler that mixes plain decodes with speculative verifications): each session plans one
  // thing, run_planned runs them all in one Model::forward, and each then reads its result.
  //  - plan_decode(token, observe): appends the token (the result's logits predict the next one);
  //    Observe::Later keeps the step's taps (the last window's worth) for observe_deferred(), which
  //    hands them to the observer in one call, and Observe::No leaves the observer out, taps and all;
  //  - plan_verify(run): runs `run` (the newest token, then drafts) with every row's logits, keeping
  //    a checkpoint; keep_verified(n) then keeps run[0..n) and rolls every kind of state back to
  //    exactly what running only those would have left;
  //  - plan_prefill(max_tokens): the pending prompt's next chunk of at most max_tokens (an image
  //    span whole, a chunk ending at the cache's store boundary), returning its length: what
  //    prefill_step runs alone. Its rows compute what they compute alone (Model::forward's promise),
  //    so a scheduler may run a prompt's chunk in the same forward as other sequences' decodes.
  enum class Observe { Now, Later, No };
  void plan_decode(int32_t token, Observe observe = Observe::Now);
  void plan_verify(std::vector<int32_t> run);
  int64_t plan_prefill(int64_t max_tokens);
  static void run_planned(const std::vector<Session*>& sessions);
  const ForwardResult& planned_result() const { return result_; }
  int64_t planned_rows() const { return planned_ == Planned::None ? 0 : static_cast<int64_t>(planned_tokens_.size()); }
  void keep_verified(int64_t n);
  // Hands the taps kept by Observe::Later steps to the observer, as one run of rows: a drafter that
  // resumes after a pause then projects its window in one batch instead of one call a step (the
  // same rows, bit for bit: every op computes a row the same way whatever its batch).
  void observe_deferred();

  int64_t position() const { return state_.length(); }
  // Called after every target forward of this session with its result and the positions it ran.
  using Observer = std::function<void(SequenceState&, const ForwardResult&, int64_t start, int64_t count)>;
  void set_observer(Observer observer) { observer_ = std::move(observer); }
  // Every token the session has run, in order (the prompt, then decoded tokens), image spans as key
  // tokens (negative, PromptImages::key_tokens).
  const std::vector<int32_t>& history() const { return history_; }
  const SessionOptions& options() const { return options_; }
  const CacheHit& cache_hit() const { return hit_; }           // what the last prefill got from the cache
  uint64_t cache_bytes_written() const { return disk_bytes_; }  // by the last prefill's store
  int64_t cache_tokens_stored() const { return stored_tokens_; }
  const SequenceState& state() const { return state_; }
  const Model& model() const { return model_; }

 private:
  const Model& model_;
  SessionOptions options_;
  SequenceState state_;
  PrefixCache* cache_ = nullptr;
  Observer observer_;
  std::vector<int32_t> history_;
  // the planned step (plan_decode, plan_verify, plan_prefill), its result and the verification's checkpoint
  enum class Planned { None, Decode, Verify, Verified, Prefill } planned_ = Planned::None;
  std::vector<int32_t> planned_tokens_;
  ForwardOptions planned_prefill_;  // the planned prefill chunk's options (its image spans)
  void finish_prefill_chunk();      // after a planned prefill chunk ran: observer, logits, store
  Observe planned_observe_ = Observe::Now;
  void observe_step();       // after a planned decode, as planned_observe_ says
  int64_t tap_width() const;  // floats of taps per row
  std::vector<float> deferred_taps_;  // [rows, n_taps·dim] of the newest Observe::Later steps
  int64_t deferred_from_ = 0;         // the position of its first row
  ForwardResult result_;
  VerifyCheckpoint checkpoint_;
  // the prompt being prefilled step by step
  std::vector<int32_t> pending_, pending_keys_;
  std::shared_ptr<const PromptImages> pending_images_;
  int64_t pending_done_ = 0, pending_origin_ = 0, store_at_ = -1;
  // boundaries shared with other prompts, stored for them (fork_boundary, store_also_at), ascending
  std::vector<int64_t> shared_stores_;
  bool storable_ = false;  // this prefill stores its state in the cache
  ForwardOptions pending_opt_;
  std::vector<float> last_logits_;
  CacheHit hit_;
  std::string handover_refusal_;
  uint64_t disk_bytes_ = 0;
  int64_t stored_tokens_ = 0;
};

}  // namespace dsv41
