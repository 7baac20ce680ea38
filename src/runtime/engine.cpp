#include "runtime/engine.h"
#include "runtime/prompt_images.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <future>
#include <mutex>
#include <new>
#include <optional>
#include <thread>

#include "io/layer_roles.h"
#include "model/dspark.h"
#include "model/model.h"
#include "runtime/kv_events.h"
#include "runtime/output_text.h"
#include "runtime/prefill_peer.h"
#include "runtime/sampler.h"
#include "runtime/session.h"
#include "runtime/speculative.h"
#include "runtime/step_budget.h"
#include "state/disk_cache.h"
#include "state/sequence_snapshot.h"
#include "state/state_graph.h"
#include "text/grammar_mask.h"
#include "text/json_grammar.h"
#include "util/error.h"

namespace dsv41 {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Cancelled: return "cancelled";
    case FinishReason::Error: return "error";
  }
  return "error";
}

namespace {

// What a client is told when its request fails while running: the cause in general terms only. The
// full message, which may name server files (the prompt-cache folder, the model's), goes to the log.
// An Error of kind Unavailable is written for the client (what the server cannot do now, such as an
// expert-parallel rank that stopped answering) and reaches it whole.
std::string client_error(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e)) return "the server ran out of memory while running this request";
  if (const auto* error = dynamic_cast<const Error*>(&e); error != nullptr && error->kind() == ErrorKind::Unavailable)
    return error->what();
  return "the engine failed while running this request (the server log has the details)";
}

}  // namespace

struct Engine::Impl {
  struct Request {
    uint64_t id = 0;
    RequestParams params;
    EventSink sink;
    std::unique_ptr<Session> session;
    std::unique_ptr<Sampler> sampler;
    std::unique_ptr<OutputText> output;  // its text as the client reads it (stop strings held back)
    std::unique_ptr<SpeculativeDecoder> spec;  // null: plain decoding
    int64_t generated = 0;
    int32_t last = -1;
    uint64_t reserved_bytes = 0;
    int64_t cached_tokens = 0;
    int32_t stop_token = -1;         // the end-of-sentence token that ended it
    std::vector<float> stop_logits;  // its row (return_logits)
    bool started = false;   // its first token has been sampled
    bool finished = false;  // its final event was sent
    // a decode server's: the prefill server's answer for the prompt's prefix, while it is awaited
    std::future<std::vector<uint8_t>> handover;
    bool handover_asked = false;
    std::vector<int64_t> image_starts;  // where params.images' spans start in the expanded prompt
    std::shared_ptr<const std::vector<uint8_t>> exported;  // export_state: for the final event
    std::unique_ptr<GrammarMatcher> grammar;  // structured outputs: where the output is in its grammar
    bool constrained = false;                 // the grammar holds from here on (after grammar_after)
    std::vector<uint64_t> allowed;            // the tokens it allows next (grammar_mask.h's bits)
    bool allowed_ready = false;               // `allowed` was computed during the step's forward
    GrammarVocabulary::Scratch mask_scratch;
    std::vector<float> masked;                // the logits cut to them
    std::chrono::steady_clock::time_point submitted, admitted;
    // waits_for_shared_prefix: the request whose prefill it waits for, until that one passes `waits_until`
    uint64_t waits_for = 0;
    int64_t waits_until = 0;
  };

  EngineOptions opt;
  std::function<void(const std::string&)> log;  // opt.log, or stderr
  std::shared_ptr<const Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<StatePools> pools;
  std::unique_ptr<PrefixCache> cache;
  std::unique_ptr<Drafter> drafter;  // null: the model has no DSpark blocks
  std::unique_ptr<GrammarVocabulary> grammar_vocab;  // made by the first constrained request
  double bytes_per_token = 0;

  mutable std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  bool handover_arrived = false;  // a prefill server answered (wakes an idle scheduler)
  uint64_t next_id = 1;
  std::deque<std::unique_ptr<Request>> queue;
  std::vector<uint64_t> cancels;
  EngineMetrics stats;  // under mu; the scheduler refreshes the gauges after every step
  std::atomic<uint64_t> kv_event_batches{0};  // the cache's listener may run under mu: counted apart
  std::chrono::steady_clock::time_point step_began{};  // under mu: the running step's start; {} between steps
  std::thread scheduler;

  // scheduler-thread only
  std::vector<std::unique_ptr<Request>> running;
  // handovers of requests that ended first (cancelled): kept until they return, since a future of
  // std::async waits for its call when destroyed, and the scheduler must not
  std::vector<std::future<std::vector<uint8_t>>> abandoned;
  uint64_t reserved = 0;
  // The acceptance guard's pause that the last speculating sequence ended with (0: drafting paid):
  // a new sequence starts with it, so where drafts do not pay each sequence does not pay for a
  // window of verifications to find out again (AcceptanceGuardOptions::start_paused).
  int guard_start_pause = 0;
  StepBudget step_budget{StepBudgetOptions{}};  // how many prompt rows a step runs beside the decoders

  void loop();
  void step();
  bool admit_locked();
  void finish(Request& r, FinishReason reason, const std::string& error = "");
  void fail_request(Request& r, const std::exception& e);
  enum class Stage { Waiting, Prefilling, Decoding };
  Stage prepare(Request& r);
  bool waits_for_shared_prefix(Request& r);
  void first_token(Request& r);
  bool emit(Request& r, int32_t token, const float* logits);
  void sample_and_emit(Request& r, const std::vector<float>& logits, int64_t vocab);
  void follow_grammar(Request& r, int32_t token);
  void mask_to_grammar(Request& r, const std::vector<int32_t>& ahead, std::vector<float>& row);
  void compute_allowed(Request& r, const GrammarMatcher& at);
  void start(Request& r, const CacheEntry* handed = nullptr);
  bool await_handover(Request& r);
  void export_prompt_state(Request& r);
  void count_speculation(const SpeculativeStats& before, const SpeculativeStats& after);
};

