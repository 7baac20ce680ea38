// The engine behind the server: requests run concurrently under one scheduler and each gets exactly
// what it would get alone; memory admission queues instead of failing; cancellation frees pages.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <thread>
#include <mutex>
#include <random>
#include <stdexcept>

#include "kernels/backend.h"
#include "runtime/engine.h"
#include "runtime/output_text.h"
#include "runtime/step_budget.h"
#include "engine_util.h"
#include "test_util.h"
#include "util/error.h"

namespace dsv41 {
namespace {

RequestParams request(int prompt_len, uint32_t seed, int max_tokens) {
  RequestParams p;
  p.prompt = ids(prompt_len, seed);
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  p.sampling.seed = seed;
  p.sampling.temperature = seed % 2 ? 0.0 : 0.8;
  return p;
}

// Two engines in one process, on backends of different kernel levels and thread counts, serve at the
// same time and give the same tokens: each owns what its kernels run on, and every level computes
// the same bits.
TEST(Engine, TwoEnginesOnDifferentBackendsServeAtOnce) {
  EngineOptions a, b;
  a.model_dir = b.model_dir = test::tiny_model_dir();
  a.backend = make_backend({Isa::scalar, 1, true});
  b.backend = make_backend({detected_isa(), 2, true});
  Engine ea(a), eb(b);
  std::vector<std::unique_ptr<Collected>> ca, cb;
  for (uint32_t i = 0; i < 4; ++i) {
    ca.push_back(std::make_unique<Collected>());
    cb.push_back(std::make_unique<Collected>());
    ea.submit(request(20 + 41 * static_cast<int>(i), i, 10), collect(*ca.back()));
    eb.submit(request(20 + 41 * static_cast<int>(i), i, 10), collect(*cb.back()));
  }
  for (uint32_t i = 0; i < 4; ++i) {
    wait(*ca[i]);
    wait(*cb[i]);
    EXPECT_EQ(ca[i]->last.finish_reason, FinishReason::Length);
    ASSERT_EQ(ca[i]->tokens.size(), 10u);
    EXPECT_EQ(ca[i]->tokens, cb[i]->tokens) << "request " << i << ": scalar x1 and " << b.backend->name() << " x2";
  }
}

TEST(Engine, ConcurrentRequestsGetWhatTheyGetAlone) {
  EngineOptions opt;
  opt.model_dir = test::tiny_model_dir();
  opt.parallel = 4;
  opt.prefill_chunk = 32;  // long prompts prefill over several steps, interleaved with decodes
  std::vector<std::vector<int32_t>> alone;
  {
    Engine e(opt);
    for (uint32_t i = 0; i < 6; ++i) {
      Collected c;
      e.submit(request(10 + 37 * static_cast<int>(i), i, 12), collect(c));
      wait(c);
      alone.push_back(c.tokens);
    }
  }
  Engine e(opt);
  std::vector<std::unique_ptr<Collected>> cs;
  for (uint32_t i = 0; i < 6; ++i) {
    cs.push_back(std::make_unique<Collected>());
    e.submit(request(10 + 37 * static_cast<int>(i), i, 12), collect(*cs.back()));
  }
  for (uint32_t i = 0; i < 6; ++i) {
    wait(*cs[i]);
    EXPECT_EQ(cs[i]->tokens, alone[i]) << "request " << i;
    EXPECT_EQ(cs[i]->last.finish_reason, FinishReason::Length);
    EXPECT_EQ(cs[i]->last.completion_tokens, 12);
  }
  EXPECT_GE(e.metrics().requests_finished, 6u);
}

// Admission reserves each request's worst case (prompt + max_tokens + one page of tokens, at the
// model's 106 B/token of global KV): (300 + 8 + 64) × 106 B = 39 KB, so two never fit the 60 KiB
// budget together. All five requests must still finish, with all their tokens and the tokens they
// get alone, but strictly one after another in submission order: every event of request i comes
// before any of request i + 1.
TEST(Engine, ShortMemoryQueuesRequestsInsteadOfFailingThem) {
  EngineOptions opt;
  opt.model_dir = test::tiny_model_dir();
  opt.parallel = 8;
  opt.kv_budget_bytes = 60 * 1024;  // room for one request at a time
  opt.cache_ram_bytes = 0;
  std::vector<std::vector<int32_t>> alone;
  {
    EngineOptions roomy = opt;
    roomy.kv_budget_bytes = uint64_t{1} << 30;
    Engine e(roomy);
    for (uint32_t i = 0; i < 5; ++i) {
      Collected c;
      e.submit(request(300, i, 8), collect(c));
      wait(c);
      alone.push_back(c.tokens);
    }
  }
  Engine e(opt);
  std::mutex order_mu;
  std::vector<uint32_t> order;  // the request of every event, in the order the sinks saw them
  std::vector<std::unique_ptr<Collected>> cs;
  for (uint32_t i = 0; i < 5; ++i) {
    cs.push_back(std::make_unique<Collected>());
    EventSink sink = collect(*cs.back());
    e.submit(request(300, i, 8), [&order_mu, &order, i, sink](const TokenEvent& ev) {
      {
        std::lock_guard<std::mutex> lock(order_mu);
        order.push_back(i);
      }
      sink(ev);
    });
  }
  for (uint32_t i = 0; i < 5; ++i) {
    wait(*cs[i]);
    EXPECT_EQ(cs[i]->last.finish_reason, FinishReason::Length) << i;
    EXPECT_EQ(cs[i]->last.completion_tokens, 8) << i;
    EXPECT_EQ(cs[i]->tokens, alone[i]) << "request " << i;
  }
  {
    std::lock_guard<std::mutex> lock(order_mu);
    EXPECT_TRUE(std::is_sorted(order.begin(), order.end())) << "requests ran interleaved";
    EXPECT_EQ(order.size(), 5u * 9u);  // 8 tokens + the final event each
  }
  EXPECT_EQ(e.metrics().requests_finished, 5u);
  EXPECT_EQ(e.metrics().requests_failed, 0u);
  EXPECT_THROW(e.submit(request(600, 9, 8), [](const TokenEvent&) {}), Error);  // over the whole budget
}

TEST(Engine, CancellingFreesThePages) {
  EngineOptions opt;
  opt.model_dir = test::tiny_model_dir();
  opt.cache_ram_bytes = 0;  // nothing kept after a request ends
  Engine e(opt);
  Collected c;
  std::atomic<bool> first{false};
  const uint64_t id = e.submit(request(200, 3, 2000), [&](const TokenEvent& ev) {
    if (ev.token >= 0) first = true;
    collect(c)(ev);
  });
  while (!first) std::this_thread::yield();
  e.cancel(id);
  wait(c);
  EXPECT_EQ(c.last.finish_reason, FinishReason::Cancelled);
  for (int i = 0; i < 100 && e.metrics().kv_pages_in_use != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(e.metrics().kv_pages_in_use, 0u);
  EXPECT_EQ(e.metrics().requests_cancelled, 1u);
}

// A queued request's cancellation is reported (its sink called) while more requests arrive: the
// scheduler must not hold an iterator into the queue across that call, since submit() may grow the
// queue meanwhile (a std::deque's push_back can move its node map; ASan saw the freed one being read).
TEST(Engine, QueuedRequestsCancelledWhileOthersArrive) {
  EngineOptions opt;
  opt.model_dir = test::tiny_model_dir();
  opt.parallel = 1;  // the long request below holds the only slot: everything after it waits queued
  opt.cache_ram_bytes = 0;
  Engine e(opt);
  Collected busy;
  std::atomic<bool> first{false};
  const uint64_t busy_id = e.submit(request(20, 1, 2000), [&](const TokenEvent& ev) {
    if (ev.token >= 0) first = true;
    collect(busy)(ev);
  });
  while (!first) std::this_thread::yield();

  std::mutex mu;
  std::condition_variable cv;
  bool in_sink = false, flooded = false;
  Collected a, b;
  const uint64_t a_id = e.submit(request(10, 2, 4), [&](const TokenEvent& ev) {
    if (ev.done) {  // the scheduler tells of the cancellation: hold it here until the flood is queued
      std::unique_lock<std::mutex> lock(mu);
      in_sink = true;
      cv.notify_all();
      cv.wait(lock, [&] { return flooded; });
    }
    collect(a)(ev);
  });
  e.submit(request(10, 3, 4), collect(b));
  constexpr int kFlood = 1000;  // enough queued requests to make the deque grow its node map
  std::atomic<int> flood_done{0};
  std::vector<uint64_t> flood_ids;
  std::thread flood([&] {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return in_sink; });
    }
    for (int i = 0; i < kFlood; ++i) {
      flood_ids.push_back(e.submit(request(1, 10 + static_cast<uint32_t>(i), 1), [&](const TokenEvent& ev) {
        if (ev.done) ++flood_done;
      }));
    }
    std::lock_guard<std::mutex> lock(mu);
    flooded = true;
    cv.notify_all();
  });
  e.cancel(a_id);
  flood.join();
  wait(a);
  EXPECT_EQ(a.last.finish_reason, FinishReason::Cancelled);
  for (uint64_t id : flood_ids) e.cancel(id);  // still queued behind the long request
  while (flood_done < kFlood) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  e.cancel(busy_id);
  wait(busy);
  wait(b);
  EXPECT_EQ(busy.last.finish_reason, FinishReason::Cancelled);
  EXPECT_EQ(b.last.finish_reason, FinishReason::Length);
  EXPECT_EQ(e.metrics().requests_cancelled, kFlood + 2u);
}

