// The engine the server talks to: requests in, token events out. It owns the model, the tokenizer,
// the KV pages and the prefix cache, and one scheduler thread that alone decides what runs each step
// (continuous batching: new requests join running ones between steps; each step is one forward in
// which prompt chunks run beside the other requests' decodes, as many prompt rows as keep the step
// within its time budget; requests wait in a queue while KV pages are short).
// Nothing here exposes a tensor.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "io/config.h"
#include "io/engram_store.h"
#include "io/layer_roles.h"
#include "runtime/cache_mode.h"
#include "runtime/image_input.h"
#include "runtime/sampling_params.h"
#include "runtime/sequence_options.h"
#include "text/tokenizer.h"

namespace dsv41 {

class Backend;  // kernels/backend.h: what the model's math runs on
class Model;    // model/model.h: the loaded weights and the forward pass
class ExpertPeers;  // model/expert_peers.h: the other ranks of an expert-parallel job
class PrefillPeer;  // runtime/prefill_peer.h: a prefill server (serve --role decode)
class KvEventSink;  // runtime/kv_events.h: a publisher of the prompt cache's KV events
struct Grammar;     // text/json_grammar.h: what a constrained output must be

// Which queued request is admitted first, and whose prompt rows come first in a step: the oldest
// (Fcfs), or the one of the lowest RequestParams::priority, the oldest among equals (Priority, vLLM's
// meaning).
enum class SchedulingPolicy { Fcfs, Priority };

struct EngineOptions {
  std::string model_dir;
  int parallel = 4;                          // sequences running at once; more requests wait in a queue
  int64_t prefill_chunk = 256;               // prompt tokens a step may run (the activations' bound)
  // While sequences decode, a step runs only the prompt rows that keep it within this many ms
  // (runtime/step_budget.h); 0: StepBudget::kDecodeSteps measured decode steps, within its floor
  // and ceiling.
  double step_budget_ms = 0;
  SchedulingPolicy scheduling = SchedulingPolicy::Fcfs;
  uint64_t kv_budget_bytes = uint64_t{1} << 30;  // global KV pages (admission control)
  std::string prompt_cache_dir;              // empty: RAM tier only
  uint64_t prompt_cache_disk_bytes = kDefaultPromptCacheDiskBytes;  // the folder's files; LRU past it
  CacheMode cache_mode = CacheMode::Exact;
  uint64_t cache_ram_bytes = uint64_t{256} << 20;
  EngramTier engram = EngramTier::Mmap;
  // The memory budget the model's load follows (model/memory_plan.h; `dsv41 plan` shows it): 0, what
  // the host and its cgroup allow; above the cgroup's limit, refused. The prompt cache's RAM is cut
  // to what the plan leaves it.
  uint64_t ram_bytes = 0;
  std::shared_ptr<const Backend> backend;    // null: the best kernel level, one thread per core
  // A model already loaded from model_dir (tools that run several engines on one model, such as
  // bench); null: the engine loads it, with `backend` and `engram`.
  std::shared_ptr<const Model> model;
  // The other ranks of an expert-parallel job (`mpirun ... --expert-parallel`; parallel/): the engine's
  // load binds only this rank's share of the routed experts and Engram rows. Null: one process.
  std::shared_ptr<ExpertPeers> expert_peers;
  // A decode server's prefill server: a prompt of at least two blocks is prefilled there up to its
  // last usable block boundary and its state handed over in `handover` mode (exact: with the window
  // rings; replay: the decode side replays the last window). A handover that fails or does not fit
  // is logged and the prompt prefilled here: the request never sees it. Null: prefill here.
  std::shared_ptr<PrefillPeer> prefill_peer;
  CacheMode handover = CacheMode::Exact;
  // Where the prompt cache's RAM-tier changes go as KV events (serve --kv-events); null: nowhere.
  std::shared_ptr<KvEventSink> kv_events;
  // Speculative decoding for requests that do not choose (RequestParams::speculative), and its draft
  // length (0: adaptive, from DSpark's confidence head). DSpark needs a model with mtp.* blocks.
  SpeculativeMethod speculative = SpeculativeMethod::Off;
  int draft_length = 0;
  // Lines for the operator (a request's failure in full, prompt-cache files skipped, cache writes
  // failing), called on the scheduler thread or in the constructor; null: stderr. Clients never see
  // these: a failed request's TokenEvent.error names no server file.
  std::function<void(const std::string&)> log;
};

struct RequestParams {
  std::vector<int32_t> prompt;               // token ids (the server renders and tokenizes)
  // Images, in the order of the prompt's image placeholders (the config's image_token_id), each
  // filling one: the engine expands every placeholder into its image's span (prompt_tokens counts
  // the expanded prompt) and runs the vision tower when the request starts.
  std::vector<ImageInput> images;
  int64_t max_tokens = 16;                   // 0: prefill only (the prompt's state, e.g. into the cache)
  int64_t priority = 0;                      // SchedulingPolicy::Priority: lower runs first
  SamplingParams sampling;
  std::vector<std::string> stop;             // stop strings: generation ends before any of them
  bool ignore_eos = false;
  int top_logprobs = -1;                     // -1: no logprobs; 0..20: the chosen token's and this many alternatives
  // How the sequence runs. Speculation unset: the engine's default. Greedy output is the same token
  // for token whatever is chosen here, apart from tail mode's and reference keys' own numerics.
  std::optional<SpeculativeMethod> speculative;
  int draft_length = -1;                     // -1: the engine's; 0: adaptive; else 1..block size
  bool acceptance_guard = true;              // false: draft at every step however few are accepted (measuring)
  PrefillMode prefill_mode = PrefillMode::Exact;
  IndexKeysMode index_keys = IndexKeysMode::Owner;  // Reference: no prompt cache (it holds Owner state)
  bool return_logits = false;                // every token's event carries the logits row that chose it
  // Teacher forcing, and the server's test hook (--test-hooks): tokens emitted in place of the first
  // sampled ones, as if the model had produced them. Such a request never speculates.
  std::vector<int32_t> forced_output;
  // Measurement hook (generate --oracle-drafts): replaces DSpark's drafts for the step whose first
  // token sits at `position`. Called on the scheduler thread.
  std::function<std::vector<int32_t>(int64_t position, const std::vector<int32_t>& drafted)> force_drafts;
  // Called on the scheduler thread after every prefill chunk: prompt tokens done (cached ones
  // included) and the prompt's length.
  std::function<void(int64_t done, int64_t total)> prefill_progress;
  // A prefill server's request (serve --role prefill): with max_tokens 0 and a prompt of whole 64-token
  // blocks, the final event carries the state after the prompt as a prompt-cache entry of this mode.
  std::optional<CacheMode> export_state;
  // The prompt cache's namespace (io/cache_namespace.h): "" or the digest of the request's
  // cache_salt. Prefixes are found and kept only among requests of the same namespace.
  std::string cache_namespace;
  // Structured outputs: each token sampled after `grammar_after` (a token id, e.g. the end of
  // reasoning; -1: from the first) is one the grammar allows (text/grammar_mask.h), and the request
  // ends ("stop") when the value is whole. Speculating, its drafts are verified against the masked
  // target (one outside the grammar is rejected). A request with forced_output (a test hook that
  // stands for the model) runs without its grammar. Null: a free output.
  std::shared_ptr<const Grammar> grammar;
  int32_t grammar_after = -1;
};

// Why a request ended: an end-of-sentence token, a stop string or a whole structured value (Stop),
// max_tokens (Length), a cancellation (Cancelled), or a failure its event's `error` names (Error).
enum class FinishReason { Stop, Length, Cancelled, Error };
const char* finish_reason_name(FinishReason reason);  // "stop", "length", "cancelled", "error"

// What a finished request did, on its final event.
struct RequestReport {
  int64_t replayed_tokens = 0;               // re-run to rebuild windows after a replay-mode cache hit
  CacheSource cache_source = CacheSource::None;  // cache_source_name() names it
  uint64_t cache_bytes_written = 0;          // by the prompt's store into the cache's disk tier
  int64_t cache_tokens_stored = 0;
  double main_kv_bytes_per_token = 0, index_key_bytes_per_token = 0;  // the global rows it held at the end
  // speculative decoding: verifications, drafts proposed and accepted (per draft position too), steps
  // decoded plainly (guard pauses, the last token) and guard pauses
  int64_t verify_steps = 0, drafts_proposed = 0, drafts_accepted = 0, plain_steps = 0, guard_pauses = 0;
  std::vector<int64_t> accepted_per_position;
};

struct TokenEvent {
  int32_t token = -1;       // -1 for the final event
  std::string text;         // text this token completes (held back while it may start a stop string)
  double logprob = 0;       // of the chosen token under the sampling distribution's logits (temperature 1)
  std::vector<std::pair<int32_t, double>> top_logprobs;
  std::vector<float> logits;  // RequestParams::return_logits: the row that chose `token` (or stop_token)
  bool done = false;
  FinishReason finish_reason = FinishReason::Stop;  // at done
  std::string error;
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;  // at done
  double queue_seconds = -1;  // on the first token's event: from submit until the request was admitted
  int32_t stop_token = -1;    // at done: the end-of-sentence token that ended it, if one did
  std::string stop_string;    // at done: the stop string that ended it, if one did
  RequestReport report;       // at done
  // at done, for RequestParams::export_state: the prompt's state as prompt-cache entry bytes
  std::shared_ptr<const std::vector<uint8_t>> exported_state;
};

// Called on the scheduler thread; must be quick and must not call back into the engine.
using EventSink = std::function<void(const TokenEvent&)>;

struct EngineMetrics {
  uint64_t requests_total = 0, requests_finished = 0, requests_cancelled = 0, requests_failed = 0;
  uint64_t requests_running = 0, requests_queued = 0;
  uint64_t prompt_tokens_total = 0, generation_tokens_total = 0, cached_tokens_total = 0;
  uint64_t steps_total = 0, last_batch_size = 0;
  // How long the step now running has run (0 between steps): a step that never ends (a peer that
  // stopped answering) shows here, where a server's watchdog reads it.
  double step_running_seconds = 0;
  uint64_t decode_forwards_total = 0;  // batched decode forwards: every ready sequence's rows in one
  uint64_t mixed_forwards_total = 0;   // of those, the ones that also ran prompt rows
  double step_budget_seconds = 0;      // the step budget in force (0 before the first step)
  uint64_t kv_pages_in_use = 0;
  uint64_t cache_pages_in_use = 0;  // of those, held by the prefix cache for later requests
  uint64_t prompt_cache_ram_blocks = 0;  // the 64-token blocks the prefix cache's RAM tier holds
  uint64_t kv_bytes_in_use = 0, kv_budget_bytes = 0;
  // The prompt-cache folder (all 0 without one): what it indexes now, files removed to keep its
  // budget or to make room on a full disk, stores that did not reach the disk (their requests went on
  // uncached), and stores that found the disk full (each evicted and tried once more).
  uint64_t prompt_cache_disk_files = 0, prompt_cache_disk_bytes = 0;
  uint64_t prompt_cache_evictions = 0, prompt_cache_write_failures = 0, prompt_cache_disk_full = 0;
  // Speculative decoding over all requests (vLLM's spec_decode counters): verifications, drafts
  // verified, drafts accepted, accepted drafts by position in the draft, acceptance-guard pauses.
  uint64_t spec_verify_steps = 0, spec_draft_tokens = 0, spec_accepted_tokens = 0, spec_guard_pauses = 0;
  std::vector<uint64_t> spec_accepted_per_position;
  // The routed experts' cache when the memory plan streams them (all 0 otherwise): its size, what it
  // holds, hits and misses, evictions, bytes read from the checkpoint and the wall time of those reads.
  uint64_t expert_cache_capacity_bytes = 0, expert_cache_resident_bytes = 0;
  uint64_t expert_cache_hits = 0, expert_cache_misses = 0, expert_cache_evictions = 0, expert_cache_bytes_read = 0;
  double expert_cache_read_seconds = 0;
  // Prefill/decode handovers (a decode server's): prompts prefilled by the peer, their tokens and the
  // bytes received for them, and the handovers that failed or were refused (prefilled here instead).
  uint64_t handovers = 0, handover_tokens = 0, handover_bytes = 0, handover_fallbacks = 0;
  // KV events (EngineOptions::kv_events): batches handed to the publisher, and those it gave up.
  uint64_t kv_event_batches = 0, kv_event_batches_dropped = 0;
};

class Engine {
 public:
  explicit Engine(const EngineOptions& options);
  ~Engine();  // stops the scheduler; pending requests end with "cancelled"
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const Tokenizer& tokenizer() const;
  const ModelConfig& config() const;
  std::string model_name() const;  // the model folder's name
  int draft_block_size() const;    // DSpark's drafts per step; 0: the model has no drafter
  bool sees_images() const;        // the checkpoint carries a vision tower (RequestParams::images)
  SchedulingPolicy scheduling() const;  // whether RequestParams::priority orders requests

  // Queues a request; throws Error for a request that can never run (empty prompt, prompt plus
  // max_tokens over the context, a token outside the vocabulary, bad sampling values, speculation
  // the model cannot do, a draft length outside 0..block size).
  uint64_t submit(RequestParams params, EventSink sink);
  // The prompt's length once each image placeholder is expanded into its image's span (what the
  // request's prompt_tokens will be). Throws Error as submit() does when images and placeholders differ.
  int64_t prompt_length(const std::vector<int32_t>& prompt, const std::vector<ImageInput>& images) const;
  // Ends a request (queued or running) with finish_reason "cancelled" and frees its pages.
  void cancel(uint64_t id);
  EngineMetrics metrics() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv41
