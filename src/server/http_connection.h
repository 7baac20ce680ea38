// HTTP/1.x connections on Boost.Beast and Asio, with every limit enforced by the server rather than
// trusted to the client:
//
//  - deadlines, not per-recv timeouts: a request head must arrive whole within `header_timeout` of
//    the connection becoming idle, its body within `body_timeout`; a client trickling bytes is
//    dropped when its deadline passes. Reading holds no thread (one I/O thread serves every socket),
//    so trickling clients cannot starve anyone else.
//  - sizes: the head (request line and all header fields) at most `header_bytes` (431 beyond), the
//    body at most `body_bytes` whatever its framing (413), Content-Length or chunked alike.
//  - a check of the head before any body byte is read (`HeadCheck`), whose refusal is answered
//    and the connection closed, so the unread body can never be taken for another request.
//  - pipelining: requests are answered in order, bytes read past one request start the next.
//  - HTTP/1.0: no chunked framing (a stream ends by closing), no keep-alive unless asked for.
//  - a client that goes away is noticed while its request runs, streamed or not (its socket reads
//    end of stream), and the exchange's `on_gone` runs so the work can be cancelled.
//  - stop(): every connection is closed at once.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "server/access_policy.h"

namespace dsv41::server {

struct HttpLimits {
  size_t header_bytes = 64 << 10;
  size_t body_bytes = size_t{8} << 20;
  std::chrono::milliseconds header_timeout{30000};  // idle keep-alive wait + the whole head
  std::chrono::milliseconds body_timeout{60000};    // the whole body, once the head is in
  std::chrono::milliseconds write_timeout{30000};   // each write; a client that stops reading is dropped
  size_t max_connections = 1024;                    // more are answered 503 and closed
};

struct HttpRequest {
  RequestHead head;  // method, path (the target without its query), headers
  std::string target;
  int version = 11;  // 10 or 11
  std::string body;
};

struct HttpReply {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  bool close = false;  // close the connection after this reply
};

// One request's answer, given by the handler from any thread, once: reply(), or start_stream()
// followed by send()s and finish(). Calls after the client is gone are ignored.
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  virtual void reply(HttpReply reply) = 0;
  // Starts a streamed reply; while nothing is sent for `idle_every`, `idle_text` is sent (an SSE
  // comment keeps proxies and clients from timing out, and is how a silent client's departure shows).
  virtual void start_stream(int status, std::string content_type, std::vector<std::pair<std::string, std::string>> headers,
                            std::string idle_text, std::chrono::milliseconds idle_every) = 0;
  virtual void send(std::string data) = 0;
  virtual void finish() = 0;
  // `fn` runs once, on the connection's thread, if the client disconnects or a write fails before
  // the reply is complete; set it before submitting work that it should cancel.
  virtual void on_gone(std::function<void()> fn) = 0;
  // `fn` runs once after `delay` unless the reply is complete by then (a request deadline).
  virtual void after(std::chrono::milliseconds delay, std::function<void()> fn) = 0;
};

// Decides from the head alone: a reply answers the request without reading its body (an error
// status also closes the connection); headers in `add` go on whatever reply the request gets.
using HeadCheck = std::function<std::optional<HttpReply>(const RequestHead& head,
                                                         std::vector<std::pair<std::string, std::string>>& add)>;
using RequestHandler = std::function<void(std::shared_ptr<HttpExchange>, HttpRequest)>;
// Called after each reply, for counting and logging (status, method, path).
using ReplyObserver = std::function<void(int status, const std::string& method, const std::string& path)>;

struct ListenerState;  // http_connection.cpp

// Accepts on one address and serves every connection on one I/O thread (the handler's heavy work
// belongs on its own threads). Handlers run on the I/O thread and must not block.
class HttpListener {
 public:
  HttpListener(HttpLimits limits, HeadCheck check, RequestHandler handler, ReplyObserver observer);
  ~HttpListener();
  HttpListener(const HttpListener&) = delete;
  HttpListener& operator=(const HttpListener&) = delete;

  // Binds and listens; returns the port (a free one for port 0). Throws Error if it cannot.
  int bind(const std::string& host, int port);
  // Serves until stop(); returns when every connection has been closed.
  void run();
  // Closes the listening socket and every connection; safe from any thread, more than once.
  void stop();

 private:
  std::shared_ptr<ListenerState> impl_;
};

}  // namespace dsv41::server
