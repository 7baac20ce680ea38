// The engine the server talks to: requests in, token events out. It owns the model, the tokenizer,
// the KV pages and the prefix cache, and one scheduler thread that alone decides what runs each step
// (continuous batching: new requests join running ones between steps; long prompts are prefilled in
// chunks interleaved with other requests' decodes; requests wait in a queue while KV pages are short).
// Nothing here exposes a tensor.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "io/config.h"
#include "io/engram_store.h"
#include "runtime/cache_mode.h"
#include "runtime/sampling_params.h"
#include "text/tokenizer.h"

namespace dsv41 {

class Backend;  // kernels/backend.h: what the model's math runs on

struct EngineOptions {
  std::string model_dir;
  int parallel = 4;                          // sequences running at once; more requests wait in a queue
  int64_t prefill_chunk = 256;               // prompt tokens one sequence may run per step
  uint64_t kv_budget_bytes = uint64_t{1} << 30;  // global KV pages (admission control)
  std::string prompt_cache_dir;              // empty: RAM tier only
  uint64_t prompt_cache_disk_bytes = kDefaultPromptCacheDiskBytes;  // the folder's files; LRU past it
  CacheMode cache_mode = CacheMode::Exact;
  uint64_t cache_ram_bytes = uint64_t{256} << 20;
  EngramTier engram = EngramTier::Mmap;
  std::shared_ptr<const Backend> backend;    // null: the best kernel level, one thread per core
  // Lines for the operator (a request's failure in full, prompt-cache files skipped, cache writes
  // failing), called on the scheduler thread or in the constructor; null: stderr. Clients never see
  // these: a failed request's TokenEvent.error names no server file.
  std::function<void(const std::string&)> log;
};

struct RequestParams {
  std::vector<int32_t> prompt;               // token ids (the server renders and tokenizes)
  int64_t max_tokens = 16;
  SamplingParams sampling;
  std::vector<std::string> stop;             // stop strings: generation ends before any of them
  bool ignore_eos = false;
  int top_logprobs = -1;                     // -1: no logprobs; 0..20: the chosen token's and this many alternatives
  // Test hook (the server accepts it only with --test-hooks): tokens emitted in place of the first
  // sampled ones, as if the model had produced them, so the whole output path can be exercised.
  std::vector<int32_t> forced_output;
};

struct TokenEvent {
  int32_t token = -1;       // -1 for the final event
  std::string text;         // text this token completes (held back while it may start a stop string)
  double logprob = 0;       // of the chosen token under the sampling distribution's logits (temperature 1)
  std::vector<std::pair<int32_t, double>> top_logprobs;
  bool done = false;
  std::string finish_reason;  // at done: "stop", "length", "cancelled" or "error"
  std::string error;
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;  // at done
  double queue_seconds = -1;  // on the first token's event: from submit until the request was admitted
};

// Called on the scheduler thread; must be quick and must not call back into the engine.
using EventSink = std::function<void(const TokenEvent&)>;

struct EngineMetrics {
  uint64_t requests_total = 0, requests_finished = 0, requests_cancelled = 0, requests_failed = 0;
  uint64_t requests_running = 0, requests_queued = 0;
  uint64_t prompt_tokens_total = 0, generation_tokens_total = 0, cached_tokens_total = 0;
  uint64_t steps_total = 0, last_batch_size = 0;
  uint64_t kv_pages_in_use = 0;
  uint64_t cache_pages_in_use = 0;  // of those, held by the prefix cache for later requests
  uint64_t kv_bytes_in_use = 0, kv_budget_bytes = 0;
  // The prompt-cache folder (all 0 without one): what it indexes now, files removed to keep its
  // budget, and stores that did not reach the disk (their requests went on uncached).
  uint64_t prompt_cache_disk_files = 0, prompt_cache_disk_bytes = 0;
  uint64_t prompt_cache_evictions = 0, prompt_cache_write_failures = 0;
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

  // Queues a request; throws Error for a request that can never run (empty prompt, prompt plus
  // max_tokens over the context, a token outside the vocabulary, bad sampling values).
  uint64_t submit(RequestParams params, EventSink sink);
  // Ends a request (queued or running) with finish_reason "cancelled" and frees its pages.
  void cancel(uint64_t id);
  EngineMetrics metrics() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv41