TEST(Engine, StopStringsEndGenerationBeforeThem) {
  EngineOptions opt;
  opt.model_dir = test::tiny_model_dir();
  Engine e(opt);
  Collected full;
  e.submit(request(20, 5, 40), collect(full));
  wait(full);
  ASSERT_GT(full.text.size(), 12u);
  const std::string stop = full.text.substr(8, 3);
  RequestParams p = request(20, 5, 40);
  p.stop = {stop, "\x01never"};
  Collected cut;
  e.submit(p, collect(cut));
  wait(cut);
  EXPECT_EQ(cut.last.finish_reason, FinishReason::Stop);
  EXPECT_EQ(cut.text, full.text.substr(0, full.text.find(stop)));
}

TEST(Engine, RepeatedPromptsHitThePrefixCache) {
  EngineOptions opt;
  opt.model_dir = test::tiny_model_dir();
  Engine e(opt);
  Collected a, b;
  e.submit(request(300, 6, 4), collect(a));
  wait(a);
  e.submit(request(300, 6, 4), collect(b));
  wait(b);
  EXPECT_EQ(a.last.cached_tokens, 0);
  EXPECT_EQ(b.last.cached_tokens, 256);
  EXPECT_EQ(a.tokens, b.tokens);  // exact mode: bit-identical
}

