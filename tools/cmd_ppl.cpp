// dsv41 ppl: perplexity of a text file, through the Engine like every other command. The tokenized
// text is read in windows of --ctx tokens (BOS first) that start every --stride tokens; each window
// scores its last `stride` tokens, the rest being their context, so every token after the first
// window's context is scored once (with the default stride of half the window, as llama-perplexity
// scores the second half of each chunk). A scored token is fed as the model's output (teacher
// forcing) and its log-probability under the model's logits is summed. Windows run as concurrent
// requests, so their decode steps are batched.
//
// --restore exact|replay measures what a prompt-cache hit costs: each window's context, cut at a whole
// cache block, is first prefilled alone into the engine's prompt cache (a prefill-only request), and
// the scored request then restores it in that mode (exact: the saved windows; replay: the windows
// rebuilt by re-running the last window of tokens before the boundary) before prefilling the rest.
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend_env.h"
#include "cli.h"
#include "commands.h"
#include "runtime/engine.h"
#include "state/state_pools.h"
#include "util/error.h"

namespace dsv41::cli {

namespace {

constexpr const char* kHelp = R"(usage: dsv41 ppl -m DIR -f FILE [options]

  -m, --model DIR        model folder
  -f, --file FILE        the text to score (UTF-8)
      --ctx N            tokens per window, BOS included (default 512)
      --stride S         tokens between windows' starts, and scored per window (default ctx/2)
      --chunks N         score at most N windows (default: all of the text)
      --prefill-mode M   exact (default) or tail: how each window's context is prefilled
      --restore R        exact or replay: each window's context comes from a prompt-cache hit
                         restored this way (default: none, every window prefilled whole)
      --parallel N       chunks run at once (default 4)
      --json             print one JSON object instead of the running figures
      --ram SIZE         memory budget the model's load follows, e.g. 16G (default: the available RAM, or the
                         memory cgroup's limit when lower; above that limit it is refused; `dsv41 plan`
                         shows the plan)
)";

struct Chunk {
  double nll = 0;  // summed over the scored tokens
  int64_t scored = 0;
  bool done = false;
  std::string error;
  int64_t restored = 0, replayed = 0;  // prompt tokens from the cache, and of them re-run (replay)
};

}  // namespace