Engine::Engine(const EngineOptions& options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.opt = options;
  m.log = options.log ? options.log
                      : [](const std::string& line) { std::fprintf(stderr, "dsv41 engine: %s\n", line.c_str()); };
  if (options.parallel < 1) fail("--parallel", "must be at least 1");
  if (options.prefill_chunk < 1) fail("prefill chunk", "must be at least 1");
  if (!(options.step_budget_ms >= 0) || !std::isfinite(options.step_budget_ms))
    fail("--step-budget-ms", "must be a number of milliseconds, at least 0 (0: automatic)");
  StepBudgetOptions budget;
  budget.budget_seconds = options.step_budget_ms / 1e3;
  budget.max_rows = options.prefill_chunk;
  m.step_budget = StepBudget(budget);
  uint64_t cache_ram_bytes = options.cache_ram_bytes;
  if (options.model) {
    m.model = options.model;
  } else {
    // The plan counts the KV the running sequences can reach and grants the prompt cache what is left
    // of its share.
    ModelOptions mo;
    mo.backend = options.backend ? options.backend : make_backend();
    mo.engram = options.engram;
    mo.ram_bytes = options.ram_bytes;
    mo.kv_bytes = kv_reserve_bytes(load_config(options.model_dir), options.kv_budget_bytes, options.parallel);
    mo.prompt_cache_bytes = options.cache_ram_bytes;
    mo.prefill_chunk = options.prefill_chunk;
    mo.expert_peers = options.expert_peers;
    MemoryPlan plan;
    m.model = load_model(options.model_dir, mo, &plan);
    cache_ram_bytes = plan.prompt_cache_bytes;
    for (const std::string& w : plan.warnings) m.log("memory plan: " + w);
  }
  m.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_file(options.model_dir + "/tokenizer.json"));
  const ModelConfig& c = m.model->config();
  for (const std::string& key : c.unknown_keys) m.log(c.source + ": unknown config key " + key + " (ignored)");
  m.pools = std::make_unique<StatePools>(c, m.model->roles(), m.model->backend().allocator());
  m.bytes_per_token = build_state_graph(c, m.model->roles()).global_bytes_per_token();
  if (c.has_dspark()) {
    m.drafter = std::make_unique<Drafter>(*m.model);
    m.stats.spec_accepted_per_position.assign(static_cast<size_t>(m.drafter->block_size()), 0);
  }
  if (options.speculative == SpeculativeMethod::DSpark && !m.drafter) {
    fail("--speculative", "dspark needs a model with DSpark (mtp.*) blocks; this one has none");
  }
  if (options.draft_length < 0 || (m.drafter && options.draft_length > m.drafter->block_size())) {
    fail("--draft-length", "must be between 0 (adaptive) and the DSpark block size");
  }
  // The folder is made (or refused, naming it) and indexed here, before any request waits on it.
  m.cache = std::make_unique<PrefixCache>(*m.model, *m.pools, options.cache_mode, cache_ram_bytes,
                                          options.prompt_cache_dir, IndexKeysMode::Owner,
                                          DiskTierOptions{options.prompt_cache_disk_bytes, m.log});
  if (options.kv_events) {
    // one batch per change, handed over as it happens: by the time a request's answer leaves, the
    // events of the prefix it stored are with the publisher
    m.cache->on_events([&m, sink = options.kv_events](KvCacheEvent e) {
      sink->publish({std::move(e)});
      m.kv_event_batches.fetch_add(1, std::memory_order_relaxed);
    });
  }
  m.stats.kv_budget_bytes = options.kv_budget_bytes;
  m.stats.prompt_cache_disk_files = m.cache->disk_stats().files;  // what the folder held at start
  m.stats.prompt_cache_disk_bytes = m.cache->disk_stats().bytes;
  m.scheduler = std::thread([&m] { m.loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  if (impl_->opt.prefill_peer) impl_->opt.prefill_peer->stop();  // handovers in flight end at once
  impl_->scheduler.join();
}

const Tokenizer& Engine::tokenizer() const { return *impl_->tokenizer; }
const ModelConfig& Engine::config() const { return impl_->model->config(); }
// The model folder's own name, however the folder was written: "DIR/" and "DIR/." name DIR, "." the
// working folder; "dsv41" when there is no name at all (the root folder).
std::string Engine::model_name() const {
  std::filesystem::path p = std::filesystem::path(impl_->opt.model_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  if (p.filename() == "." || p.filename() == "..") {
    std::error_code ec;
    const std::filesystem::path full = std::filesystem::weakly_canonical(p, ec);
    if (!ec) p = full;
  }
  const std::string name = p.filename().string();
  return name.empty() || name == "." || name == ".." ? "dsv41" : name;
}

int Engine::draft_block_size() const { return impl_->drafter ? impl_->drafter->block_size() : 0; }
bool Engine::sees_images() const { return impl_->model->weights().vision != nullptr; }
SchedulingPolicy Engine::scheduling() const { return impl_->opt.scheduling; }

int64_t Engine::prompt_length(const std::vector<int32_t>& prompt, const std::vector<ImageInput>& images) const {
  std::vector<int32_t> expanded = prompt;
  expand_image_placeholders(impl_->model->config(), expanded, images);
  return static_cast<int64_t>(expanded.size());
}

uint64_t Engine::submit(RequestParams params, EventSink sink) {
  Impl& m = *impl_;
  const ModelConfig& c = m.model->config();
  if (params.prompt.empty()) fail("prompt", "is empty");
  if (params.max_tokens < 0) fail("max_tokens", "must be at least 0");
  if (params.speculative == SpeculativeMethod::DSpark && !m.drafter) {
    fail("speculative", "dspark needs a model with DSpark (mtp.*) blocks; this one has none");
  }
  if (params.draft_length < -1 || (params.draft_length > 0 && params.draft_length > draft_block_size())) {
    fail("draft_length", "must be between 0 (adaptive) and the DSpark block size " + std::to_string(draft_block_size()));
  }
  for (int32_t t : params.prompt) {
    if (t < 0 || t >= c.vocab_size) fail("prompt", "token id " + std::to_string(t) + " is outside the vocabulary");
  }
  if (!params.images.empty() && !m.model->weights().vision) {
    fail("images", "this model has no vision tower to see them with");
  }
  std::vector<int64_t> image_starts = expand_image_placeholders(c, params.prompt, params.images);
  const int64_t total = static_cast<int64_t>(params.prompt.size()) + params.max_tokens;
  if (total > c.max_seq_len) {
    fail("max_tokens", "the prompt (" + std::to_string(params.prompt.size()) + " tokens) plus max_tokens (" +
                           std::to_string(params.max_tokens) + ") exceeds the context of " + std::to_string(c.max_seq_len));
  }
  if (static_cast<double>(total + kTokensPerPage) * m.bytes_per_token > static_cast<double>(m.opt.kv_budget_bytes)) {
    fail("max_tokens", "the request needs more KV memory than the server's whole budget");
  }
  if (params.export_state && (params.max_tokens != 0 || params.prompt.size() % kTokensPerPage != 0)) {
    fail("export_state", "needs max_tokens 0 and a prompt of whole " + std::to_string(kTokensPerPage) + "-token blocks");
  }
  Sampler probe(params.sampling);  // validates temperature and top_p
  (void)probe;
  auto r = std::make_unique<Impl::Request>();
  r->params = std::move(params);
  r->image_starts = std::move(image_starts);
  r->sink = std::move(sink);
  r->submitted = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(m.mu);
  if (m.stopping) fail_unavailable("engine", "is shutting down");
  r->id = m.next_id++;
  const uint64_t id = r->id;
  m.queue.push_back(std::move(r));
  ++m.stats.requests_total;
  m.stats.requests_queued = m.queue.size();
  m.cv.notify_all();
  return id;
}

void Engine::cancel(uint64_t id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->cancels.push_back(id);
  impl_->cv.notify_all();
}

EngineMetrics Engine::metrics() const {
  EngineMetrics m;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    m = impl_->stats;
    if (impl_->step_began != std::chrono::steady_clock::time_point{}) {
      m.step_running_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - impl_->step_began).count();
    }
  }
  m.kv_event_batches = impl_->kv_event_batches.load(std::memory_order_relaxed);
  if (impl_->opt.kv_events) m.kv_event_batches_dropped = impl_->opt.kv_events->dropped();
  if (const ExpertCache* cache = impl_->model->expert_cache()) {
    const ExpertCacheStats st = cache->stats();
    m.expert_cache_capacity_bytes = st.capacity_bytes;
    m.expert_cache_resident_bytes = st.resident_bytes;
    m.expert_cache_hits = st.hits;
    m.expert_cache_misses = st.misses;
    m.expert_cache_evictions = st.evictions;
    m.expert_cache_bytes_read = st.bytes_read;
    m.expert_cache_read_seconds = st.read_seconds;
  }
  return m;
}