RequestParams greedy(int prompt_len, uint32_t seed, int max_tokens) {
  RequestParams p = request(prompt_len, seed, max_tokens);
  p.sampling.temperature = 0;
  return p;
}

// What the engine logs for the operator, kept for a test to read (the log is called on the scheduler
// thread while the test thread reads).
struct Logged {
  std::mutex mu;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& line) {
      std::lock_guard<std::mutex> lock(mu);
      lines.push_back(line);
    };
  }
  size_t count(const std::string& part) {
    std::lock_guard<std::mutex> lock(mu);
    const auto has = [&](const std::string& l) { return l.find(part) != std::string::npos; };
    return static_cast<size_t>(std::count_if(lines.begin(), lines.end(), has));
  }
};

size_t cache_files(const std::string& folder) {
  std::error_code ec;
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(folder, ec)) n += e.path().extension() == ".dsv41kv";
  return n;
}

// The prompt-cache folder is replaced by a regular file while requests run, so every store fails.
// The cache is an optimisation: each request still completes with the tokens a cacheless engine
// gives, the failures are counted and logged once, clients hear nothing of server paths, and the
// cache stores again as soon as the folder can be made again.
TEST(Engine, PromptCacheWriteFailuresFailNoRequest) {
  EngineOptions opt;
  opt.model_dir = test::tiny_model_dir();
  opt.prefill_chunk = 32;  // the long prompts prefill over several steps, beside the short one's decodes
  const std::vector<RequestParams> params = {greedy(10, 13, 30), greedy(150, 11, 8), greedy(150, 12, 8),
                                             greedy(140, 14, 4), greedy(140, 15, 4)};  // each long one stores 128
  std::vector<std::vector<int32_t>> alone;
  {
    Engine e(opt);  // no prompt-cache folder
    for (const RequestParams& p : params) {
      Collected c;
      e.submit(p, collect(c));
      wait(c);
      alone.push_back(c.tokens);
    }
  }
  test::TempDir dir;
  const std::string folder = dir / "prompt-cache";
  Logged logged;
  opt.prompt_cache_dir = folder;
  opt.log = logged.sink();
  Engine e(opt);
  std::vector<std::unique_ptr<Collected>> cs;
  for (size_t i = 0; i < params.size(); ++i) cs.push_back(std::make_unique<Collected>());
  std::atomic<bool> broken{false};
  // on the short request's first token, on the scheduler thread: the folder becomes a file
  e.submit(params[0], [&](const TokenEvent& ev) {
    if (ev.token >= 0 && !broken) {
      std::filesystem::remove_all(folder);
      std::ofstream(folder) << "not a folder";
      broken = true;
    }
    collect(*cs[0])(ev);
  });
  while (!broken) std::this_thread::yield();
  e.submit(params[1], collect(*cs[1]));
  e.submit(params[2], collect(*cs[2]));
  for (size_t i = 0; i < 3; ++i) {
    wait(*cs[i]);
    EXPECT_EQ(cs[i]->last.finish_reason, FinishReason::Length) << i;
    EXPECT_EQ(cs[i]->last.error, "") << i;
    EXPECT_EQ(cs[i]->last.error.find(folder), std::string::npos) << i;
    EXPECT_EQ(cs[i]->tokens, alone[i]) << "request " << i;
  }
  EXPECT_EQ(e.metrics().prompt_cache_write_failures, 2u);
  EXPECT_EQ(e.metrics().requests_failed, 0u);
  EXPECT_EQ(logged.count("without storing their prefixes on disk"), 1u);
  EXPECT_EQ(logged.count(folder), 1u);  // the operator's log names the folder, once

  // The file is removed: the next store makes the folder again and writes into it.
  std::filesystem::remove(folder);
  e.submit(params[3], collect(*cs[3]));
  wait(*cs[3]);
  EXPECT_EQ(cs[3]->last.finish_reason, FinishReason::Length);
  EXPECT_EQ(cs[3]->tokens, alone[3]);
  EXPECT_EQ(cache_files(folder), 1u);
  EXPECT_EQ(logged.count("prompt-cache writes work again"), 1u);
  EXPECT_EQ(e.metrics().prompt_cache_write_failures, 2u);
  EXPECT_EQ(e.metrics().prompt_cache_disk_files, 1u);
  EXPECT_GT(e.metrics().prompt_cache_disk_bytes, 0u);
  // Removed outright (an operator clearing the cache): made again as well, with no failure at all.
  std::filesystem::remove_all(folder);
  e.submit(params[4], collect(*cs[4]));
  wait(*cs[4]);
  EXPECT_EQ(cs[4]->tokens, alone[4]);
  EXPECT_EQ(cache_files(folder), 1u);
  EXPECT_EQ(e.metrics().prompt_cache_write_failures, 2u);
  EXPECT_EQ(e.metrics().prompt_cache_disk_files, 1u);
}

