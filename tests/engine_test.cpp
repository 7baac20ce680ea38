// The engine behind the server: requests run concurrently under one scheduler and each gets exactly
// what it would get alone; memory admission queues instead of failing; cancellation frees pages.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <thread>
#include <mutex>
#include <random>

#include "kernels/backend.h"
#include "runtime/engine.h"
#include "test_util.h"
#include "util/error.h"

namespace dsv41 {
namespace {

struct Collected {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int32_t> tokens;
  std::string text;
  TokenEvent last;
  bool done = false;
};

EventSink collect(Collected& c) {
  return [&c](const TokenEvent& e) {
    std::lock_guard<std::mutex> lock(c.mu);
    if (e.token >= 0) c.tokens.push_back(e.token);
    c.text += e.text;
    if (e.done) {
      c.last = e;
      c.done = true;
      c.cv.notify_all();
    }
  };
}

void wait(Collected& c) {
  std::unique_lock<std::mutex> lock(c.mu);
  c.cv.wait(lock, [&] { return c.done; });
}

std::vector<int32_t> ids(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<int32_t>(3 + rng() % 990);
  return v;
}

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
    EXPECT_EQ(ca[i]->last.finish_reason, "length");
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
    EXPECT_EQ(cs[i]->last.finish_reason, "length");
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
    EXPECT_EQ(cs[i]->last.finish_reason, "length") << i;
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
  EXPECT_EQ(c.last.finish_reason, "cancelled");
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
  EXPECT_EQ(a.last.finish_reason, "cancelled");
  for (uint64_t id : flood_ids) e.cancel(id);  // still queued behind the long request
  while (flood_done < kFlood) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  e.cancel(busy_id);
  wait(busy);
  wait(b);
  EXPECT_EQ(busy.last.finish_reason, "cancelled");
  EXPECT_EQ(b.last.finish_reason, "length");
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
  EXPECT_EQ(cut.last.finish_reason, "stop");
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

TEST(Engine, BadRequestsAreRefusedAtSubmit) {
  EngineOptions opt;
  opt.model_dir = test::tiny_model_dir();
  Engine e(opt);
  RequestParams p = request(10, 1, 5);
  p.prompt.push_back(5000);
  EXPECT_THROW(e.submit(p, [](const TokenEvent&) {}), Error);
  p = request(10, 1, 0);
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