namespace {

// Whether a request's guard starts from, and teaches, what earlier sequences learned: not with the
// guard off, nor with forced drafts (a measurement whose acceptance says nothing of the drafter's).
bool learns_from_guard(const RequestParams& p) { return p.acceptance_guard && !p.force_drafts; }

// What the request's sequence holds and did, read before its session goes.
RequestReport report_of(const Session& session, const SpeculativeDecoder* spec) {
  RequestReport rep;
  rep.replayed_tokens = session.cache_hit().replayed_tokens;
  rep.cache_source = session.cache_hit().source;
  rep.cache_bytes_written = session.cache_bytes_written();
  rep.cache_tokens_stored = session.cache_tokens_stored();
  const GlobalRowBytes held = global_row_bytes(session.state());
  const double n = static_cast<double>(std::max<int64_t>(session.position(), 1));
  rep.main_kv_bytes_per_token = static_cast<double>(held.main_kv) / n;
  rep.index_key_bytes_per_token = static_cast<double>(held.index_keys) / n;
  if (spec) {
    const SpeculativeStats& s = spec->stats();
    rep.verify_steps = s.steps;
    rep.drafts_proposed = s.proposed;
    rep.drafts_accepted = s.accepted;
    rep.plain_steps = s.plain_steps;
    rep.guard_pauses = s.guard_pauses;
    rep.accepted_per_position = s.accepted_per_position;
  }
  return rep;
}

}  // namespace

