// The HTTP layer under careless and hostile clients (server/http_connection.h), on raw sockets so
// every byte is the test's: body limits for every framing, head limits, deadlines that a trickling
// client cannot stretch, pipelining, HTTP/1.0, HEAD, Host, cancellation of a plain request whose
// client left, the request timeout, the connection caps and the probes' room, descriptors running
// out, the body budget, wide JSON, a client that stops reading, an unread log, a stalled step, and
// a shutdown that answers what is in flight.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <random>
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

// A metric's value in Prometheus text (-1 when absent).
double metric_of(const std::string& text, const std::string& name) {
  const size_t at = text.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stod(text.substr(at + name.size() + 2));
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

std::string health_request(const char* method = "GET") {
  return std::string(method) + " /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
}

// Past the connection caps (all clients, and one address) a few more connections may open for
// /health and /metrics only, half of them per address; past those, 503 at once. Another address is
// served while one client holds all it may.
TEST(ServerHttp, ConnectionCapsLeaveRoomForProbes) {
  ServerOptions so;
  so.max_connections = 4;
  so.max_client_connections = 3;
  so.probe_connections = 2;
  LiveServer s(tiny_engine_options(), so);
  std::vector<std::unique_ptr<RawClient>> held;
  for (int i = 0; i < 3; ++i) held.push_back(std::make_unique<RawClient>(s.port()));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  bool closed = false;

  // past this client's cap: a probe-only slot, which a POST does not get
  std::string r = exchange(s.port(), post_head("/v1/completions", "Content-Length: " + std::to_string(kSmallBody.size()) + "\r\n") + kSmallBody, &closed);
  EXPECT_EQ(r.rfind("HTTP/1.1 503", 0), 0u) << r;
  EXPECT_NE(r.find("this client holds its maximum of 3 connections"), std::string::npos) << r;
  EXPECT_NE(r.find("Retry-After: 1"), std::string::npos) << r;
  EXPECT_TRUE(closed);

  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the refused connection's slot is back
  RawClient idle_probe(s.port());  // holds this address's one probe slot ...
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  RawClient refused(s.port());     // ... so the next is refused at once
  r = refused.read_all(3, &closed);
  EXPECT_EQ(r.rfind("HTTP/1.1 503", 0), 0u) << r;
  EXPECT_NE(r.find("too_many_connections"), std::string::npos) << r;
  EXPECT_TRUE(closed);

  RawClient other(s.port(), "127.0.0.2");  // another client: the server's fourth full connection
  other.send_bytes(post_head("/v1/completions", "Content-Length: " + std::to_string(kSmallBody.size()) + "\r\n") + kSmallBody);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  RawClient third(s.port(), "127.0.0.3");  // the server is full: its probe is answered, once
  third.send_bytes(health_request());
  r = third.read_all(3, &closed);
  EXPECT_EQ(r.rfind("HTTP/1.1 200", 0), 0u) << r;
  EXPECT_TRUE(closed) << "a probe-only connection serves one request";
  bool other_closed = false;
  const std::string answer = other.read_all(1, &other_closed);
  EXPECT_EQ(answer.rfind("HTTP/1.1 200", 0), 0u) << answer;

  held[0]->send_bytes(health_request());
  EXPECT_NE(held[0]->read_all(1, &closed).find("HTTP/1.1 200"), std::string::npos);
  held.clear();  // the slots come back
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(post(s.port(), "/v1/completions", json::parse(kSmallBody)).status, 200);
  EXPECT_EQ(metric_of(request(s.port(), "GET", "/metrics").raw, "dsv41_http_turned_away_total"), 2);
}

// When the process runs out of file descriptors, accept fails (EMFILE): the listener tries again
// after a short back-off instead of stopping for good, so connections that waited in the backlog are
// served as soon as descriptors free up.
TEST(ServerHttp, AcceptResumesAfterDescriptorsRunOut) {
  // UBSan's check of a dynamic type opens a pipe to probe memory; with no descriptor left it reports
  // a false "invalid vptr" inside Asio.
  DSV41_SKIP_UNDER_SANITIZERS("running the process out of file descriptors");
  LiveServer s(tiny_engine_options());
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = 256;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  // The clients' sockets first, then every other descriptor taken: they connect (the kernel completes
  // the handshake into the backlog), and the server has no descriptor to accept them with.
  std::vector<int> clients;
  for (int i = 0; i < 4; ++i) clients.push_back(socket(AF_INET, SOCK_STREAM, 0));
  std::vector<int> hogs;
  for (int fd; (fd = dup(0)) >= 0;) hogs.push_back(fd);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(s.port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int connected = 0;
  for (int fd : clients) {
    connected += connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    const std::string r = health_request();
    (void)!send(fd, r.data(), r.size(), MSG_NOSIGNAL);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the listener fails to accept them
  for (int fd : hogs) close(fd);
  setrlimit(RLIMIT_NOFILE, &saved);
  EXPECT_EQ(connected, 4);
  for (int fd : clients) {
    timeval tv{3, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char buf[256] = {};
    const ssize_t n = recv(fd, buf, sizeof buf - 1, 0);
    EXPECT_EQ(std::string(buf, n > 0 ? static_cast<size_t>(n) : 0).rfind("HTTP/1.1 200", 0), 0u)
        << "a connection that waited for a descriptor";
    close(fd);
  }
  EXPECT_GT(metric_of(request(s.port(), "GET", "/metrics").raw, "dsv41_http_accept_failures_total"), 0);
}

// HEAD is answered as the same GET without its body; replies to HEAD never carry one, errors included.
TEST(ServerHttp, HeadIsAGetWithoutTheBody) {
  LiveServer& s = tight_server();
  bool closed = false;
  const std::string get = exchange(s.port(), health_request(), &closed, false);
  const std::string head = exchange(s.port(), "HEAD /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", &closed);
  EXPECT_EQ(head.rfind("HTTP/1.1 200", 0), 0u) << head;
  EXPECT_EQ(head.find("\r\n\r\n") + 4, head.size()) << "no body: " << head;
  const size_t get_head_end = get.find("\r\n\r\n") + 4;
  EXPECT_NE(head.find("Content-Length: " + std::to_string(get.size() - get_head_end)), std::string::npos) << head;
  RawClient c(s.port());
  c.send_bytes("HEAD /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nHEAD /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" +
               health_request("HEAD"));
  const std::string r = c.read_all(1, &closed);
  EXPECT_EQ(r.rfind("HTTP/1.1 405", 0), 0u) << r;
  EXPECT_NE(r.find("Allow: POST"), std::string::npos) << r;
  EXPECT_NE(r.find("HTTP/1.1 404"), std::string::npos) << r;
  EXPECT_EQ(r.find("{"), std::string::npos) << "a body in a reply to HEAD: " << r;
  EXPECT_EQ(count_of(r, "HTTP/1.1 "), 3u) << r;
}

// An HTTP/1.1 request without Host or with two is a 400 (RFC 9112 3.2); HTTP/1.0 may leave it out.
TEST(ServerHttp, HostIsRequiredOnce) {
  LiveServer& s = tight_server();
  bool closed = false;
  std::string r = exchange(s.port(), "GET /health HTTP/1.1\r\n\r\n", &closed);
  EXPECT_EQ(r.rfind("HTTP/1.1 400", 0), 0u) << r;
  EXPECT_NE(r.find("exactly one Host"), std::string::npos) << r;
  EXPECT_TRUE(closed);
  r = exchange(s.port(), "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n\r\n", &closed);
  EXPECT_EQ(r.rfind("HTTP/1.1 400", 0), 0u) << r;
  r = exchange(s.port(), "GET /health HTTP/1.0\r\n\r\n", &closed);
  EXPECT_EQ(r.rfind("HTTP/1.0 200", 0), 0u) << r;
}

// A malformed chunk size is a 400, and the connection closes.
TEST(ServerHttp, MalformedChunkIs400) {
  LiveServer& s = tight_server();
  bool closed = false;
  const std::string r =
      exchange(s.port(), post_head("/v1/completions", "Transfer-Encoding: chunked\r\n") + "zz\r\n{}\r\n0\r\n\r\n", &closed);
  EXPECT_EQ(r.rfind("HTTP/1.1 400", 0), 0u) << r;
  EXPECT_NE(r.find("malformed"), std::string::npos) << r;
  EXPECT_TRUE(closed);
}

// Bodies share one budget of bytes in flight, taken from the head before the body is read: past it a
// request is told 503 (with Retry-After) without a byte of its body read, and the budget comes back
// as bodies are let go of. Chunked bodies take the body limit until read.
TEST(ServerHttp, BodiesInFlightShareOneBudget) {
  ServerOptions so = tight_options();  // bodies of 64 KiB at most
  so.body_bytes_in_flight = 100 << 10;
  so.body_timeout = std::chrono::seconds(30);
  LiveServer s(tiny_engine_options(), so);
  RawClient slow(s.port());  // declares 60 KiB and sends a little
  slow.send_bytes(post_head("/v1/completions", "Content-Length: 61440\r\n") + "{\"prompt\":");
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  bool closed = false;
  std::string r = exchange(s.port(), post_head("/v1/completions", "Content-Length: 50000\r\n"), &closed);
  EXPECT_EQ(r.rfind("HTTP/1.1 503", 0), 0u) << r;
  EXPECT_NE(r.find("Retry-After: 1"), std::string::npos) << r;
  EXPECT_NE(r.find("server_busy"), std::string::npos) << r;
  r = exchange(s.port(), post_head("/v1/completions", "Transfer-Encoding: chunked\r\n"), &closed);
  EXPECT_EQ(r.rfind("HTTP/1.1 503", 0), 0u) << "a chunked body needs the body limit free: " << r;
  EXPECT_EQ(post(s.port(), "/v1/completions", json::parse(kSmallBody)).status, 200) << "small bodies still fit";
  slow.send_bytes(std::string(61430, ' '));  // the rest, with which the body is malformed JSON
  const std::string slow_answer = slow.read_all(2, &closed);
  EXPECT_EQ(slow_answer.rfind("HTTP/1.1 400", 0), 0u) << slow_answer;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::string chunked = "{\"prompt\":\"Hi\",\"max_tokens\":2,\"junk\":\"" + std::string(50000, 'x') + "\"}";
  char size[16];
  std::snprintf(size, sizeof size, "%zx", chunked.size());
  r = exchange(s.port(), post_head("/v1/completions", "Transfer-Encoding: chunked\r\nConnection: close\r\n") + size + "\r\n" +
                             chunked + "\r\n0\r\n\r\n", &closed);
  EXPECT_EQ(r.rfind("HTTP/1.1 200", 0), 0u) << "the budget came back: " << r.substr(0, 300);
}

// 2 MB bodies of 160,000 keys are refused in linear time: a worker is not held for long, and another
// client's short request is answered meanwhile.
TEST(ServerHttp, WideJsonObjectsAreCheapToRefuse) {
  ServerOptions so;
  so.threads = 1;  // one worker: a quadratic parse would hold up everyone
  LiveServer s(tiny_engine_options(), so);
  std::string wide = R"({"prompt":"x","junk":{)";
  for (int i = 0; i < 160000; ++i) wide += (i ? ",\"" : "\"") + std::to_string(i) + "\":0";
  wide += "}}";
  const auto t0 = Clock::now();
  std::vector<std::future<Reply>> wides;
  for (int i = 0; i < 3; ++i) {
    wides.push_back(std::async(std::launch::async, [&] { return request(s.port(), "POST", "/v1/completions", wide); }));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const Reply small = post(s.port(), "/v1/completions", json::parse(kSmallBody));
  EXPECT_EQ(small.status, 200) << small.raw;
  EXPECT_LT(seconds_since(t0), test::kSanitized ? 20.0 : 4.0);
  for (auto& f : wides) {
    const Reply r = f.get();
    EXPECT_EQ(r.status, 400) << r.raw.substr(0, 200);
    EXPECT_NE(r.raw.find("more than 10000 members"), std::string::npos) << r.raw.substr(0, 200);
  }
}

// A streaming client that stops reading is dropped once its unsent events pass the stream buffer,
// and its request cancelled, instead of its tokens being generated and buffered for nobody.
TEST(ServerHttp, AStreamWhoseClientStopsReadingIsCancelled) {
  ServerOptions so;
  so.stream_buffer_bytes = 64 << 10;
  so.write_timeout = std::chrono::seconds(60);
  LiveServer s(tiny_engine_options(), so);
  RawClient reader_that_does_not(s.port(), nullptr, 4096);
  const std::string body = json{{"prompt", "Hi"}, {"max_tokens", 3000}, {"ignore_eos", true}, {"stream", true},
                                {"logprobs", 20}}.dump();
  reader_that_does_not.send_bytes(post_head("/v1/completions", "Content-Length: " + std::to_string(body.size()) + "\r\n") + body);
  const auto t0 = Clock::now();
  EngineMetrics m = s.engine().metrics();
  while (m.requests_cancelled + m.requests_finished == 0 && seconds_since(t0) < 60) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    m = s.engine().metrics();
  }
  EXPECT_EQ(m.requests_cancelled, 1u);
  EXPECT_LT(m.generation_tokens_total, 3000u);
}

// stop() gives every request in flight its answer before the connections close: a plain request
// its 503, a stream an error event and [DONE].
TEST(ServerHttp, StopAnswersRequestsInFlight) {
  auto s = std::make_unique<LiveServer>(tiny_engine_options());
  const int port = s->port();  // read here: the clients run on while the server is destroyed
  const json long_one = {{"prompt", "Hi"}, {"max_tokens", 3000}, {"ignore_eos", true}};
  json streamed = long_one;
  streamed["stream"] = true;
  auto plain = std::async(std::launch::async, [&] { return post(port, "/v1/completions", long_one); });
  auto stream = std::async(std::launch::async, [&] { return post_stream(port, "/v1/completions", streamed); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  s.reset();
  const Reply p = plain.get();
  EXPECT_EQ(p.status, 503) << p.raw << p.error;
  EXPECT_NE(p.raw.find("shutting down"), std::string::npos) << p.raw;
  const Stream st = stream.get();
  EXPECT_EQ(st.status, 200);
  EXPECT_TRUE(st.done) << st.raw.substr(st.raw.size() > 300 ? st.raw.size() - 300 : 0);
  ASSERT_FALSE(st.events.empty());
  EXPECT_TRUE(st.events.back().contains("error")) << st.events.back();
}

// The request timeout counts from the request's arrival, so time spent waiting for a worker is in it.
TEST(ServerHttp, RequestTimeoutCountsFromArrival) {
  ServerOptions so;
  so.threads = 1;
  so.request_timeout = std::chrono::milliseconds(200);
  LiveServer s(tiny_engine_options(), so);
  // /tokenize of 4 MB of words holds the one worker (over half a second in Release; 512 KB take
  // seconds under the sanitizers). Its body is
  // written whole (the socket takes it as the server reads it) before the short request is sent; on
  // a loaded machine the server may still take the short one first, so a few tries are allowed, and
  // every try whose short request did wait must end in 504.
  std::mt19937 rng(1);
  std::string text;
  while (text.size() < (test::kSanitized ? size_t{512} << 10 : size_t{4} << 20)) text += "word" + std::to_string(rng() % 1000) + " ";
  const std::string body = json{{"prompt", text}}.dump();
  const std::string tokenize =
      post_head("/tokenize", "Connection: close\r\nContent-Length: " + std::to_string(body.size()) + "\r\n") + body;
  int meaningful = 0;
  for (int attempt = 0; attempt < 5 && meaningful == 0; ++attempt) {
    RawClient busy(s.port());
    ASSERT_TRUE(busy.send_bytes(tokenize));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the last bytes read, tokenizing begun
    const auto t0 = Clock::now();
    const Reply r = post(s.port(), "/v1/completions", json::parse(kSmallBody));
    const double waited = seconds_since(t0);
    bool closed = false;
    busy.read_all(test::kSanitized ? 60 : 20, &closed);  // until its answer is written and the server closes
    if (waited < 0.3) continue;  // the short request went first: this try says nothing
    ++meaningful;
    EXPECT_EQ(r.status, 504) << "waited " << waited << " s: " << r.raw;
  }
  EXPECT_GT(meaningful, 0) << "the short request never waited for the worker";
}

// /health turns 503 while one engine step runs past the stall timeout, and back to 200 after.
TEST(ServerHttp, HealthReportsAStalledStep) {
  ServerOptions so;
  so.stall_timeout = std::chrono::milliseconds(300);
  LiveServer s(tiny_engine_options(), so);
  EXPECT_EQ(request(s.port(), "GET", "/health").status, 200);
  RequestParams p;
  p.prompt = {1, 2, 3, 4};
  p.max_tokens = 1;
  // a step held for 1.5 s, as by a peer that stopped answering
  p.prefill_progress = [](int64_t, int64_t) { std::this_thread::sleep_for(std::chrono::milliseconds(1500)); };
  std::promise<void> done;
  s.engine().submit(std::move(p), [&](const TokenEvent& e) {
    if (e.done) done.set_value();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  const Reply stalled = request(s.port(), "GET", "/health");
  EXPECT_EQ(stalled.status, 503) << stalled.raw;
  EXPECT_EQ(stalled.body.value("status", ""), "stalled") << stalled.raw;
  EXPECT_NE(request(s.port(), "GET", "/metrics").raw.find("dsv41_step_running_seconds 0."), std::string::npos);
  done.get_future().wait();
  // the step ends just after the request's last event
  int status = 0;
  for (int i = 0; i < 100 && (status = request(s.port(), "GET", "/health").status) != 200; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(status, 200);
}

// With a log nobody reads (a full pipe), request lines are dropped and counted, and the I/O thread
// goes on answering.
TEST(ServerHttp, AnUnreadLogDoesNotStopTheServer) {
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  ServerOptions so;
  so.log_requests = true;
  so.log = std::make_shared<LineLog>(pipe_fds[1]);
  LiveServer s(tiny_engine_options(), so);
  const std::string long_path = "/" + std::string(3000, 'p');
  const auto t0 = Clock::now();
  for (int i = 0; i < 60; ++i) EXPECT_EQ(request(s.port(), "GET", long_path).status, 404);  // 180 KB of lines
  EXPECT_LT(seconds_since(t0), 10.0);
  EXPECT_GT(metric_of(request(s.port(), "GET", "/metrics").raw, "dsv41_log_lines_dropped_total"), 0);
  std::string drained(1 << 16, '\0');
  EXPECT_GT(read(pipe_fds[0], drained.data(), drained.size()), 0);
  so.log->write("after");  // reports what it dropped
  std::string last(8192, '\0');
  const ssize_t n = read(pipe_fds[0], last.data(), last.size());
  ASSERT_GT(n, 0);
  EXPECT_NE(last.substr(0, static_cast<size_t>(n)).find("earlier lines dropped"), std::string::npos);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
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