// A cache file gone bad between two server runs is skipped: the request gets the cold tokens, the
// file is logged once, and the recompute stores a good one again.
TEST(Engine, ABadCacheFileOnlySkipsTheCache) {
  test::TempDir dir;
  EngineOptions opt;
  opt.model_dir = test::tiny_model_dir();
  opt.prompt_cache_dir = dir / "cache";
  const RequestParams p = greedy(300, 21, 6);
  std::vector<int32_t> cold;
  {
    Engine e(opt);
    Collected c;
    e.submit(p, collect(c));
    wait(c);
    cold = c.tokens;
  }
  ASSERT_EQ(cache_files(opt.prompt_cache_dir), 1u);
  for (const auto& f : std::filesystem::directory_iterator(opt.prompt_cache_dir)) {
    std::filesystem::resize_file(f.path(), std::filesystem::file_size(f.path()) - 3);  // truncated
  }
  Logged logged;
  opt.log = logged.sink();
  Engine e(opt);
  EXPECT_EQ(logged.count("truncated"), 1u);  // found by the scan at start
  for (int i = 0; i < 2; ++i) {
    Collected c;
    e.submit(p, collect(c));
    wait(c);
    EXPECT_EQ(c.last.finish_reason, FinishReason::Length);
    EXPECT_EQ(c.tokens, cold);
    EXPECT_EQ(c.last.cached_tokens, i == 0 ? 0 : 256);  // the second from the RAM tier
  }
  EXPECT_EQ(logged.count("truncated"), 1u);
  EXPECT_EQ(cache_files(opt.prompt_cache_dir), 1u);
  EXPECT_EQ(e.metrics().requests_failed, 0u);
}