void Engine::Impl::finish(Request& r, FinishReason reason, const std::string& error) {
  r.finished = true;
  TokenEvent e;
  if (r.session) e.report = report_of(*r.session, r.spec.get());
  if (r.spec && learns_from_guard(r.params)) guard_start_pause = r.spec->guard().learned_pause();
  r.spec.reset();
  r.session.reset();  // its pages go back to the pools (the prefix cache keeps what it stored)
  e.done = true;
  e.finish_reason = reason;
  e.error = error;
  if (r.output && reason != FinishReason::Cancelled && reason != FinishReason::Error) e.text = r.output->held();
  e.prompt_tokens = static_cast<int64_t>(r.params.prompt.size());
  e.completion_tokens = r.generated;
  e.cached_tokens = r.cached_tokens;
  e.stop_token = r.stop_token;
  if (r.output) e.stop_string = r.output->stop_string();
  e.logits = std::move(r.stop_logits);
  e.exported_state = std::move(r.exported);
  {
    // counted before the client hears of it, so a client that reads the metrics sees its request
    std::lock_guard<std::mutex> lock(mu);
    if (reason == FinishReason::Cancelled) {
      ++stats.requests_cancelled;
    } else if (reason == FinishReason::Error) {
      ++stats.requests_failed;
    } else {
      ++stats.requests_finished;
    }
    stats.generation_tokens_total += static_cast<uint64_t>(r.generated);
    stats.prompt_tokens_total += r.params.prompt.size();
    stats.cached_tokens_total += static_cast<uint64_t>(e.cached_tokens);
  }
  r.sink(e);
}

// Sends one sampled token (`logits`: the row that chose it); returns false when the request is complete.
bool Engine::Impl::emit(Request& r, int32_t token, const float* logits) {
  const ModelConfig& c = model->config();
  ++r.generated;
  r.last = token;
  const size_t V = static_cast<size_t>(c.vocab_size);
  if (token == c.eos_token_id && !r.params.ignore_eos) {
    r.output->end();
    r.stop_token = token;
    if (r.params.return_logits) r.stop_logits.assign(logits, logits + V);
    finish(r, FinishReason::Stop);
    return false;
  }
  TokenEvent e;
  e.token = token;
  if (r.generated == 1) e.queue_seconds = std::chrono::duration<double>(r.admitted - r.submitted).count();
  if (r.params.return_logits) e.logits.assign(logits, logits + V);
  if (r.params.top_logprobs >= 0) {
    TokenLogprobs lp = token_logprobs(logits, V, token, r.params.top_logprobs);
    e.logprob = lp.logprob;
    e.top_logprobs = std::move(lp.top);
  }
  e.text = r.output->push(token);
  r.sink(e);
  if (r.output->stopped()) {
    finish(r, FinishReason::Stop);
    return false;
  }
  if (r.generated >= r.params.max_tokens) {
    r.output->end();
    finish(r, FinishReason::Length);
    return false;
  }
  return true;
}

bool Engine::Impl::admit_locked() {
  // admission by KV memory: what the running sequences may still grow to, plus the newcomer's worst
  // case, must fit the budget (pages the prefix cache holds count as in use)
  bool admitted = false;
  while (!queue.empty() && running.size() < static_cast<size_t>(opt.parallel)) {
    if (opt.scheduling == SchedulingPolicy::Priority) {  // the first among the lowest priority goes first
      const auto first = std::min_element(queue.begin(), queue.end(), [](const auto& a, const auto& b) {
        return a->params.priority < b->params.priority;
      });
      std::rotate(queue.begin(), first, first + 1);
    }
    Request& r = *queue.front();
    const uint64_t need = static_cast<uint64_t>(
        static_cast<double>(static_cast<int64_t>(r.params.prompt.size()) + r.params.max_tokens + kTokensPerPage) *
        bytes_per_token);
    const uint64_t cached = cache->ram_bytes();
    if (!running.empty() && reserved + cached + need > opt.kv_budget_bytes) {
      if (cached > 0 && need + reserved <= opt.kv_budget_bytes) cache->clear_ram();  // make room
      else break;  // wait for running sequences to finish
    }
    r.reserved_bytes = need;
    r.admitted = std::chrono::steady_clock::now();
    reserved += need;
    running.push_back(std::move(queue.front()));
    queue.pop_front();
    admitted = true;
  }
  return admitted;
}

void Engine::Impl::fail_request(Request& r, const std::exception& e) {
  log("request " + std::to_string(r.id) + " failed: " + e.what());
  if (r.finished) return;  // it failed after its final event (in its sink): nothing more to tell
  try {
    finish(r, FinishReason::Error, client_error(e));
  } catch (const std::exception&) {
    // its sink threw again: the request is finished all the same, and nobody else is involved
  }
}

