// A bounded soak: one server, a mix of well-behaved and hostile clients for a fixed time (60 s;
// 20 s under the sanitizers): streamed and plain requests, speculative ones among them, whose greedy
// answers must equal what each prompt gets alone, clients that abandon streams or plain requests, slow readers, tricklers,
// malformed and refused requests (no Host or two, a bad chunk, HEAD of a POST route), bodies of 20,000
// keys and of 100,000 values, a client hoarding idle connections past its cap, one that asks for a
// long stream and reads none of it, and probes of /health and /metrics (GET and HEAD). It ends with no error on a
// well-formed request, every refused one refused with a 4xx, no leaked pages, and the memory in use
// within 10% of its size after warm-up (the first quarter): the resident set in Release; under the
// sanitizers the allocator's live heap, because ASan's quarantine keeps freed blocks resident (up to
// 256 MB by default) and fills during the run, so the resident set grows there with no leak.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "server_util.h"
#include "test_util.h"

namespace dsv41::server {
namespace {

using Clock = std::chrono::steady_clock;

#ifdef DSV41_SANITIZED
// The sanitizer runtimes' count of bytes allocated and not yet freed (quarantine excluded). Declared
// here: GCC ships no sanitizer/allocator_interface.h, though libasan and libtsan export the function.
extern "C" size_t __sanitizer_get_current_allocated_bytes();
#endif

double memory_in_use_mb() {
#ifdef DSV41_SANITIZED
  return static_cast<double>(__sanitizer_get_current_allocated_bytes()) / (1 << 20);
#else
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
#endif
}

struct Tally {
  std::mutex mu;
  int ok = 0, abandoned = 0, refused = 0, probes = 0, speculative = 0;
  std::vector<std::string> failures;
  void fail(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    if (failures.size() < 20) failures.push_back(what);
  }
  void add(int& counter) {
    std::lock_guard<std::mutex> lock(mu);
    ++counter;
  }
};

json greedy(const std::string& prompt, int max_tokens, bool stream) {
  json b = {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"ignore_eos", true}};
  if (stream) b["stream"] = true;
  return b;
}

std::string streamed_completion(const Stream& s) {
  std::string out;
  for (const json& e : s.events) {
    if (e.contains("choices") && !e["choices"].empty()) out += e["choices"][0].value("text", "");
  }
  return out;
}

TEST(ServerSoak, MixedClientsLeaveNoErrorsNoLeaksNoGrowth) {
  EngineOptions eo = tiny_engine_options();
  eo.parallel = 6;
  eo.cache_ram_bytes = uint64_t{4} << 20;
  ServerOptions so;
  so.header_timeout = std::chrono::milliseconds(1000);
  so.body_timeout = std::chrono::milliseconds(1000);
  so.max_body_bytes = 256 << 10;
  so.max_client_connections = 32;   // the hoarder below, from its own address, meets this cap
  so.stream_buffer_bytes = 64 << 10;  // the client that stops reading meets this one
  LiveServer s(eo, so);
  const double seconds = test::kSanitized ? 20 : 60;

  // what each prompt gets alone, greedy: every answer in the soak must be the same
  const std::vector<std::string> prompts = {"Hello there", "A longer prompt that shares nothing with the others at all",
                                            "Question 7:", "x y z"};
  std::vector<std::string> alone;
  for (const std::string& p : prompts) {
    const Reply r = post(s.port(), "/v1/completions", greedy(p, 8, false));
    ASSERT_EQ(r.status, 200) << r.raw;
    alone.push_back(r.body["choices"][0]["text"]);
  }

  Tally t;
  std::atomic<bool> stop{false};
  const auto t0 = Clock::now();
  std::vector<std::thread> clients;
  auto client = [&](auto body) {
    clients.emplace_back([&, body, seed = static_cast<uint32_t>(clients.size())] {
      std::mt19937 rng(seed);
      while (!stop) body(rng);
    });
  };
  for (int k = 0; k < 2; ++k) {
    client([&](std::mt19937& rng) {  // streamed greedy, checked
      const size_t i = rng() % prompts.size();
      const Stream st = post_stream(s.port(), "/v1/completions", greedy(prompts[i], 8, true));
      if (st.status != 200 || !st.done) return t.fail("stream: status " + std::to_string(st.status) + " " + st.error);
      if (streamed_completion(st) != alone[i]) return t.fail("stream: answer differs for prompt " + std::to_string(i));
      t.add(t.ok);
    });
    client([&](std::mt19937& rng) {  // plain greedy, checked
      const size_t i = rng() % prompts.size();
      const Reply r = post(s.port(), "/v1/completions", greedy(prompts[i], 8, false));
      if (r.status != 200) return t.fail("plain: status " + std::to_string(r.status) + " " + r.raw.substr(0, 200));
      if (r.body["choices"][0]["text"] != alone[i]) return t.fail("plain: answer differs for prompt " + std::to_string(i));
      t.add(t.ok);
    });
  }
  client([&](std::mt19937& rng) {  // speculative (DSpark, streamed or not), checked against plain greedy
    const size_t i = rng() % prompts.size();
    const bool stream = rng() % 2 == 0;
    json body = greedy(prompts[i], 8, stream);
    body["speculative"] = "dspark";
    if (rng() % 2 == 0) body["draft_length"] = 1 + static_cast<int>(rng() % 4);
    std::string text;
    if (stream) {
      const Stream st = post_stream(s.port(), "/v1/completions", body);
      if (st.status != 200 || !st.done) return t.fail("speculative stream: status " + std::to_string(st.status) + " " + st.error);
      text = streamed_completion(st);
    } else {
      const Reply r = post(s.port(), "/v1/completions", body);
      if (r.status != 200) return t.fail("speculative: status " + std::to_string(r.status) + " " + r.raw.substr(0, 200));
      text = r.body["choices"][0]["text"];
    }
    if (text != alone[i]) return t.fail("speculative: answer differs for prompt " + std::to_string(i));
    t.add(t.ok);
    t.add(t.speculative);
  });
  client([&](std::mt19937& rng) {  // abandons a stream after a few events
    post_stream(s.port(), "/v1/completions", greedy(prompts[rng() % prompts.size()], 500, true), 1 + rng() % 4);
    t.add(t.abandoned);
  });
  client([&](std::mt19937& rng) {  // abandons a plain request mid-generation
    RawClient c(s.port());
    const std::string body = greedy(prompts[rng() % prompts.size()], 500, false).dump();
    c.send_bytes("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
                 std::to_string(body.size()) + "\r\n\r\n" + body);
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 200));
    t.add(t.abandoned);
  });
  client([&](std::mt19937& rng) {  // slow reader of a chat stream
    httplib::Client cli("127.0.0.1", s.port());
    cli.set_read_timeout(std::chrono::seconds(60));
    const json body = {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"max_tokens", 6}, {"stream", true},
                       {"temperature", 0.7}, {"seed", static_cast<int>(rng() % 1000)}};
    std::string raw;
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/chat/completions";
    req.body = body.dump();
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
      raw.append(d, n);
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      return true;
    };
    auto res = cli.send(req);
    if (!res || res->status != 200 || raw.find("data: [DONE]") == std::string::npos) return t.fail("slow reader: " + raw.substr(0, 200));
    t.add(t.ok);
  });
  client([&](std::mt19937& rng) {  // malformed or refused: always a 4xx, never a 5xx or a hang
    static const char* bodies[] = {"{", "[]", R"({"prompt": 5})", R"({"prompt":"x","max_tokens":1e309})",
                                   R"({"prompt":"x","max_tokens":-1})", R"({"messages":[]})", "\xff\xfe"};
    const int kind = static_cast<int>(rng() % 7);
    RawClient c(s.port());
    std::string req;
    if (kind == 0) {
      const std::string b = bodies[rng() % (sizeof bodies / sizeof *bodies)];
      req = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nConnection: close\r\n"
            "Content-Length: " + std::to_string(b.size()) + "\r\n\r\n" + b;
    } else if (kind == 1) {
      req = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\n{}";
    } else if (kind == 2) {
      req = "GET /v1/models HTTP/1.1\r\nHost: evil.example\r\n\r\n";
    } else if (kind == 3) {
      req = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000000\r\n\r\n";
    } else if (kind == 4) {
      req = rng() % 2 ? "GET /health HTTP/1.1\r\n\r\n" : "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n\r\n";
    } else if (kind == 5) {
      req = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\nnot-hex\r\n{}\r\n0\r\n\r\n";
    } else {
      req = "HEAD /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    }
    c.send_bytes(req);
    bool closed = false;
    const std::string r = c.read_all(5, &closed);
    if (r.size() < 12 || r[9] != '4') return t.fail("refusal: " + r.substr(0, 120));
    t.add(t.refused);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  });
  client([&](std::mt19937& rng) {  // JSON built to be slow to parse, or large: 400, or answered
    const bool wide = rng() % 2 == 0;
    std::string body = wide ? R"({"prompt":"x","junk":{)" : R"({"prompt":"Hi","max_tokens":1,"junk":[0)";
    for (int i = 0; body.size() < (200 << 10); ++i) body += wide ? (i ? ",\"" : "\"") + std::to_string(i) + "\":0" : ",0";
    body += wide ? "}}" : "]}";
    const Reply r = request(s.port(), "POST", "/v1/completions", body);
    if (r.status != (wide ? 400 : 200)) return t.fail("json: status " + std::to_string(r.status) + " " + r.raw.substr(0, 200));
    t.add(wide ? t.refused : t.ok);
  });
  client([&](std::mt19937& rng) {  // holds idle connections from its own address until turned away
    std::vector<std::unique_ptr<RawClient>> held;
    for (int i = 0; i < 40; ++i) held.push_back(std::make_unique<RawClient>(s.port(), "127.0.0.5"));
    bool closed = false;
    const std::string r = held.back()->read_all(0.5, &closed);  // past the cap and the probe slots
    if (r.rfind("HTTP/1.1 503", 0) != 0) return t.fail("hoarder: " + r.substr(0, 120));
    std::this_thread::sleep_for(std::chrono::milliseconds(200 + rng() % 800));
    t.add(t.refused);
  });
  client([&](std::mt19937& rng) {  // asks for a long stream and reads none of it
    RawClient c(s.port(), nullptr, 4096);
    const std::string body = json{{"prompt", prompts[rng() % prompts.size()]}, {"max_tokens", 2000}, {"ignore_eos", true},
                                  {"stream", true}, {"logprobs", 5}}.dump();
    c.send_bytes("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
                 std::to_string(body.size()) + "\r\n\r\n" + body);
    std::this_thread::sleep_for(std::chrono::milliseconds(1000 + rng() % 1000));
    t.add(t.abandoned);
  });
  client([&](std::mt19937&) {  // trickles a head until dropped
    RawClient c(s.port());
    for (int i = 0; i < 100 && c.send_bytes("a"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(30));
  });
  client([&](std::mt19937&) {  // probes
    const auto p0 = Clock::now();
    const Reply h = request(s.port(), "GET", "/health");
    const Reply m = request(s.port(), "GET", "/metrics");
    bool closed = false;
    const std::string head = exchange(s.port(), "HEAD /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", &closed);
    const double secs = std::chrono::duration<double>(Clock::now() - p0).count();
    if (h.status != 200 || m.status != 200 || secs > 2.0) return t.fail("probe: " + std::to_string(secs) + " s");
    if (head.rfind("HTTP/1.1 200", 0) != 0 || head.find("{") != std::string::npos) return t.fail("HEAD probe: " + head);
    t.add(t.probes);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  });

  // the first quarter is the warm-up: every client thread has started and every kind of request has
  // run, so the allocator's arenas and the caches have their working size
  double in_use_warm = 0;
  while (std::chrono::duration<double>(Clock::now() - t0).count() < seconds) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (in_use_warm == 0 && std::chrono::duration<double>(Clock::now() - t0).count() >= seconds / 4) in_use_warm = memory_in_use_mb();
  }
  stop = true;
  for (std::thread& c : clients) c.join();

  for (const std::string& f : t.failures) ADD_FAILURE() << f;
  std::printf("[ soak ] %.0f s: %d answers checked (%d speculative), %d abandoned, %d refused, %d probes\n", seconds,
              t.ok, t.speculative, t.abandoned, t.refused, t.probes);
  EXPECT_GT(t.ok, 20);
  EXPECT_GT(t.speculative, 5);
  EXPECT_GT(t.abandoned, 5);
  EXPECT_GT(t.refused, 20);

  const EngineMetrics m = idle_metrics(s.engine());
  EXPECT_EQ(m.requests_running + m.requests_queued, 0u);
  EXPECT_EQ(m.requests_failed, 0u);
  EXPECT_EQ(m.kv_pages_in_use, m.cache_pages_in_use) << "pages leaked";
  const Reply metrics = request(s.port(), "GET", "/metrics");
  EXPECT_NE(metrics.raw.find("dsv41_http_responses_total{code=\"5xx\"} 0\n"), std::string::npos) << metrics.raw;
  const double in_use_end = memory_in_use_mb();
  std::printf("[ soak ] %s %.1f MB after warm-up, %.1f MB at the end\n",
              test::kSanitized ? "live heap" : "resident", in_use_warm, in_use_end);
  EXPECT_LT(in_use_end, in_use_warm * 1.10) << "memory in use grew during the soak";
}

}  // namespace
}  // namespace dsv41::server