// A request that fails while running (here its own sink throws at its first token) ends alone: the
// requests beside it in the batch go on to the tokens they get alone. Its client is told in general
// terms; the log has the cause.
TEST(Engine, AFailingRequestEndsAlone) {
  EngineOptions opt;
  opt.model_dir = test::tiny_model_dir();
  std::vector<std::vector<int32_t>> alone;
  {
    Engine e(opt);
    for (uint32_t seed : {31u, 32u}) {
      Collected c;
      e.submit(greedy(40, seed, 24), collect(c));
      wait(c);
      alone.push_back(c.tokens);
    }
  }
  Logged logged;
  opt.log = logged.sink();
  Engine e(opt);
  Collected a, b, bad;
  std::atomic<int> a_tokens{0};
  e.submit(greedy(40, 31, 24), [&](const TokenEvent& ev) {
    a_tokens += ev.token >= 0;
    collect(a)(ev);
  });
  e.submit(greedy(40, 32, 24), collect(b));
  while (a_tokens < 2) std::this_thread::yield();  // both are decoding when the third arrives
  const uint64_t bad_id = e.submit(greedy(20, 33, 24), [&](const TokenEvent& ev) {
    if (ev.token >= 0) throw std::runtime_error("the client's connection broke");
    collect(bad)(ev);
  });
  wait(bad);
  wait(a);
  wait(b);
  EXPECT_EQ(bad.last.finish_reason, FinishReason::Error);
  EXPECT_FALSE(bad.last.error.empty());
  EXPECT_EQ(bad.last.error.find("connection broke"), std::string::npos);  // not the server's details
  EXPECT_EQ(logged.count("request " + std::to_string(bad_id) + " failed: the client's connection broke"), 1u);
  EXPECT_EQ(a.last.finish_reason, FinishReason::Length);
  EXPECT_EQ(b.last.finish_reason, FinishReason::Length);
  EXPECT_EQ(a.tokens, alone[0]);
  EXPECT_EQ(b.tokens, alone[1]);
  EXPECT_EQ(e.metrics().requests_failed, 1u);
  EXPECT_EQ(e.metrics().requests_finished, 2u);
}

