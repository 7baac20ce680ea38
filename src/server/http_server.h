// The OpenAI-compatible HTTP front of an Engine (Boost.Beast underneath):
//   POST /v1/chat/completions   chat, plain or streamed (SSE)
//   POST /v1/messages           Anthropic's Messages API, plain or streamed (server/messages_api.h);
//   POST /v1/messages/count_tokens   its prompt's tokens; errors on both in Anthropic's shape
//   POST /v1/completions        text completion, plain or streamed (SSE)
//   GET  /v1/models, /v1/models/{id}
//   GET  /health                {"status":"ok"}; 503 {"status":"stalled"} while a step has run past
//                               `stall_timeout` (work that makes no progress: a peer that stopped)
//   GET  /metrics               Prometheus text (engine counters, KV pages, HTTP responses)
//   POST /v1/debug/render       a chat body's rendered prompt and token ids, without generating
//                               (to check what the template made of messages and tools)
//   POST /tokenize, /detokenize vLLM's token routes
// Errors are OpenAI error bodies: 400 bad input, 401 missing or wrong API key, 403 a Host or Origin
// not allowed, 404 unknown route or model, 405 wrong method, 411 a body without Content-Length,
// 413 body over the limit, 415 a body that is not plain JSON, 500 engine failure, 503 shutting down
// or over a cap (connections, body bytes in flight), 504 past the request timeout. GET routes take HEAD.
// Who may call and which bodies are read is server/access_policy.h, decided before the body is read.
//
// Threads: every socket is read and written on one I/O thread (server/http_connection.h), so slow or
// idle clients hold no thread; request bodies are parsed and tokenized on `threads` workers; the
// engine's scheduler thread turns its events into response bytes and hands them to the connection.
// A client that goes away is noticed while its request runs, streamed or not, and the request is
// cancelled so its KV pages are freed at once.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "server/image_parts.h"
#include "server/line_log.h"
#include "text/chat_encoding.h"

namespace dsv41::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                            // 0: any free port (bind() says which)
  size_t max_body_bytes = size_t{8} << 20;    // larger bodies get 413, whatever their framing
  size_t max_header_bytes = 64 << 10;         // a larger request head gets 431
  size_t max_connections = 1024;              // more connections are answered 503 and closed
  size_t max_client_connections = 256;        // from one client address; more are answered 503
  size_t probe_connections = 8;               // past the caps, for GET /health and /metrics only
  size_t body_bytes_in_flight = size_t{128} << 20;  // bodies read and not yet parsed, all requests; more: 503
  size_t stream_buffer_bytes = size_t{4} << 20;     // a stream whose client falls this far behind is cancelled
  int threads = 4;                            // workers that parse and tokenize request bodies
  ChatOptions chat;                           // template defaults (thinking on unless a request says off)
  ImageLimits images;                         // images per request, their bytes and pixels
  int64_t default_max_tokens = 8192;          // max_tokens of a request that gives none (capped by the context)
  std::chrono::milliseconds header_timeout{30000};  // deadline for a whole request head (and keep-alive idling)
  std::chrono::milliseconds body_timeout{60000};    // deadline for a whole body once its head is in
  std::chrono::milliseconds write_timeout{30000};   // a client that stops reading is dropped (and cancelled)
  std::chrono::milliseconds request_timeout{0};     // from the request's arrival: a request still running ends with 504; 0: none
  std::chrono::milliseconds shutdown_grace{10000};  // stop(): requests in flight get their 503 or error event meanwhile
  std::chrono::milliseconds stall_timeout{120000};  // /health answers 503 while a step has run longer
  std::chrono::milliseconds heartbeat{1000};  // idle stream: a ": keep-alive" comment this often
  bool log_requests = false;                  // one line per request in the log
  // Lines for the operator (requests with log_requests, accept failures); null: a LineLog of stderr,
  // which drops lines rather than blocking when nobody reads it.
  std::shared_ptr<LineLog> log;
  std::vector<std::string> served_model_names;  // the id clients use, then aliases; empty: the engine's model_name()
  std::string api_key;                        // non-empty: Bearer authentication on /v1/ and the token routes
  std::vector<std::string> cors_origins;      // origins web pages may call from ("*": any); empty: none
  bool test_hooks = false;                    // accept "dsv41_forced_output" (tests only)
};

class HttpServer {
 public:
  HttpServer(Engine& engine, ServerOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds the listening socket and returns its port. Throws Error if the address cannot be bound.
  int bind();
  // Serves until stop() (call bind() first). Returns when every connection has ended.
  void run();
  // Makes run() return: the listening socket and idle connections are closed at once, open requests
  // are cancelled and get their 503 (or, streamed, an error event and [DONE]) within
  // `shutdown_grace`, after which what is left is closed. Safe to call from any thread (not from a
  // signal handler), more than once, and before run().
  void stop();
  // Whether stop() has been called: run() returning without it is a failure of the server.
  bool stop_requested() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv41::server
