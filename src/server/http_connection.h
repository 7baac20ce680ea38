// HTTP/1.x connections on Boost.Beast and Asio, with every limit enforced by the server rather than
// trusted to the client:
//
//  - deadlines, not per-recv timeouts: a request head must arrive whole within `header_timeout` of
//    the connection becoming idle, its body within `body_timeout`; a client trickling bytes is
//    dropped when its deadline passes. Reading holds no thread (one I/O thread serves every socket),
//    so trickling clients cannot starve anyone else.
//  - sizes: the head (request line and all header fields) at most `header_bytes` (431 beyond), the
//    body at most `body_bytes` whatever its framing (413), Content-Length or chunked alike; a
//    malformed head or chunk is a 400; an HTTP/1.1 request needs exactly one Host (400).
//  - memory: every body being read or waiting for its handler holds a share of one server-wide
//    budget, `body_bytes_in_flight`, taken from the head before any body byte is read (503 when it
//    does not fit) and given back when the handler lets go of the request; a streamed reply whose
//    client falls `stream_buffer_bytes` behind is dropped as gone, and the kernel holds at most
//    `socket_send_buffer` of it (its autotuning would let a client that reads nothing take 4 MB).
//  - connections: at most `max_connections`, and `max_client_connections` from one address; past
//    either, `probe_connections` more may open for GET or HEAD of /health and /metrics only (a
//    short head deadline, one request), so probes get through a full server; past those, 503.
//  - descriptors: an accept that fails (EMFILE: out of file descriptors) is retried after a short
//    back-off, logged once per episode, so the server serves again as soon as descriptors free.
//  - a check of the head before any body byte is read (`HeadCheck`), whose refusal is answered
//    and the connection closed, so the unread body can never be taken for another request.
//  - pipelining: requests are answered in order, bytes read past one request start the next.
//  - HTTP/1.0: no chunked framing (a stream ends by closing), no keep-alive unless asked for.
//  - HEAD: answered with the head the same GET would get, Content-Length included, and no body.
//  - a client that goes away is noticed while its request runs, streamed or not (its socket reads
//    end of stream), and the exchange's `on_gone` runs so the work can be cancelled.
//  - stop(grace): the listening socket and every idle connection are closed at once; a connection
//    whose request is being answered may finish its reply for up to `grace`, then it is closed too.
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
  size_t body_bytes_in_flight = size_t{128} << 20;  // all bodies read or being read and not yet let go
  size_t stream_buffer_bytes = size_t{4} << 20;     // a stream's unsent bytes past which its client is gone
  int socket_send_buffer = 256 << 10;               // SO_SNDBUF of each connection (the kernel's share)
  std::chrono::milliseconds header_timeout{30000};  // idle keep-alive wait + the whole head
  std::chrono::milliseconds body_timeout{60000};    // the whole body, once the head is in
  std::chrono::milliseconds write_timeout{30000};   // each write; a client that stops reading is dropped
  size_t max_connections = 1024;                    // more are answered 503 and closed
  size_t max_client_connections = 256;              // from one client address
  size_t probe_connections = 8;                     // past the caps, for probes only (half per address)
  std::chrono::milliseconds accept_backoff{50};     // after an accept fails (out of descriptors)
};

// A request's share of the body budget: held from its head until the handler lets go of the
// request, by which time its body and what was parsed from it are freed.
class BodyShare;

struct HttpRequest {
  std::shared_ptr<BodyShare> share;  // first, so it is released last
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
  // Whether the client has gone (or the connection was closed): work not yet started can be skipped.
  virtual bool gone() const = 0;
};

// Decides from the head alone: a reply answers the request without reading its body (an error
// status also closes the connection); headers in `add` go on whatever reply the request gets.
using HeadCheck = std::function<std::optional<HttpReply>(const RequestHead& head,
                                                         std::vector<std::pair<std::string, std::string>>& add)>;
using RequestHandler = std::function<void(std::shared_ptr<HttpExchange>, HttpRequest)>;
// Called after each reply, for counting and logging (status, method, path).
using ReplyObserver = std::function<void(int status, const std::string& method, const std::string& path)>;

// What the listener tells the operator: lines (accept failures) and counts.
struct ListenerEvents {
  std::function<void(const std::string&)> log;
  std::function<void()> accept_failed;           // each failed accept
  std::function<void(int status)> turned_away;   // each connection or body refused for a cap (503)
};

struct ListenerState;  // http_connection.cpp

// Accepts on one address and serves every connection on one I/O thread (the handler's heavy work
// belongs on its own threads). Handlers run on the I/O thread and must not block.
class HttpListener {
 public:
  HttpListener(HttpLimits limits, HeadCheck check, RequestHandler handler, ReplyObserver observer,
               ListenerEvents events = {});
  ~HttpListener();
  HttpListener(const HttpListener&) = delete;
  HttpListener& operator=(const HttpListener&) = delete;

  // Binds and listens; returns the port (a free one for port 0). Throws Error if it cannot.
  int bind(const std::string& host, int port);
  // Serves until stop(); returns when every connection has been closed.
  void run();
  // Closes the listening socket and every idle connection at once; connections answering a request
  // are closed when their reply is complete or `grace` has passed. Safe from any thread, more than once.
  void stop(std::chrono::milliseconds grace = std::chrono::milliseconds(0));

 private:
  std::shared_ptr<ListenerState> impl_;
};

}  // namespace dsv41::server