// One forward per step: while one request decodes, another's prompt runs in the same forwards, as
// many rows a step as the step budget allows (here a budget no step meets, so the fewest rows, and
// one every step meets, so prefill_chunk rows), and both get the tokens they get alone.
TEST(Engine, PromptRowsJoinTheDecodersForwardsWithinTheStepBudget) {
  EngineOptions opt;
  opt.model_dir = test::tiny_model_dir();
  opt.prefill_chunk = 64;
  opt.cache_ram_bytes = 0;
  const RequestParams stream = greedy(20, 41, 100), prompt = greedy(300, 42, 4);
  std::vector<std::vector<int32_t>> alone;
  {
    Engine e(opt);
    for (const RequestParams& p : {stream, prompt}) {
      Collected c;
      e.submit(p, collect(c));
      wait(c);
      alone.push_back(c.tokens);
    }
  }
  for (const double budget_ms : {1e-6, 1e6}) {
    opt.step_budget_ms = budget_ms;
    Engine e(opt);
    Collected a, b;
    std::atomic<int> a_tokens{0};
    e.submit(stream, [&](const TokenEvent& ev) {
      a_tokens += ev.token >= 0;
      collect(a)(ev);
    });
    while (a_tokens < 2) std::this_thread::yield();  // decoding when the prompt arrives
    RequestParams p = prompt;
    std::vector<int64_t> done;  // the prompt's progress after each step (on the scheduler thread)
    p.prefill_progress = [&done](int64_t at, int64_t) { done.push_back(at); };
    e.submit(p, collect(b));
    wait(b);
    const int a_at_prompt_end = a_tokens;
    wait(a);
    EXPECT_EQ(a.tokens, alone[0]) << budget_ms << " ms";
    EXPECT_EQ(b.tokens, alone[1]) << budget_ms << " ms";
    ASSERT_FALSE(done.empty());
    EXPECT_EQ(done.back(), 300);
    EXPECT_LT(a_at_prompt_end, 100) << "the stream decoded beside the whole prompt";
    int64_t largest = done[0];
    for (size_t i = 1; i < done.size(); ++i) largest = std::max(largest, done[i] - done[i - 1]);
    EXPECT_EQ(largest, budget_ms < 1 ? 8 : 64) << budget_ms << " ms";  // StepBudgetOptions::min_rows, prefill_chunk
    EXPECT_GE(e.metrics().mixed_forwards_total, done.size()) << budget_ms << " ms";
  }
}

// The step budget on a fake machine where a forward costs what a decode step costs (reading the
// weights) or what its prompt rows cost, whichever is more: the prompt rows read the same weights.
// After a few measured steps, each step with a decoder beside a prompt stays within the budget and
// uses most of it, also when a row's cost doubles (a prompt's context grown) part way.
TEST(StepBudget, StepsStayWithinTheBudgetOnAFakeCostModel) {
  const double decode = 0.02;
  double per_row = 0.0005;
  const auto cost = [&](int64_t prompt_rows, int64_t others) {
    return std::max(others > 0 ? decode : 0.0, static_cast<double>(prompt_rows) * per_row) + 1e-4;
  };
  StepBudget b(StepBudgetOptions{0, 256, 8});
  EXPECT_EQ(b.prompt_rows(1), 256);  // nothing measured yet: the most rows
  EXPECT_EQ(b.budget_seconds(), StepBudget::kFloorSeconds);
  b.observe(256, 0, cost(256, 0));  // a prompt alone
  EXPECT_EQ(b.prompt_rows(0), 256);  // nobody decodes: the most rows
  // no decode step measured (a fleet whose prompts never stop): the floor's rows
  EXPECT_EQ(b.prompt_rows(1), static_cast<int64_t>(StepBudget::kFloorSeconds / (cost(256, 0) / 256)));
  for (int i = 0; i < 4; ++i) b.observe(0, 1, cost(0, 1));
  const double budget = StepBudget::kDecodeSteps * cost(0, 1);
  ASSERT_NEAR(b.budget_seconds(), budget, 1e-9);
  for (int step = 0; step < 60; ++step) {
    if (step == 30) per_row *= 2;
    const int64_t rows = b.prompt_rows(1);
    const double took = cost(rows, 1);
    b.observe(rows, 1, took);
    if (step % 30 < 10) continue;  // a few steps to learn the new cost
    EXPECT_LE(took, budget) << "step " << step << ", " << rows << " rows";
    EXPECT_GE(took, 0.8 * budget) << "step " << step << ", " << rows << " rows";
  }
  // A budget below the decode step itself: the prompt still progresses, by the fewest rows.
  StepBudget tight(StepBudgetOptions{0.001, 256, 8});
  for (int step = 0; step < 20; ++step) tight.observe(tight.prompt_rows(1), 1, cost(tight.prompt_rows(1), 1));
  EXPECT_EQ(tight.prompt_rows(1), 8);
  // The automatic budget keeps to its floor and ceiling.
  StepBudget fast(StepBudgetOptions{}), slow(StepBudgetOptions{});
  fast.observe(0, 1, 1e-4);
  slow.observe(0, 1, 10.0);
  EXPECT_EQ(fast.budget_seconds(), StepBudget::kFloorSeconds);
  EXPECT_EQ(slow.budget_seconds(), StepBudget::kCeilingSeconds);
  EXPECT_THROW(StepBudget(StepBudgetOptions{-1, 256, 8}), Error);
  EXPECT_THROW(StepBudget(StepBudgetOptions{std::nan(""), 256, 8}), Error);
  EXPECT_THROW(StepBudget(StepBudgetOptions{0, 0, 8}), Error);
}

