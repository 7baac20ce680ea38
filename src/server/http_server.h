// The OpenAI-compatible HTTP front of an Engine (cpp-httplib underneath):
//   POST /v1/chat/completions   chat, plain or streamed (SSE)
//   POST /v1/completions        text completion, plain or streamed (SSE)
//   GET  /v1/models, /v1/models/{id}
//   GET  /health                {"status":"ok"}
//   GET  /metrics               Prometheus text (engine counters, KV pages, HTTP responses)
//   POST /v1/debug/render       a chat body's rendered prompt and token ids, without generating
//                               (to check what the template made of messages and tools)
//   POST /tokenize, /detokenize vLLM's token routes
// Errors are OpenAI error bodies: 400 bad input, 401 missing or wrong API key, 403 a Host or Origin
// not allowed, 404 unknown route or model, 405 wrong method, 411 a body without Content-Length,
// 413 body over the limit, 415 a body that is not plain JSON, 500 engine failure, 503 shutting down.
// Who may call and which bodies are read is server/access_policy.h, decided before the body is read.
//
// Threads: connections are served by a pool (one thread per open connection, so the pool bounds the
// concurrent streams); the engine's scheduler thread only ever appends to a per-request EventChannel.
// A streaming connection writes events as they come and, while there are none, an SSE comment every
// heartbeat; a failed write means the client is gone, and the request is cancelled so its KV pages
// are freed at once. A plain (non-streaming) request cannot notice its client leaving (httplib 0.11
// gives handlers no socket), so it runs to its max_tokens.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "text/chat_encoding.h"

namespace dsv41::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                            // 0: any free port (bind() says which)
  size_t max_body_bytes = size_t{8} << 20;    // larger bodies get 413
  int threads = 64;                           // connection threads: the most concurrent connections served
  ChatOptions chat;                           // template defaults (thinking on unless a request says off)
  int64_t default_max_tokens = 8192;          // max_tokens of a request that gives none (capped by the context)
  std::chrono::seconds read_timeout{30};      // a client that stalls mid-request is dropped
  std::chrono::seconds write_timeout{30};     // a client that stops reading a stream is dropped (and cancelled)
  std::chrono::milliseconds heartbeat{1000};  // idle stream: a ": keep-alive" comment this often
  bool log_requests = false;                  // one line per request on stderr
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
  // Makes run() return: open requests are cancelled and the listening socket is closed. Safe to call
  // from any thread (not from a signal handler), more than once, and before run().
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv41::server
