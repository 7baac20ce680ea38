// A live server for tests: the real HttpServer over the tiny checkpoint on a free loopback port, and
// small clients for plain and streamed (SSE) requests.
#pragma once

#include <arpa/inet.h>
#include <poll.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/engine.h"
#include "http_lib.h"
#include "server/http_server.h"
#include "test_util.h"

namespace dsv41::server {

using json = nlohmann::json;

// A server on a free loopback port, serving on its own thread.
class LiveServer {
 public:
  explicit LiveServer(EngineOptions eo, ServerOptions so = {}) : engine_(eo) {
    // The test client (Debian's cpp-httplib) writes without MSG_NOSIGNAL: a server that answers and
    // closes before the whole request is sent (413, 415) would otherwise end the test by SIGPIPE.
    std::signal(SIGPIPE, SIG_IGN);
    so.host = "127.0.0.1";
    so.port = 0;
    so.heartbeat = std::chrono::milliseconds(200);
    server_ = std::make_unique<HttpServer>(engine_, so);
    port_ = server_->bind();
    thread_ = std::thread([this] { server_->run(); });
  }
  ~LiveServer() {
    server_->stop();
    thread_.join();
  }
  int port() const { return port_; }
  Engine& engine() { return engine_; }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

 private:
  Engine engine_;
  std::unique_ptr<HttpServer> server_;
  int port_ = 0;
  std::thread thread_;
};

inline EngineOptions tiny_engine_options() {
  EngineOptions eo;
  eo.model_dir = test::tiny_model_dir();
  eo.parallel = 4;
  eo.prefill_chunk = 128;
  return eo;
}

struct Reply {
  int status = -1;
  json body;
  std::string raw;
  std::string error;  // why there is no response
};

// What a client call returned: the response, or why there is none.
inline Reply reply_of(const httplib::Result& res) {
  Reply r;
  if (!res) {
    r.error = httplib::to_string(res.error());
    return r;
  }
  r.status = res->status;
  r.raw = res->body;
  r.body = json::parse(res->body, nullptr, false);
  return r;
}

inline Reply request(int port, const std::string& method, const std::string& path, const std::string& body = "") {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(std::chrono::seconds(60));
  httplib::Result res = method == "GET"      ? cli.Get(path.c_str())
                        : method == "DELETE" ? cli.Delete(path.c_str())
                        : method == "PATCH"  ? cli.Patch(path.c_str())
                        : method == "PUT"    ? cli.Put(path.c_str(), body, "application/json")
                                             : cli.Post(path.c_str(), body, "application/json");
  return reply_of(res);
}

inline Reply post(int port, const std::string& path, const json& body) { return request(port, "POST", path, body.dump()); }

struct Stream {
  int status = -1;
  std::vector<json> events;  // the data payloads (before [DONE] where the stream has one)
  bool done = false;         // [DONE] was received
  double first_event_s = -1;  // seconds from sending the request to its first data event
  std::string raw;
  std::string error;  // why the response is missing or cut short
};

// Posts a streaming request and reads its SSE events; with `stop_after` > 0, closes the connection
// once that many events have arrived (a client going away mid-stream).
inline Stream post_stream(int port, const std::string& path, const json& body, size_t stop_after = 0) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(std::chrono::seconds(60));
  Stream s;
  std::string pending;
  const auto sent = std::chrono::steady_clock::now();
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    s.raw.append(data, n);
    pending.append(data, n);
    for (size_t end; (end = pending.find("\n\n")) != std::string::npos;) {
      const std::string event = pending.substr(0, end);
      pending.erase(0, end + 2);
      // "data: ..." or, in a typed event, "event: NAME\ndata: ..."; anything else is a comment (keep-alive)
      const size_t data_at = event.rfind("data: ", 0) == 0 ? 0 : event.find("\ndata: ");
      if (data_at == std::string::npos) continue;
      const std::string data_text = event.substr(data_at == 0 ? 6 : data_at + 7);
      if (s.first_event_s < 0) s.first_event_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - sent).count();
      if (data_text == "[DONE]") {
        s.done = true;
      } else {
        s.events.push_back(json::parse(data_text, nullptr, false));
      }
    }
    return stop_after == 0 || s.events.size() < stop_after;
  };
  httplib::Result res = cli.send(req);
  if (res) {
    s.status = res->status;
  } else {
    s.error = httplib::to_string(res.error());
  }
  return s;
}


// True once `out` holds a whole response: its head and as many body bytes as it declares.
inline bool complete_response(const std::string& out) {
  const size_t end = out.find("\r\n\r\n");
  if (end == std::string::npos) return false;
  const size_t at = out.find("Content-Length: ");
  if (at == std::string::npos || at > end) return true;
  return out.size() >= end + 4 + std::stoul(out.substr(at + 16));
}

inline std::string exchange(int port, const std::string& bytes, bool* closed, bool wait_for_close = true) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return "";
  }
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  (void)!send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[4096];
  *closed = false;
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n == 0) *closed = true;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (!wait_for_close && complete_response(out)) break;
  }
  close(fd);
  return out;
}

// A connected socket the test writes to at its own pace.
class RawClient {
 public:
  // `from`: the loopback address to connect from (127.0.0.2, ...), so a test can be several clients.
  // `receive_buffer` > 0: the socket's receive buffer, set before connecting (a client that reads
  // nothing then holds only that much of what the server sends).
  explicit RawClient(int port, const char* from = nullptr, int receive_buffer = 0) : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    if (receive_buffer > 0) setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer);
    if (from != nullptr) {
      sockaddr_in local{};
      local.sin_family = AF_INET;
      inet_pton(AF_INET, from, &local.sin_addr);
      if (bind(fd_, reinterpret_cast<sockaddr*>(&local), sizeof local) != 0) return;
    }
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }
  ~RawClient() { close(fd_); }
  bool connected() const { return connected_; }
  bool send_bytes(const std::string& b) { return ::send(fd_, b.data(), b.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(b.size()); }
  // Reads until the server closes or `seconds` pass; `closed` says which.
  std::string read_all(double seconds, bool* closed) {
    std::string out;
    *closed = false;
    const auto t0 = std::chrono::steady_clock::now();
    char buf[4096];
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 50) <= 0) continue;
      const ssize_t n = recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) {
        *closed = true;
        break;
      }
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }

 private:
  int fd_;
  bool connected_ = false;
};

// The engine's metrics once it has nothing running or queued (or after 20 s).
inline EngineMetrics idle_metrics(Engine& engine) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  EngineMetrics m = engine.metrics();
  while ((m.requests_running > 0 || m.requests_queued > 0) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    m = engine.metrics();
  }
  return m;
}

inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

}  // namespace dsv41::server