int run_ppl(int argc, char** argv) {
  if (wants_help(argc, argv)) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  Args args("ppl", argc, argv,
            {"--model", "--file", "--ctx", "--stride", "--chunks", "--parallel", "--prefill-mode", "--restore", "--ram"}, {"--json"},
            {{"-m", "--model"}, {"-f", "--file"}});
  if (!args.positional().empty()) fail(args.positional()[0], "unexpected argument");
  const std::string path = args.required("--file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot be opened");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const int64_t ctx = args.get_int("--ctx", 512, 4, int64_t{1} << 24);
  const int64_t stride = args.get_int("--stride", ctx / 2, 1, ctx - 2);  // at least BOS and one token of context
  const int64_t max_chunks = args.get_int("--chunks", 0, 0, int64_t{1} << 30);
  const std::string mode = args.get("--prefill-mode", "exact");
  if (mode != "exact" && mode != "tail") fail("--prefill-mode", "must be exact or tail, got \"" + mode + "\"");
  const bool json_out = args.has("--json");
  const std::string restore = args.get("--restore", "none");
  if (restore != "none" && restore != "exact" && restore != "replay") {
    fail("--restore", "must be exact or replay, got \"" + restore + "\"");
  }
  const int64_t context = ctx - stride;  // tokens of a window before the scored ones, BOS included
  const int64_t cached = context / kTokensPerPage * kTokensPerPage;  // what a window restores
  if (restore == "exact" && mode == "tail") {  // a tail prefill's windows are not exact: never cached as such
    fail("--restore", "exact needs --prefill-mode exact (a tail-mode context leaves no exact entry to restore)");
  }
  if (restore != "none" && cached == 0) {
    fail("--restore", "needs a context (--ctx minus --stride) of at least one cache block of " +
                          std::to_string(kTokensPerPage) + " tokens, got " + std::to_string(context));
  }

  EngineOptions eo;
  eo.model_dir = args.required("--model");
  eo.parallel = static_cast<int>(args.get_int("--parallel", 4, 1, 4096));
  eo.kv_budget_bytes = uint64_t{1} << 60;  // one job: its chunks are bounded by --parallel
  eo.cache_ram_bytes = 0;                  // chunks share no prefix
  if (restore != "none") {
    eo.cache_ram_bytes = uint64_t{1} << 40;  // every window's context stays until it is restored
    eo.cache_mode = parse_cache_mode(restore);
  }
  eo.ram_bytes = ram_flag(args);
  eo.backend = backend_from_environment();
  eo.log = [](const std::string& line) { std::fprintf(stderr, "dsv41 ppl: warning: %s\n", line.c_str()); };
  Engine engine(eo);
  if (ctx > engine.config().max_seq_len) {
    fail("--ctx", "must be at most the model's context of " + std::to_string(engine.config().max_seq_len));
  }
  const std::vector<int32_t> tokens = engine.tokenizer().encode(text);
  const int64_t per_window = ctx - 1;  // text tokens after BOS
  const int64_t total = static_cast<int64_t>(tokens.size());
  int64_t n_chunks = total < per_window ? 0 : (total - per_window) / stride + 1;
  if (max_chunks > 0) n_chunks = std::min(n_chunks, max_chunks);
  if (n_chunks == 0) {
    fail(path, "has " + std::to_string(tokens.size()) + " tokens, fewer than one chunk of --ctx " + std::to_string(ctx) +
                   " needs (" + std::to_string(per_window) + ")");
  }

  std::mutex mu;
  std::condition_variable cv;
  std::vector<Chunk> chunks(static_cast<size_t>(n_chunks));
  const auto window = [&](int64_t c) {
    std::vector<int32_t> chunk = {static_cast<int32_t>(engine.config().bos_token_id)};
    chunk.insert(chunk.end(), tokens.begin() + c * stride, tokens.begin() + c * stride + per_window);
    return chunk;
  };
  if (restore != "none") {  // every window's cached part first, each a prefill-only request
    std::vector<Chunk> warm(static_cast<size_t>(n_chunks));
    for (int64_t c = 0; c < n_chunks; ++c) {
      const std::vector<int32_t> chunk = window(c);
      RequestParams p;
      p.prefill_mode = mode == "tail" ? PrefillMode::Tail : PrefillMode::Exact;
      p.prompt.assign(chunk.begin(), chunk.begin() + cached);
      p.max_tokens = 0;
      Chunk& out = warm[static_cast<size_t>(c)];
      engine.submit(std::move(p), [&mu, &cv, &out](const TokenEvent& e) {
        if (!e.done) return;
        std::lock_guard<std::mutex> lock(mu);
        out.done = true;
        if (e.finish_reason == FinishReason::Error) out.error = e.error;
        cv.notify_all();
      });
    }
    for (int64_t c = 0; c < n_chunks; ++c) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return warm[static_cast<size_t>(c)].done; });
      if (!warm[static_cast<size_t>(c)].error.empty()) {
        fail("ppl", "chunk " + std::to_string(c) + "'s cached context: " + warm[static_cast<size_t>(c)].error);
      }
    }
  }
  const auto t0 = std::chrono::steady_clock::now();  // (the scored requests, after any cache warm-up)
  for (int64_t c = 0; c < n_chunks; ++c) {
    const std::vector<int32_t> chunk = window(c);
    RequestParams p;
    p.prefill_mode = mode == "tail" ? PrefillMode::Tail : PrefillMode::Exact;
    p.prompt.assign(chunk.begin(), chunk.begin() + context);
    p.forced_output.assign(chunk.begin() + context, chunk.end());
    p.max_tokens = static_cast<int64_t>(p.forced_output.size());
    p.ignore_eos = true;
    p.top_logprobs = 0;  // each event's logprob: the forced token's under the model's logits
    p.speculative = SpeculativeMethod::Off;
    Chunk& out = chunks[static_cast<size_t>(c)];
    engine.submit(std::move(p), [&mu, &cv, &out](const TokenEvent& e) {
      std::lock_guard<std::mutex> lock(mu);
      if (e.token >= 0) {
        out.nll -= e.logprob;
        ++out.scored;
      }
      if (e.done) {
        out.done = true;
        out.restored = e.cached_tokens;
        out.replayed = e.report.replayed_tokens;
        if (e.finish_reason == FinishReason::Error) out.error = e.error;
        cv.notify_all();
      }
    });
  }
  double nll = 0;
  int64_t restored = 0, replayed = 0;
  int64_t scored = 0;
  std::vector<double> chunk_means;  // every chunk scores the same number of tokens
  for (int64_t c = 0; c < n_chunks; ++c) {
    Chunk& ch = chunks[static_cast<size_t>(c)];
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return ch.done; });
    }
    if (!ch.error.empty()) fail("ppl", "chunk " + std::to_string(c) + ": " + ch.error);
    nll += ch.nll;
    scored += ch.scored;
    restored += ch.restored;
    replayed += ch.replayed;
    chunk_means.push_back(ch.nll / static_cast<double>(std::max<int64_t>(ch.scored, 1)));
    if (!json_out) std::fprintf(stderr, "[%lld] %.4f\n", static_cast<long long>(c + 1), std::exp(nll / static_cast<double>(scored)));
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double mean = nll / static_cast<double>(scored);
  // the uncertainty of the mean NLL from the spread of the chunks' means (the chunks are the samples)
  double var = 0;
  for (double m : chunk_means) var += (m - mean) * (m - mean);
  const double stderr_nll = n_chunks > 1 ? std::sqrt(var / static_cast<double>(n_chunks - 1) / static_cast<double>(n_chunks)) : 0.0;
  const double ppl = std::exp(mean);
  if (json_out) {
    nlohmann::json j = {{"ppl", ppl},
                        {"mean_nll", mean},
                        {"ppl_stderr", ppl * stderr_nll},
                        {"chunks", n_chunks},
                        {"ctx", ctx},
                        {"stride", stride},
                        {"prefill_mode", mode},
                        {"restore", restore},
                        {"restored_tokens", restored},
                        {"replayed_tokens", replayed},
                        {"tokens_scored", scored},
                        {"seconds", secs},
                        {"scored_tok_s", static_cast<double>(scored) / secs}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("perplexity %.4f +/- %.4f over %lld tokens in %lld chunks of %lld (%.1f s)\n", ppl, ppl * stderr_nll,
                static_cast<long long>(scored), static_cast<long long>(n_chunks), static_cast<long long>(ctx), secs);
    if (restore != "none") {
      std::printf("contexts restored from the prompt cache (%s): %lld tokens, %lld of them replayed\n",
                  restore.c_str(), static_cast<long long>(restored), static_cast<long long>(replayed));
    }
  }
  return 0;
}

}  // namespace dsv41::cli
