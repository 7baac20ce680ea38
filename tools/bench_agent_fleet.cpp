#include "bench_agent_fleet.h"
#include "bench_prompts.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "util/error.h"

namespace dsv41 {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// One turn as the client saw it.
struct Turn {
  int session = 0, index = 0;
  Clock::time_point submitted, first, done;
  std::vector<Clock::time_point> tokens;
  int64_t prompt_tokens = 0, cached_tokens = 0, generated = 0;
  int64_t computed_before = 0;  // of its prompt, the tokens the session's earlier turns computed
  std::string error;
};

// Submits one turn and waits for its end.
Turn run_turn(Engine& e, const std::vector<int32_t>& prompt, int64_t answer, std::vector<int32_t>& out) {
  Turn t;
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  RequestParams p;
  p.prompt = prompt;
  p.max_tokens = answer;
  p.ignore_eos = true;
  p.sampling.temperature = 0;
  t.submitted = Clock::now();
  e.submit(std::move(p), [&](const TokenEvent& ev) {
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(mu);
    if (ev.token >= 0) {
      t.tokens.push_back(now);
      out.push_back(ev.token);
    }
    if (ev.done) {
      t.done = now;
      t.prompt_tokens = ev.prompt_tokens;
      t.cached_tokens = ev.cached_tokens;
      t.generated = ev.completion_tokens;
      t.error = ev.error;
      finished = true;
      cv.notify_all();
    }
  });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return finished; });
  if (!t.error.empty()) fail("agent-fleet", "a turn failed: " + t.error);
  t.first = t.tokens.empty() ? t.done : t.tokens.front();
  return t;
}

// One session's turns: the shared system prompt, then each turn's tool output after the history.
std::vector<Turn> run_session(Engine& e, const FleetOptions& f, int session, int64_t vocab) {
  std::mt19937 rng(1000 + static_cast<uint32_t>(session));
  std::vector<int32_t> history = random_prompt(f.system_tokens, vocab, 1);
  std::vector<Turn> turns;
  for (int k = 0; k < f.turns; ++k) {
    const int64_t tool = f.tool_min + static_cast<int64_t>(rng() % static_cast<uint32_t>(f.tool_max - f.tool_min + 1));
    const int64_t answer = (f.answer_tokens + 1) / 2 + static_cast<int64_t>(rng() % static_cast<uint32_t>(f.answer_tokens / 2 + 1));
    const std::vector<int32_t> output = random_prompt(tool, vocab, 7919u * static_cast<uint32_t>(session + 1) + static_cast<uint32_t>(k));
    const int64_t computed_before = k > 0 ? static_cast<int64_t>(history.size()) : 0;  // prompts and answers so far
    history.insert(history.end(), output.begin(), output.end());
    std::vector<int32_t> answered;
    Turn t = run_turn(e, history, answer, answered);
    t.session = session;
    t.index = k;
    t.computed_before = computed_before;
    history.insert(history.end(), answered.begin(), answered.end());
    turns.push_back(std::move(t));
  }
  return turns;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

nlohmann::json summarize(const std::vector<Turn>& turns, double wall, uint64_t steps) {
  std::vector<double> ttft, gaps, latency;
  int64_t prompt = 0, cached = 0, later_prompt = 0, later_cached = 0, generated = 0, first_cached = 0, later_computed = 0;
  for (const Turn& t : turns) {
    ttft.push_back(seconds_between(t.submitted, t.first) * 1e3);
    latency.push_back(seconds_between(t.submitted, t.done));
    for (size_t i = 1; i < t.tokens.size(); ++i) gaps.push_back(seconds_between(t.tokens[i - 1], t.tokens[i]) * 1e3);
    prompt += t.prompt_tokens;
    cached += t.cached_tokens;
    generated += t.generated;
    if (t.index > 0) {
      later_prompt += t.prompt_tokens;
      later_cached += t.cached_tokens;
      later_computed += t.computed_before;
    } else {
      first_cached += t.cached_tokens;  // the shared system prompt, found after the first session's turn
    }
  }
  const auto share = [](int64_t part, int64_t whole) { return whole > 0 ? static_cast<double>(part) / static_cast<double>(whole) : 0.0; };
  return {{"wall_seconds", wall},
          {"ttft_ms", {{"p50", percentile(ttft, 0.5)}, {"p99", percentile(ttft, 0.99)}}},
          {"gap_ms", {{"p50", percentile(gaps, 0.5)}, {"p99", percentile(gaps, 0.99)}, {"max", percentile(gaps, 1.0)}}},
          {"turn_seconds", {{"p50", percentile(latency, 0.5)}, {"p99", percentile(latency, 0.99)}}},
          {"prompt_tokens", prompt},
          {"cached_tokens", cached},
          {"cached_share", share(cached, prompt)},
          {"cached_share_after_first_turn", share(later_cached, later_prompt)},
          // what any cache could serve of those turns: the tokens the session's earlier turns computed
          // (its prompts and answers); the tool outputs are new by nature
          {"computed_share_after_first_turn", share(later_computed, later_prompt)},
          {"first_turn_cached_tokens", first_cached},
          {"generated_tokens", generated},
          {"prompt_tok_s", wall > 0 ? static_cast<double>(prompt - cached) / wall : 0.0},
          {"generated_tok_s", wall > 0 ? static_cast<double>(generated) / wall : 0.0},
          {"steps", steps}};
}

}  // namespace