// A request's sequence: its session with the request's modes (the prompt cache only for the keys it
// holds), and the drafter and its speculative decoder when it speculates.
void Engine::Impl::start(Request& r, const CacheEntry* handed) {
  const RequestParams& p = r.params;
  SessionOptions so;
  so.prefill_mode = p.prefill_mode;
  so.index_keys = p.index_keys;
  so.cache_namespace = p.cache_namespace;
  PrefixCache* c = p.index_keys == IndexKeysMode::Owner ? cache.get() : nullptr;
  r.session = std::make_unique<Session>(*model, *pools, so, c);
  r.sampler = std::make_unique<Sampler>(p.sampling);
  r.output = std::make_unique<OutputText>(*tokenizer, p.stop);
  const SpeculativeMethod method = p.speculative.value_or(opt.speculative);
  if (p.grammar && p.forced_output.empty()) {  // forced output stands for the model: held to nothing
    if (!grammar_vocab) {  // the DSML marker is a special token a tool-call grammar writes
      std::vector<std::pair<int32_t, std::string>> special;
      if (const auto dsml = tokenizer->token_id("｜DSML｜")) special.emplace_back(*dsml, std::string(1, kDsmlMarkerByte));
      grammar_vocab = std::make_unique<GrammarVocabulary>(*tokenizer, static_cast<int32_t>(model->config().vocab_size), special);
    }
    r.grammar = std::make_unique<GrammarMatcher>(p.grammar);
    r.constrained = p.grammar_after < 0;
  }
  if (method == SpeculativeMethod::DSpark && drafter && p.forced_output.empty()) {
    attach_drafter(*r.session, *drafter);  // before the prompt: the drafter's rings follow it
    SpeculativeOptions spo;
    spo.fixed_length = p.draft_length >= 0 ? p.draft_length : opt.draft_length;
    spo.force_drafts = p.force_drafts;
    spo.guard.enabled = p.acceptance_guard;
    if (learns_from_guard(p)) spo.guard.start_paused = guard_start_pause;
    if (p.grammar) {
      spo.constrain = [this, &r](const std::vector<int32_t>& accepted, std::vector<float>& row) {
        mask_to_grammar(r, accepted, row);
      };
    }
    r.spec = std::make_unique<SpeculativeDecoder>(*r.session, *drafter, *r.sampler, spo);
  } else if (p.export_state && drafter) {
    // a prefill server's: the drafter's rings cross with the rest of the state, so a decode server
    // that speculates drafts from the prompt as it would have prefilled it itself
    attach_drafter(*r.session, *drafter);
  }
  std::shared_ptr<const PromptImages> images;
  if (!p.images.empty()) {
    images = std::make_shared<const PromptImages>(encode_prompt_images(*model, p.images, r.image_starts));
    r.params.images.clear();  // the patches are spent: the spans hold what the prefill needs
  }
  r.session->begin_prefill(p.prompt, handed, images);
  r.cached_tokens = r.session->cache_hit().cached_tokens;
  if (handed == nullptr) return;
  std::lock_guard<std::mutex> lock(mu);
  if (r.session->cache_hit().source == CacheSource::Peer) {
    ++stats.handovers;
    stats.handover_tokens += static_cast<uint64_t>(r.cached_tokens);
  } else {
    ++stats.handover_fallbacks;
    log("request " + std::to_string(r.id) + ": the prefill server's state was refused (" +
        r.session->handover_refusal() + "); prefilling here");
  }
}

