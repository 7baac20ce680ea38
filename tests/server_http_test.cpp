// The HTTP layer under careless and hostile clients (server/http_connection.h), on raw sockets so
// every byte is the test's: body limits for every framing, head limits, deadlines that a trickling
// client cannot stretch, pipelining, HTTP/1.0, cancellation of a plain request whose client left,
// the request timeout, the connection cap and a prompt shutdown.
#include <gtest/gtest.h>
#include <poll.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "server_util.h"
#include "test_util.h"

namespace dsv41::server {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string post_head(const std::string& path, const std::string& extra) {
  return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + extra + "\r\n";
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

ServerOptions tight_options() {
  ServerOptions so;
  so.max_body_bytes = 64 << 10;
  so.max_header_bytes = 8 << 10;
  so.header_timeout = std::chrono::milliseconds(1500);
  so.body_timeout = std::chrono::milliseconds(1500);
  so.max_connections = 48;
  return so;
}

LiveServer& tight_server() {
  static LiveServer server(tiny_engine_options(), tight_options());
  return server;
}

const std::string kSmallBody = R"({"prompt":"Hi","max_tokens":2,"temperature":0})";

// The body limit holds whatever the framing: declared, chunked, or chunked with huge chunk sizes.
TEST(ServerHttp, BodyLimitHoldsForEveryFraming) {
  LiveServer& s = tight_server();
  {  // chunked and small: accepted
    RawClient c(s.port());
    std::string body = kSmallBody;
    char size[16];
    std::snprintf(size, sizeof size, "%zx", body.size());
    ASSERT_TRUE(c.send_bytes(post_head("/v1/completions", "Transfer-Encoding: chunked\r\nConnection: close\r\n") + size +
                             "\r\n" + body + "\r\n0\r\n\r\n"));
    bool closed = false;
    const std::string r = c.read_all(20, &closed);
    EXPECT_NE(r.find("HTTP/1.1 200"), std::string::npos) << r;
  }
  {  // chunked past the limit: 413 as soon as the limit is crossed, and closed
    RawClient c(s.port());
    ASSERT_TRUE(c.send_bytes(post_head("/v1/completions", "Transfer-Encoding: chunked\r\n")));
    const std::string chunk = "4000\r\n" + std::string(0x4000, 'a') + "\r\n";
    for (int i = 0; i < 8; ++i) c.send_bytes(chunk);  // 128 KiB, twice the limit
    bool closed = false;
    const std::string r = c.read_all(5, &closed);
    EXPECT_NE(r.find("HTTP/1.1 413"), std::string::npos) << r;
    EXPECT_NE(r.find("request_too_large"), std::string::npos) << r;
    EXPECT_TRUE(closed);
  }
  {  // one chunk that claims more than the limit: refused before it arrives
    RawClient c(s.port());
    ASSERT_TRUE(c.send_bytes(post_head("/v1/completions", "Transfer-Encoding: chunked\r\n") + "fffffff\r\naaaa"));
    bool closed = false;
    const auto t0 = Clock::now();
    const std::string r = c.read_all(5, &closed);
    EXPECT_NE(r.find("HTTP/1.1 413"), std::string::npos) << r;
    EXPECT_LT(seconds_since(t0), 3.0);
  }
  {  // a declared length past the limit: refused from the head
    RawClient c(s.port());
    ASSERT_TRUE(c.send_bytes(post_head("/v1/completions", "Content-Length: 1000000\r\n")));
    bool closed = false;
    const std::string r = c.read_all(5, &closed);
    EXPECT_NE(r.find("HTTP/1.1 413"), std::string::npos) << r;
    EXPECT_TRUE(closed);
  }
}

// Many headers or one huge one: 431, closed; the request head costs at most the limit.
TEST(ServerHttp, HeadLimitBoundsCountAndSize) {
  LiveServer& s = tight_server();
  for (const std::string& extra : {[] {
                                     std::string h;
                                     for (int i = 0; i < 5000; ++i) h += "X-H" + std::to_string(i) + ": v\r\n";
                                     return h;
                                   }(),
                                   "X-Big: " + std::string(100000, 'b') + "\r\n"}) {
    RawClient c(s.port());
    c.send_bytes("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra + "\r\n");
    bool closed = false;
    const std::string r = c.read_all(5, &closed);
    EXPECT_NE(r.find("HTTP/1.1 431"), std::string::npos) << r.substr(0, 200);
    EXPECT_TRUE(closed);
  }
}

// A client that sends its head or body a byte at a time is dropped when the deadline for the whole
// head (body) passes, not kept alive by each byte; meanwhile the server answers everyone else.
TEST(ServerHttp, TricklingClientsAreDroppedAtTheDeadlineAndStarveNoOne) {
  LiveServer& s = tight_server();
  std::vector<std::future<double>> tricklers;
  for (int i = 0; i < 12; ++i) {
    tricklers.push_back(std::async(std::launch::async, [&, i] {
      RawClient c(s.port());
      // even: the head a byte at a time; odd: the head at once, then the body a byte at a time
      const std::string text = i % 2 == 0 ? "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + std::string(200, 's')
                                           : std::string(200, ' ');
      if (i % 2 == 1) c.send_bytes(post_head("/v1/completions", "Content-Length: 1000\r\n"));
      const auto t0 = Clock::now();
      for (char ch : text) {
        if (!c.send_bytes(std::string(1, ch))) break;  // the server closed it
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        if (seconds_since(t0) > 8) break;
      }
      return seconds_since(t0);
    }));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  double worst = 0;
  for (int i = 0; i < 10; ++i) {  // /health stays prompt while the tricklers hold their sockets
    const auto t0 = Clock::now();
    EXPECT_EQ(request(s.port(), "GET", "/health").status, 200);
    worst = std::max(worst, seconds_since(t0));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_LT(worst, 0.5);
  for (auto& t : tricklers) {
    const double held = t.get();
    // 1.5 s deadlines for the whole head and the whole body; each byte would renew a per-recv timeout
    EXPECT_LT(held, 4.0) << "a trickling client was kept past its deadline";
  }
}

// Requests sent back to back on one connection are all answered, in order; a body declared longer
// than sent ends at the body deadline instead of holding the connection.
TEST(ServerHttp, PipelinedRequestsAreAnsweredInOrder) {
  LiveServer& s = tight_server();
  RawClient c(s.port());
  const std::string get = "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  const std::string post = post_head("/tokenize", "Content-Length: " + std::to_string(std::string(R"({"prompt":"Hi"})").size()) + "\r\n") +
                           R"({"prompt":"Hi"})";
  ASSERT_TRUE(c.send_bytes(get + post + "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"));
  bool closed = false;
  const std::string r = c.read_all(10, &closed);
  EXPECT_EQ(count_of(r, "HTTP/1.1 200"), 3u) << r;
  const size_t models = r.find("\"object\":\"list\""), tokens = r.find("\"tokens\""), health = r.find("\"status\":\"ok\"");
  EXPECT_TRUE(models < tokens && tokens < health) << r;
  EXPECT_TRUE(closed);

  RawClient short_body(s.port());
  short_body.send_bytes(post_head("/v1/completions", "Content-Length: 500\r\n") + "{\"prompt\":");
  const auto t0 = Clock::now();
  short_body.read_all(6, &closed);
  EXPECT_TRUE(closed);
  EXPECT_LT(seconds_since(t0), 3.0);
}

TEST(ServerHttp, Http10IsAnsweredAsHttp10) {
  LiveServer& s = tight_server();
  RawClient c(s.port());
  c.send_bytes("GET /health HTTP/1.0\r\n\r\n");
  bool closed = false;
  std::string r = c.read_all(5, &closed);
  EXPECT_EQ(r.rfind("HTTP/1.0 200", 0), 0u) << r;
  EXPECT_TRUE(closed) << "no keep-alive unless asked for";

  RawClient stream(s.port());
  const std::string body = R"({"prompt":"Hi","max_tokens":3,"temperature":0,"stream":true})";
  stream.send_bytes("POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: " +
                    std::to_string(body.size()) + "\r\n\r\n" + body);
  r = stream.read_all(20, &closed);
  EXPECT_EQ(r.rfind("HTTP/1.0 200", 0), 0u) << r;
  EXPECT_EQ(r.find("Transfer-Encoding"), std::string::npos) << "no chunks in HTTP/1.0";
  EXPECT_NE(r.find("data: [DONE]"), std::string::npos) << r;
  EXPECT_TRUE(closed) << "an HTTP/1.0 stream ends with the connection";
}

// A plain (non-streamed) request whose client leaves is cancelled: its pages come back at once.
TEST(ServerHttp, PlainRequestOfAGoneClientIsCancelled) {
  LiveServer& s = tight_server();
  const uint64_t cancelled = s.engine().metrics().requests_cancelled;
  {
    RawClient c(s.port());
    const std::string body = R"({"prompt":"Hi","max_tokens":3000,"ignore_eos":true,"temperature":0})";
    c.send_bytes(post_head("/v1/completions", "Content-Length: " + std::to_string(body.size()) + "\r\n") + body);
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
  }  // closed mid-generation
  const auto t0 = Clock::now();
  while (s.engine().metrics().requests_cancelled == cancelled && seconds_since(t0) < 10) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(s.engine().metrics().requests_cancelled, cancelled + 1);
  EXPECT_LT(seconds_since(t0), 2.0);
  while (s.engine().metrics().kv_pages_in_use > 0 && seconds_since(t0) < 10) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(s.engine().metrics().kv_pages_in_use, 0u);
}

TEST(ServerHttp, RequestTimeoutEndsPlainAndStreamedRequests) {
  ServerOptions so;
  so.request_timeout = std::chrono::milliseconds(400);
  LiveServer s(tiny_engine_options(), so);
  const json body = {{"prompt", "Hi"}, {"max_tokens", 3000}, {"ignore_eos", true}, {"temperature", 0}};
  auto t0 = Clock::now();
  const Reply plain = post(s.port(), "/v1/completions", body);
  EXPECT_EQ(plain.status, 504) << plain.raw;
  EXPECT_EQ(plain.body["error"]["code"], "request_timeout");
  EXPECT_LT(seconds_since(t0), 3.0);
  json streamed = body;
  streamed["stream"] = true;
  t0 = Clock::now();
  const Stream st = post_stream(s.port(), "/v1/completions", streamed);
  EXPECT_EQ(st.status, 200);
  EXPECT_TRUE(st.done);
  ASSERT_FALSE(st.events.empty());
  EXPECT_EQ(st.events.back()["error"]["code"], "request_timeout") << st.raw.substr(st.raw.size() > 300 ? st.raw.size() - 300 : 0);
  EXPECT_LT(seconds_since(t0), 3.0);
  EXPECT_EQ(post(s.port(), "/v1/completions", {{"prompt", "Hi"}, {"max_tokens", 2}}).status, 200) << "short ones pass";
}

// Past the connection cap new connections are told 503 and closed; those already open are served.
TEST(ServerHttp, ConnectionCapAnswers503) {
  ServerOptions so;
  so.max_connections = 4;
  LiveServer s(tiny_engine_options(), so);
  std::vector<std::unique_ptr<RawClient>> held;
  for (int i = 0; i < 4; ++i) held.push_back(std::make_unique<RawClient>(s.port()));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  RawClient extra(s.port());
  bool closed = false;
  const std::string r = extra.read_all(3, &closed);
  EXPECT_EQ(r.rfind("HTTP/1.1 503", 0), 0u) << r;
  EXPECT_TRUE(closed);
  held[0]->send_bytes("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
  EXPECT_NE(held[0]->read_all(1, &closed).find("HTTP/1.1 200"), std::string::npos);
}

// stop() closes idle and slow connections at once instead of waiting for their deadlines.
TEST(ServerHttp, StopClosesOpenConnectionsPromptly) {
  ServerOptions so;
  so.header_timeout = std::chrono::seconds(60);
  auto s = std::make_unique<LiveServer>(tiny_engine_options(), so);
  RawClient idle(s->port()), slow(s->port());
  slow.send_bytes("GET /health HTTP/1.1\r\nHost: 127");
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = Clock::now();
  s.reset();
  EXPECT_LT(seconds_since(t0), 1.5);
  bool closed = false;
  idle.read_all(1, &closed);
  EXPECT_TRUE(closed);
}

// The latency histograms count what happened: one first token, queue time and end-to-end latency
// per finished request, one inter-token gap per later token.
TEST(ServerHttp, LatencyHistogramsCountEveryRequestAndToken) {
  LiveServer s(tiny_engine_options());
  const json body = {{"prompt", "Hi"}, {"max_tokens", 4}, {"temperature", 0}, {"ignore_eos", true}};
  ASSERT_EQ(post(s.port(), "/v1/completions", body).status, 200);
  json streamed = body;
  streamed["stream"] = true;
  ASSERT_TRUE(post_stream(s.port(), "/v1/completions", streamed).done);
  const std::string m = request(s.port(), "GET", "/metrics").raw;
  auto count = [&](const std::string& name) {
    const size_t at = m.find(name + "_count ");
    return at == std::string::npos ? -1 : std::stol(m.substr(at + name.size() + 7));
  };
  EXPECT_EQ(count("vllm:time_to_first_token_seconds"), 2) << m;
  EXPECT_EQ(count("vllm:inter_token_latency_seconds"), 6);  // 3 gaps in each 4-token answer
  EXPECT_EQ(count("vllm:request_queue_time_seconds"), 2);
  EXPECT_EQ(count("vllm:e2e_request_latency_seconds"), 2);
}

}  // namespace
}  // namespace dsv41::server