nlohmann::json bench_agent_fleet(EngineOptions eo, const FleetOptions& f) {
  if (f.sessions < 1 || f.turns < 1) fail("agent-fleet", "needs at least one session and one turn");
  if (f.system_tokens < 1 || f.tool_min < 1 || f.tool_max < f.tool_min || f.answer_tokens < 1)
    fail("--fleet-lengths", "needs SYSTEM >= 1, 1 <= TOOL_MIN <= TOOL_MAX and ANSWER >= 1");
  eo.kv_budget_bytes = uint64_t{1} << 60;  // admission is not what this measures
  eo.cache_ram_bytes = uint64_t{1} << 30;
  nlohmann::json out = {{"sessions", f.sessions},
                        {"turns", f.turns},
                        {"system_tokens", f.system_tokens},
                        {"tool_tokens", {f.tool_min, f.tool_max}},
                        {"answer_tokens", f.answer_tokens},
                        {"stagger_seconds", f.stagger_seconds}};
  for (const bool together : {true, false}) {
    eo.parallel = together ? f.sessions : 1;
    Engine e(eo);  // a fresh prompt cache for each run
    const int64_t vocab = e.config().vocab_size;
    if (f.system_tokens + f.turns * (f.tool_max + f.answer_tokens) > e.config().max_seq_len)
      fail("--fleet-lengths", "a session's history outgrows the model's context of " + std::to_string(e.config().max_seq_len));
    std::vector<std::vector<Turn>> per_session(static_cast<size_t>(f.sessions));
    std::vector<std::string> errors(static_cast<size_t>(f.sessions));
    const Clock::time_point began = Clock::now();
    if (together) {
      std::vector<std::thread> clients;
      for (int s = 0; s < f.sessions; ++s) {
        clients.emplace_back([&, s] {
          std::this_thread::sleep_for(std::chrono::duration<double>(f.stagger_seconds * s));
          try {
            per_session[static_cast<size_t>(s)] = run_session(e, f, s, vocab);
          } catch (const std::exception& x) {
            errors[static_cast<size_t>(s)] = x.what();
          }
        });
      }
      for (std::thread& c : clients) c.join();
      for (const std::string& error : errors) {
        if (!error.empty()) fail("agent-fleet", error);
      }
    } else {
      for (int s = 0; s < f.sessions; ++s) per_session[static_cast<size_t>(s)] = run_session(e, f, s, vocab);
    }
    const double wall = seconds_between(began, Clock::now());
    std::vector<Turn> turns;
    for (auto& v : per_session) turns.insert(turns.end(), v.begin(), v.end());
    out[together ? "fleet" : "one_at_a_time"] = summarize(turns, wall, e.metrics().steps_total);
    std::fprintf(stderr, "  %s: %.1f s\n", together ? "all sessions at once" : "one session at a time", wall);
  }
  out["fleet_wall_over_one_at_a_time"] =
      out["fleet"]["wall_seconds"].get<double>() / out["one_at_a_time"]["wall_seconds"].get<double>();
  return out;
}

}  // namespace dsv41