// Under the priority policy a queued request of a lower priority is admitted first, the oldest first
// among equals; first come, first served otherwise.
TEST(Engine, PriorityOrdersTheQueue) {
  for (const SchedulingPolicy policy : {SchedulingPolicy::Fcfs, SchedulingPolicy::Priority}) {
    EngineOptions opt;
    opt.model_dir = test::tiny_model_dir();
    opt.parallel = 1;
    opt.scheduling = policy;
    Engine e(opt);
    std::atomic<bool> queued{false};
    Collected blocker;
    // the running request holds the scheduler at its first token until the others wait in the queue
    e.submit(greedy(20, 50, 4), [&](const TokenEvent& ev) {
      while (!queued) std::this_thread::yield();
      collect(blocker)(ev);
    });
    std::mutex mu;
    std::vector<int> finished;  // the queued requests' indexes, in the order they ended
    const std::vector<int64_t> priorities = {5, 1, 3, 1};
    std::vector<std::unique_ptr<Collected>> cs;
    for (size_t i = 0; i < priorities.size(); ++i) {
      RequestParams p = greedy(12, 51 + static_cast<uint32_t>(i), 2);
      p.priority = priorities[i];
      cs.push_back(std::make_unique<Collected>());
      e.submit(p, [&, i](const TokenEvent& ev) {
        if (ev.done) {
          std::lock_guard<std::mutex> lock(mu);
          finished.push_back(static_cast<int>(i));
        }
        collect(*cs[i])(ev);
      });
    }
    queued = true;
    wait(blocker);
    for (auto& c : cs) wait(*c);
    const std::vector<int> want = policy == SchedulingPolicy::Priority ? std::vector<int>{1, 3, 2, 0} : std::vector<int>{0, 1, 2, 3};
    EXPECT_EQ(finished, want);
    EXPECT_EQ(e.scheduling(), policy);
  }
}

// Two agents that arrive together with one system prompt: the second waits while the first computes
// it and stores its state where the two part, then restores it; both get the tokens they get alone.
TEST(Engine, PromptsArrivingTogetherComputeTheirSharedPrefixOnce) {
  EngineOptions opt;
  opt.model_dir = test::tiny_model_dir();
  opt.parallel = 3;
  opt.prefill_chunk = 64;  // the first prompt takes several steps to pass the shared part
  const std::vector<int32_t> system = ids(300, 60);
  RequestParams a = greedy(1, 0, 6), b = greedy(1, 0, 6);
  a.prompt = system;
  b.prompt = system;
  const std::vector<int32_t> a_own = ids(50, 61), b_own = ids(70, 62);
  a.prompt.insert(a.prompt.end(), a_own.begin(), a_own.end());
  b.prompt.insert(b.prompt.end(), b_own.begin(), b_own.end());
  std::vector<std::vector<int32_t>> alone;
  for (const RequestParams& p : {a, b}) {
    Engine e(opt);
    Collected c;
    e.submit(p, collect(c));
    wait(c);
    alone.push_back(c.tokens);
  }
  Engine e(opt);
  std::atomic<bool> queued{false};
  Collected blocker, ca, cb;
  e.submit(greedy(20, 63, 2), [&](const TokenEvent& ev) {  // holds the scheduler until both are queued
    while (!queued) std::this_thread::yield();
    collect(blocker)(ev);
  });
  e.submit(a, collect(ca));
  e.submit(b, collect(cb));
  queued = true;
  wait(ca);
  wait(cb);
  wait(blocker);
  EXPECT_EQ(ca.tokens, alone[0]);
  EXPECT_EQ(cb.tokens, alone[1]);
  EXPECT_EQ(ca.last.cached_tokens, 0);
  EXPECT_EQ(cb.last.cached_tokens, 256);  // the shared 300 tokens' last whole block
}