// A decode server's request, before its session starts: asks the prefill server for the prompt's
// prefix (once) and returns true when the session may start (r.handover then holds the answer, if
// one was asked for). A prompt shorter than two blocks, not in the handover's reach, or whose prefix
// this server's own cache holds but for less than two blocks (an agent's next turn), starts at once.
bool Engine::Impl::await_handover(Request& r) {
  const RequestParams& p = r.params;
  if (!r.handover_asked) {
    r.handover_asked = true;
    const int64_t n = static_cast<int64_t>(p.prompt.size());
    const int64_t boundary = PrefixCache::usable_boundary(n);
    const bool exact = opt.handover == CacheMode::Exact;
    // a prefill server gets token ids only: a prompt with images is prefilled here
    if (!p.images.empty() || p.index_keys != IndexKeysMode::Owner || p.prefill_mode != PrefillMode::Exact ||
        boundary < 2 * kTokensPerPage ||
        (exact && boundary < model->config().window_size) ||
        cache->ram_hit_tokens(p.prompt, p.cache_namespace) + 2 * kTokensPerPage > boundary) {
      return true;
    }
    std::vector<int32_t> prefix(p.prompt.begin(), p.prompt.begin() + boundary);
    r.handover = std::async(std::launch::async, [this, peer = opt.prefill_peer, prefix = std::move(prefix),
                                                 mode = opt.handover, ns = p.cache_namespace]() {
      struct Wake {  // however the call ends, the scheduler looks again
        Impl* m;
        ~Wake() {
          std::lock_guard<std::mutex> lock(m->mu);
          m->handover_arrived = true;
          m->cv.notify_all();
        }
      } wake{this};
      return peer->prefill(prefix, mode, ns);
    });
  }
  return !r.handover.valid() || r.handover.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

// A prefill server's request, after its prompt: the state as entry bytes for the final event.
void Engine::Impl::export_prompt_state(Request& r) {
  CacheEntry e = export_state(*model, r.params.prompt, r.session->state(), *r.params.export_state);
  e.cache_namespace = r.params.cache_namespace;  // the decode server restores it in the same namespace
  r.exported = std::make_shared<const std::vector<uint8_t>>(encode_cache_entry(e, "the prompt's state"));
}

// One request's part of a step before the step's forward: its handover and cache restore when it
// starts, then where it stands. A request whose prompt the cache or a prefill server supplied whole
// takes its first token from the restored logits here.
Engine::Impl::Stage Engine::Impl::prepare(Request& r) {
  if (!r.session && opt.prefill_peer) {
    if (!await_handover(r)) return Stage::Waiting;
    std::optional<CacheEntry> entry;
    if (r.handover.valid()) {
      std::string why;
      try {
        const std::vector<uint8_t> bytes = r.handover.get();
        {
          std::lock_guard<std::mutex> lock(mu);
          stats.handover_bytes += bytes.size();
        }
        entry = decode_cache_entry(bytes.data(), bytes.size(), model->fingerprint(), "the prefill server's handover", &why);
      } catch (const std::exception& e) {
        why = e.what();
      }
      if (!entry) {
        std::lock_guard<std::mutex> lock(mu);
        ++stats.handover_fallbacks;
        log("request " + std::to_string(r.id) + ": no state from the prefill server (" + why + "); prefilling here");
      }
    }
    start(r, entry ? &*entry : nullptr);
  }
  if (!r.session && !opt.prefill_peer && waits_for_shared_prefix(r)) return Stage::Waiting;
  if (!r.session) start(r);
  if (r.session->prefill_pending()) return Stage::Prefilling;
  if (!r.started) {
    first_token(r);
    return Stage::Waiting;
  }
  return Stage::Decoding;
}

// A request whose prompt shares a long prefix with a prompt being prefilled now, past what the
// cache can restore, waits until that prefill has stored its state where the two part (asked for
// here), and then restores it instead of computing the same rows beside it: agents that arrive
// together with one system prompt compute it once. (Exact mode needs the state at that very
// boundary; prompts with images and requests that do not cache start at once.)
bool Engine::Impl::waits_for_shared_prefix(Request& r) {
  if (r.waits_for != 0) {  // decided at an earlier step: only whether that prefill has got there yet
    for (const auto& qp : running) {
      const Request& q = *qp;
      if (q.id == r.waits_for && !q.finished && q.session && q.session->prefill_pending() &&
          q.session->position() < r.waits_until) {
        return true;
      }
    }
    r.waits_for = 0;  // it stored the state there (or ended): the request starts with what the cache holds
    return false;
  }
  const RequestParams& p = r.params;
  if (cache->mode() != CacheMode::Exact || !r.image_starts.empty() || p.index_keys != IndexKeysMode::Owner ||
      p.prefill_mode != PrefillMode::Exact) {
    return false;
  }
  const int64_t limit = PrefixCache::usable_boundary(static_cast<int64_t>(p.prompt.size()));
  const int64_t cached = cache->ram_hit_tokens(p.prompt, p.cache_namespace);
  for (const auto& qp : running) {
    const Request& q = *qp;
    if (&q == &r || q.finished || !q.session || !q.session->prefill_pending() || !q.image_starts.empty() ||
        q.params.cache_namespace != p.cache_namespace) {
      continue;
    }
    const std::vector<int32_t>& o = q.params.prompt;
    const size_t n = std::min(p.prompt.size(), o.size());
    const int64_t same = std::mismatch(p.prompt.begin(), p.prompt.begin() + static_cast<std::ptrdiff_t>(n), o.begin()).first - p.prompt.begin();
    const int64_t common = std::min(same, limit) / kTokensPerPage * kTokensPerPage;
    if (common > cached && q.session->store_also_at(common)) {
      r.waits_for = q.id;
      r.waits_until = common;
      return true;
    }
  }
  return false;
}

// After the prompt: the first token comes from the prefill's logits (a prefill-only request ends).
void Engine::Impl::first_token(Request& r) {
  r.started = true;
  if (r.params.max_tokens == 0) {
    if (r.params.export_state) export_prompt_state(r);
    finish(r, FinishReason::Length);
    return;
  }
  sample_and_emit(r, r.session->last_logits(), model->config().vocab_size);
}

void Engine::Impl::count_speculation(const SpeculativeStats& before, const SpeculativeStats& after) {
  std::lock_guard<std::mutex> lock(mu);
  stats.spec_verify_steps += static_cast<uint64_t>(after.steps - before.steps);
  stats.spec_draft_tokens += static_cast<uint64_t>(after.proposed - before.proposed);
  stats.spec_accepted_tokens += static_cast<uint64_t>(after.accepted - before.accepted);
  stats.spec_guard_pauses += static_cast<uint64_t>(after.guard_pauses - before.guard_pauses);
  for (size_t k = 0; k < after.accepted_per_position.size() && k < stats.spec_accepted_per_position.size(); ++k) {
    stats.spec_accepted_per_position[k] +=
        static_cast<uint64_t>(after.accepted_per_position[k] - before.accepted_per_position[k]);
  }
}

void Engine::Impl::step() {
  const int64_t V = model->config().vocab_size;
  // One forward per step: the prompt chunks of the sequences still prefilling and the rows of every
  // sequence ready to decode (plain ones with their newest token, speculating ones with it and their
  // drafts) run together, so every weight-streaming part, the experts included, reads its weights
  // once for all of them; row by row each computes what it would alone. While some sequence decodes,
  // the prompt rows are what the step budget allows, so its tokens keep coming; with nobody decoding,
  // a prompt runs prefill_chunk rows a step. The prompts share those rows in the order of admission
  // (under the priority policy, the lowest priority first).
  // What fails for one request before the forward (its cache restore, its drafting, its sink) ends
  // that request alone; prompt-cache disk problems never get here (the cache skips or recomputes).
  std::vector<Request*> prefilling, decoding;
  for (auto& rp : running) {
    Request& r = *rp;
    if (r.finished) continue;
    try {
      const Stage stage = prepare(r);
      if (stage == Stage::Prefilling) prefilling.push_back(&r);
      if (stage == Stage::Decoding) decoding.push_back(&r);
    } catch (const std::exception& e) {
      fail_request(r, e);
    }
  }
  std::vector<Request*> planned;
  std::vector<Session*> sessions;
  std::vector<SpeculativeStats> before(decoding.size());
  int64_t other_rows = 0;
  for (Request* rp : decoding) {
    Request& r = *rp;
    try {
      if (r.spec) {
        // drafts only where every token they could yield is still wanted: the sequence never runs
        // past prompt + max_tokens, which admission reserved and the context allows
        const int64_t room = r.params.max_tokens - r.generated - 1;
        before[planned.size()] = r.spec->stats();
        r.spec->plan(r.last, static_cast<int>(std::min<int64_t>(room, drafter->block_size())));
      } else {
        r.session->plan_decode(r.last);
      }
      planned.push_back(&r);
      sessions.push_back(r.session.get());
    } catch (const std::exception& e) {  // drafting failed: this request only
      fail_request(r, e);
    }
  }
  const size_t decoders = planned.size();
  if (opt.scheduling == SchedulingPolicy::Priority) {  // running holds them in order of admission
    std::stable_sort(prefilling.begin(), prefilling.end(),
                     [](const Request* a, const Request* b) { return a->params.priority < b->params.priority; });
  }
  for (Session* session : sessions) other_rows += session->planned_rows();
  int64_t prompt_rows = 0;
  const int64_t allowed_rows = step_budget.prompt_rows(other_rows);
  for (Request* rp : prefilling) {
    if (prompt_rows >= allowed_rows) break;
    Request& r = *rp;
    try {
      prompt_rows += r.session->plan_prefill(allowed_rows - prompt_rows);
      planned.push_back(&r);
      sessions.push_back(r.session.get());
    } catch (const std::exception& e) {
      fail_request(r, e);
    }
  }
  if (planned.empty()) return;
  // The plain constrained sequences' masks depend only on the tokens they have: computed on a thread
  // of their own while the forward runs, so they add nothing to the step. (A verification's depend on
  // the drafts it accepts: computed after it.)
  std::vector<Request*> masking;
  for (size_t i = 0; i < decoders; ++i) {
    Request* r = planned[i];
    if (r->grammar && r->constrained && !r->spec) masking.push_back(r);
  }
  std::future<void> masks;
  if (!masking.empty()) {
    masks = std::async(std::launch::async, [this, &masking] {
      for (Request* r : masking) {
        compute_allowed(*r, *r->grammar);
        r->allowed_ready = true;
      }
    });
  }
  const auto began = std::chrono::steady_clock::now();
  try {
    Session::run_planned(sessions);
  } catch (const std::exception& e) {  // one forward for the whole batch: it fails the batch, nobody else
    if (masks.valid()) masks.get();
    for (Request* r : planned) fail_request(*r, e);
    return;
  }
  step_budget.observe(prompt_rows, other_rows, std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count());
  if (masks.valid()) masks.get();
  {
    std::lock_guard<std::mutex> lock(mu);
    if (decoders > 0) ++stats.decode_forwards_total;
    if (decoders > 0 && prompt_rows > 0) ++stats.mixed_forwards_total;
    stats.step_budget_seconds = step_budget.budget_seconds();
  }
  for (size_t i = decoders; i < planned.size(); ++i) {
    Request& r = *planned[i];
    try {
      if (r.params.prefill_progress) {
        r.params.prefill_progress(r.session->position(), static_cast<int64_t>(r.params.prompt.size()));
      }
      if (!r.session->prefill_pending()) first_token(r);
    } catch (const std::exception& e) {
      fail_request(r, e);
    }
  }
  for (size_t i = 0; i < decoders; ++i) {
    Request& r = *planned[i];
    try {
      if (!r.spec) {
        sample_and_emit(r, r.session->planned_result().logits, V);
        continue;
      }
      const SpeculativeDecoder::Step st = r.spec->finish();
      count_speculation(before[i], r.spec->stats());
      for (size_t k = 0; k < st.tokens.size(); ++k) {
        if (!emit(r, st.tokens[k], &st.rows[k * static_cast<size_t>(V)])) break;
        follow_grammar(r, st.tokens[k]);
        if (r.finished) break;
      }
    } catch (const std::exception& e) {
      fail_request(r, e);
    }
  }
}

void Engine::Impl::sample_and_emit(Request& r, const std::vector<float>& logits, int64_t V) {
  const float* row = logits.data();
  if (r.grammar && r.constrained) {
    r.masked.assign(logits.begin(), logits.end());
    if (!r.allowed_ready) compute_allowed(r, *r.grammar);
    r.allowed_ready = false;
    for (size_t i = 0; i < r.masked.size(); ++i) {
      if (!(r.allowed[i >> 6] >> (i & 63) & 1)) r.masked[i] = -INFINITY;
    }
    if (std::all_of(r.allowed.begin(), r.allowed.end(), [](uint64_t w) { return w == 0; })) {
      finish(r, FinishReason::Error, "no token of the vocabulary continues the output's grammar here");
      return;
    }
    row = r.masked.data();
  }
  const int32_t sampled = r.sampler->sample(row, V);
  const int32_t token = r.generated < static_cast<int64_t>(r.params.forced_output.size())
                            ? r.params.forced_output[static_cast<size_t>(r.generated)]
                            : sampled;
  if (emit(r, token, logits.data())) follow_grammar(r, token);
}

// Sets the logits of the tokens the request's grammar does not allow after `ahead` (tokens produced
// but not yet followed: a verification's accepted drafts) to -inf. Nothing is masked before the
// grammar starts (grammar_after).
void Engine::Impl::mask_to_grammar(Request& r, const std::vector<int32_t>& ahead, std::vector<float>& row) {
  bool on = r.constrained;
  std::optional<GrammarMatcher> after;
  for (const int32_t t : ahead) {
    if (!on) {
      on = t == r.params.grammar_after;
      continue;
    }
    if (!after) after.emplace(*r.grammar);
    if (!after->feed(grammar_vocab->bytes(t))) {  // past a token the grammar refuses: nothing is allowed
      std::fill(row.begin(), row.end(), -INFINITY);
      return;
    }
  }
  if (!on) return;
  compute_allowed(r, after ? *after : *r.grammar);
  for (size_t i = 0; i < row.size(); ++i) {
    if (!(r.allowed[i >> 6] >> (i & 63) & 1)) row[i] = -INFINITY;
  }
}

// The tokens the grammar allows at `at`, into r.allowed.
void Engine::Impl::compute_allowed(Request& r, const GrammarMatcher& at) {
  // the end may come once the value is whole (unless the request ignores it: then only more value)
  const int32_t end = r.params.ignore_eos ? -1 : static_cast<int32_t>(model->config().eos_token_id);
  grammar_vocab->allowed(at, end, r.allowed, r.mask_scratch);
}

// A constrained request after its token: the grammar starts at grammar_after, follows every token
// after it, and ends the request when the value is whole.
void Engine::Impl::follow_grammar(Request& r, int32_t token) {
  if (!r.grammar) return;
  if (!r.constrained) {
    r.constrained = token == r.params.grammar_after;
    return;
  }
  if (!r.grammar->feed(grammar_vocab->bytes(token))) {
    // not a token the mask allowed: only a grammar whose every continuation the vocabulary lacks
    finish(r, FinishReason::Error, "the output left its grammar");
    return;
  }
  if (r.grammar->finished()) {
    r.output->end();
    finish(r, FinishReason::Stop);
  }
}

void Engine::Impl::loop() {
  for (;;) {
    std::vector<uint64_t> cancel_now;
    std::vector<std::unique_ptr<Request>> cancelled_queued;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stopping || !queue.empty() || !cancels.empty() || !running.empty(); });
      if (stopping) break;
      cancel_now.swap(cancels);
      // cancelled while still queued: taken out here, told once the lock is released (finish() takes
      // it, and a submit() meanwhile may grow the queue, which would invalidate an iterator held on it)
      for (auto it = queue.begin(); it != queue.end();) {
        if (std::find(cancel_now.begin(), cancel_now.end(), (*it)->id) != cancel_now.end()) {
          cancelled_queued.push_back(std::move(*it));
          it = queue.erase(it);
        } else {
          ++it;
        }
      }
      admit_locked();
      stats.requests_queued = queue.size();
      step_began = std::chrono::steady_clock::now();
    }
    for (auto& r : cancelled_queued) finish(*r, FinishReason::Cancelled);
    for (auto& r : running) {
      if (!r->finished && std::find(cancel_now.begin(), cancel_now.end(), r->id) != cancel_now.end()) {
        finish(*r, FinishReason::Cancelled);
      }
    }
    try {
      step();
    } catch (const std::exception& e) {  // not tied to one request (step() attributes those itself)
      log(std::string("step failed for the whole batch: ") + e.what());
      for (auto& r : running) {
        if (!r->finished) finish(*r, FinishReason::Error, client_error(e));
      }
    }
    const size_t batch = running.size();
    running.erase(std::remove_if(running.begin(), running.end(),
                                 [&](const std::unique_ptr<Request>& r) {
                                   if (r->finished) reserved -= r->reserved_bytes;
                                   if (r->finished && r->handover.valid()) abandoned.push_back(std::move(r->handover));
                                   return r->finished;
                                 }),
                  running.end());
    abandoned.erase(std::remove_if(abandoned.begin(), abandoned.end(),
                                   [](const auto& f) { return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }),
                    abandoned.end());
    // Every running request waits for its prefill server: sleep until one answers or news comes (the
    // answer's wake-up can come just before its future is ready, hence the bound on the sleep).
    const bool only_waiting = !running.empty() && std::all_of(running.begin(), running.end(), [](const auto& r) {
      return !r->session && r->handover.valid() &&
             r->handover.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
    });
    std::unique_lock<std::mutex> lock(mu);
    if (only_waiting) {
      cv.wait_for(lock, std::chrono::milliseconds(2),
                  [&] { return stopping || handover_arrived || !queue.empty() || !cancels.empty(); });
    }
    handover_arrived = false;
    step_began = {};
    ++stats.steps_total;
    stats.last_batch_size = batch;
    stats.requests_running = running.size();
    stats.kv_pages_in_use = pools->pages_in_use();
    stats.cache_pages_in_use = cache->pages_held();
    stats.prompt_cache_ram_blocks = cache->ram_blocks();
    stats.kv_bytes_in_use = pools->bytes_in_use();
    const CacheFolder::Stats disk = cache->disk_stats();
    stats.prompt_cache_disk_files = disk.files;
    stats.prompt_cache_disk_bytes = disk.bytes;
    stats.prompt_cache_evictions = disk.evictions;
    stats.prompt_cache_write_failures = disk.write_failures;
    stats.prompt_cache_disk_full = disk.disk_full;
  }
  // shutting down: everyone still here is told
  for (auto& r : running) {
    if (!r->finished) finish(*r, FinishReason::Cancelled);
  }
  for (auto& r : queue) finish(*r, FinishReason::Cancelled);
  running.clear();
  queue.clear();
}

}  // namespace dsv41