// The client's text: held back while it may start a stop string, cut before the earliest stop string
// (of two starting there, the first listed), the rest held until the output ends.
TEST(OutputText, HoldsBackWhatMayStartAStopStringAndCutsBeforeTheFirst) {
  const Tokenizer tok = Tokenizer::from_file(test::tiny_model_dir() + "/tokenizer.json");
  const auto read = [&](const std::string& text, std::vector<std::string> stop, OutputText* out = nullptr) {
    OutputText own(tok, std::move(stop));
    OutputText& o = out ? *out : own;
    std::string sent;
    for (const int32_t t : tok.encode(text, false)) {
      if (o.stopped()) break;  // the request ends there
      sent += o.push(t);
    }
    return sent;
  };
  OutputText a(tok, {"STOP"});
  EXPECT_EQ(read("the model STOP and more", {}, &a), "the model ");
  EXPECT_TRUE(a.stopped());
  EXPECT_EQ(a.stop_string(), "STOP");
  EXPECT_EQ(a.held(), "");
  OutputText b(tok, {"STOP"});
  EXPECT_EQ(read("the model ST", {}, &b), "the model ");  // "ST" may start it
  EXPECT_FALSE(b.stopped());
  b.end();
  EXPECT_EQ(b.held(), "ST");
  OutputText c(tok, {"el S", "model"});
  EXPECT_EQ(read("the model STOP", {}, &c), "the ");
  EXPECT_EQ(c.stop_string(), "model");
  EXPECT_EQ(read("caf\xc3\xa9 au lait", {}), "caf\xc3\xa9 au lait");  // no stop strings: nothing held
}

// Log-probabilities under a row (temperature 1): the chosen token's, and the most likely first.
TEST(OutputText, TokenLogprobsAreALogSoftmax) {
  const std::vector<float> row = {0.0f, std::log(3.0f), std::log(2.0f), std::log(2.0f)};  // p = 1/8, 3/8, 2/8, 2/8
  const TokenLogprobs lp = token_logprobs(row.data(), row.size(), 0, 3);
  EXPECT_NEAR(lp.logprob, std::log(1.0 / 8), 1e-6);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].first, 1);
  EXPECT_NEAR(lp.top[0].second, std::log(3.0 / 8), 1e-6);
  EXPECT_NEAR(lp.top[1].second, std::log(2.0 / 8), 1e-6);
  EXPECT_TRUE(token_logprobs(row.data(), row.size(), 2, 0).top.empty());
}

TEST(Engine, BadRequestsAreRefusedAtSubmit) {
  EngineOptions opt;
  opt.model_dir = test::tiny_model_dir();
  Engine e(opt);
  RequestParams p = request(10, 1, 5);
  p.prompt.push_back(5000);
  EXPECT_THROW(e.submit(p, [](const TokenEvent&) {}), Error);
  p = request(10, 1, -1);  // 0 is a prefill-only request
  EXPECT_THROW(e.submit(p, [](const TokenEvent&) {}), Error);
  p = request(10, 1, 5000);
  EXPECT_THROW(e.submit(p, [](const TokenEvent&) {}), Error);
  p = request(10, 1, 5);
  p.prompt.clear();
  EXPECT_THROW(e.submit(p, [](const TokenEvent&) {}), Error);
  p = request(10, 1, 5);
  p.sampling.top_p = 2;
  EXPECT_THROW(e.submit(p, [](const TokenEvent&) {}), Error);
}

}  // namespace
}  // namespace dsv41
