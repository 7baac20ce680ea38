#include "server/http_server.h"

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "server/access_policy.h"
#include "server/event_channel.h"
#include "server/http_lib.h"
#include "server/metrics_text.h"
#include "server/openai_api.h"
#include "server/openai_response.h"
#include "util/error.h"

namespace dsv41::server {
namespace {

using json = nlohmann::json;

constexpr const char* kJson = "application/json";

// The routes and the methods they take, for telling 405 from 404.
struct Route {
  const char* path;
  const char* method;
};
constexpr Route kRoutes[] = {{"/v1/chat/completions", "POST"}, {"/v1/completions", "POST"},
                             {"/v1/debug/render", "POST"},     {"/v1/models", "GET"},
                             {"/tokenize", "POST"},            {"/detokenize", "POST"},
                             {"/health", "GET"},               {"/metrics", "GET"}};

// httplib listens with a backlog of 5, compiled into the library: a burst of new connections (a
// dozen clients starting at once) overflows the accept queue, and with SYN cookies the kernel then
// resets some of them instead of letting them wait. listen() on a listening socket only changes its
// backlog; the socket is a protected member, hence the subclass.
class Listener : public httplib::Server {
 public:
  void widen_backlog() { ::listen(svr_sock_.load(), SOMAXCONN); }
};

int64_t unix_now() { return static_cast<int64_t>(std::time(nullptr)); }

void send_error(httplib::Response& res, const ApiError& error) {
  res.status = error.status;
  res.set_content(dump_json(error_body(error)), kJson);
}

}  // namespace

struct HttpServer::Impl {
  Engine& engine;
  ServerOptions options;
  ModelInfo info;
  int64_t started = unix_now();
  Listener http;

  std::atomic<bool> stopping{false};
  std::atomic<bool> running{false};
  std::mutex active_mu;
  std::unordered_set<uint64_t> active;  // engine ids of requests being answered

  std::mutex counters_mu;
  HttpCounters counters;

  AccessPolicy policy;

  Impl(Engine& e, ServerOptions o) : engine(e), options(std::move(o)) {
    if (options.served_model_names.empty()) {
      info.name = engine.model_name();
    } else {
      info.name = options.served_model_names.front();
      info.aliases.assign(options.served_model_names.begin() + 1, options.served_model_names.end());
    }
    policy.api_key = options.api_key;
    policy.cors_origins = options.cors_origins;
    policy.loopback_only_hosts = is_loopback_address(options.host);
    info.context_length = engine.config().max_seq_len;
    info.bos_id = static_cast<int32_t>(engine.config().bos_token_id);
    info.tokenizer = &engine.tokenizer();
    info.chat = options.chat;
    info.test_hooks = options.test_hooks;
    info.default_max_tokens = options.default_max_tokens;
  }

  void count(const std::function<void(HttpCounters&)>& f) {
    std::lock_guard<std::mutex> lock(counters_mu);
    f(counters);
  }

  // Registers a submitted request so stop() can cancel it; false if the server is already stopping.
  bool track(uint64_t id) {
    std::lock_guard<std::mutex> lock(active_mu);
    active.insert(id);
    return !stopping.load();
  }
  void untrack(uint64_t id) {
    std::lock_guard<std::mutex> lock(active_mu);
    active.erase(id);
  }

  void setup();
  void generate(Endpoint endpoint, const httplib::Request& req, httplib::Response& res);
  void stream(uint64_t id, std::shared_ptr<EventChannel> channel, std::shared_ptr<ResponseBuilder> builder,
              httplib::Response& res);
  void render(const httplib::Request& req, httplib::Response& res);
  json model_object(const std::string& id) const {
    return {{"id", id}, {"object", "model"}, {"created", started}, {"owned_by", "dsv41"},
            {"max_model_len", info.context_length}};
  }
  bool serves(const std::string& id) const {
    return id == info.name || std::find(info.aliases.begin(), info.aliases.end(), id) != info.aliases.end();
  }
};

void HttpServer::Impl::generate(Endpoint endpoint, const httplib::Request& req, httplib::Response& res) {
  ApiRequest api;
  try {
    api = parse_request(endpoint, req.body, info);
  } catch (const ApiError& e) {
    send_error(res, e);
    return;
  }
  RequestParams params = std::move(api.params);  // the engine's; the builder needs only the rest
  auto builder = std::make_shared<ResponseBuilder>(
      api, engine.tokenizer(), make_response_id(endpoint == Endpoint::ChatCompletions ? "chatcmpl-" : "cmpl-"),
      unix_now());
  auto channel = std::make_shared<EventChannel>();
  uint64_t id = 0;
  try {
    if (stopping) throw ApiError(503, "server_error", "the server is shutting down");
    id = engine.submit(std::move(params), [channel](const TokenEvent& e) { channel->push(e); });
  } catch (const ApiError& e) {
    send_error(res, e);
    return;
  } catch (const Error& e) {
    // The engine refuses what can never run (validation catches the usual cases first), naming the
    // request field at fault, or what it cannot take now.
    send_error(res, api_error_from(e));
    return;
  }
  if (!track(id)) engine.cancel(id);

  if (api.stream) {
    stream(id, std::move(channel), std::move(builder), res);
    return;
  }
  while (!builder->done()) {
    for (const TokenEvent& e : channel->pop_all(std::chrono::milliseconds(500))) builder->add(e);
  }
  untrack(id);
  if (builder->failure()) {
    send_error(res, *builder->failure());
  } else {
    res.set_content(dump_json(builder->response()), kJson);
  }
}

void HttpServer::Impl::stream(uint64_t id, std::shared_ptr<EventChannel> channel,
                              std::shared_ptr<ResponseBuilder> builder, httplib::Response& res) {
  count([](HttpCounters& c) { ++c.streams_open; });
  auto released = std::make_shared<std::atomic<bool>>(false);
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");  // proxies must not hold events back
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, channel, builder](size_t, httplib::DataSink& sink) {
        std::string out;
        for (const TokenEvent& e : channel->pop_all(options.heartbeat)) {
          for (const json& payload : builder->add(e)) out += sse_event(payload);
        }
        if (builder->done()) out += kSseDone;
        // With nothing to send, a comment: SSE readers skip it, and writing it is how a client that
        // left while its request waited in the queue is noticed.
        if (out.empty()) out = ": keep-alive\n\n";
        if (!sink.write(out.data(), out.size())) return false;
        if (builder->done()) sink.done();
        return true;
      },
      [this, id, builder, released](bool) {
        if (released->exchange(true)) return;
        if (!builder->done()) {
          engine.cancel(id);  // the client went away (or the server stops): free its pages now
          count([](HttpCounters& c) { ++c.client_disconnects; });
        }
        untrack(id);
        count([](HttpCounters& c) { --c.streams_open; });
      });
}

void HttpServer::Impl::render(const httplib::Request& req, httplib::Response& res) {
  try {
    ApiRequest api = parse_request(Endpoint::ChatCompletions, req.body, info);
    json out = {{"model", api.model},
                {"prompt", api.prompt_text},
                {"token_ids", api.params.prompt},
                {"prompt_tokens", api.params.prompt.size()},
                {"thinking", api.thinking},
                {"max_tokens", api.params.max_tokens}};
    res.set_content(dump_json(out), kJson);
  } catch (const ApiError& e) {
    send_error(res, e);
  }
}

void HttpServer::Impl::setup() {
  // One thread per open connection; a stream holds its thread until it ends.
  const size_t threads = static_cast<size_t>(std::max(options.threads, 2));
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http.set_payload_max_length(options.max_body_bytes);
  http.set_read_timeout(options.read_timeout);
  http.set_write_timeout(options.write_timeout);
  http.set_keep_alive_max_count(1000);
  http.set_tcp_nodelay(true);  // SSE events are small; do not wait to coalesce them

  auto guarded = [this](auto handler) {
    return [this, handler](const httplib::Request& req, httplib::Response& res) {
      try {
        handler(req, res);
      } catch (const ApiError& e) {
        send_error(res, e);
      } catch (const std::exception& e) {
        send_error(res, server_error(std::string("internal error: ") + e.what()));
      }
    };
  };
  http.Post("/v1/chat/completions", guarded([this](const httplib::Request& req, httplib::Response& res) {
              generate(Endpoint::ChatCompletions, req, res);
            }));
  http.Post("/v1/completions", guarded([this](const httplib::Request& req, httplib::Response& res) {
              generate(Endpoint::Completions, req, res);
            }));
  http.Post("/v1/debug/render",
            guarded([this](const httplib::Request& req, httplib::Response& res) { render(req, res); }));
  http.Post("/tokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
              res.set_content(dump_json(tokenize(req.body, info)), kJson);
            }));
  http.Post("/detokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
              res.set_content(dump_json(detokenize(req.body, info)), kJson);
            }));
  http.Get("/v1/models", guarded([this](const httplib::Request&, httplib::Response& res) {
             json data = json::array({model_object(info.name)});
             for (const std::string& alias : info.aliases) data.push_back(model_object(alias));
             res.set_content(dump_json({{"object", "list"}, {"data", data}}), kJson);
           }));
  http.Get(R"(/v1/models/(.+))", guarded([this](const httplib::Request& req, httplib::Response& res) {
             const std::string id = req.matches[1];
             if (!serves(id)) {
               throw ApiError(404, "invalid_request_error", "The model `" + printable(id) + "` does not exist",
                              "model", "model_not_found");
             }
             res.set_content(dump_json(model_object(id)), kJson);
           }));
  http.Get("/health", guarded([this](const httplib::Request&, httplib::Response& res) {
             res.set_content(dump_json({{"status", "ok"}, {"model", info.name}}), kJson);
           }));
  http.Get("/metrics", guarded([this](const httplib::Request&, httplib::Response& res) {
             HttpCounters c;
             {
               std::lock_guard<std::mutex> lock(counters_mu);
               c = counters;
             }
             res.set_content(render_metrics(engine.metrics(), c), "text/plain; version=0.0.4");
           }));

  // Before routing and before any body byte is read: who may call, and which bodies are read at all.
  // A refusal closes the connection, since the body it did not read would otherwise be taken for the
  // next request.
  http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    RequestHead head{req.method, req.path, {req.headers.begin(), req.headers.end()}};
    const AccessDecision d = decide_access(head, policy);
    for (const auto& [name, value] : d.headers) res.set_header(name, value);
    if (d.refusal) {
      send_error(res, *d.refusal);
      if (d.refusal->status == 401) res.set_header("WWW-Authenticate", "Bearer");
      res.set_header("Connection", "close");
      return httplib::Server::HandlerResponse::Handled;
    }
    if (d.preflight) {
      res.status = 204;
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });

  // Statuses httplib decides itself (no route, body too large, malformed HTTP) get an OpenAI error
  // body too; responses that already have one keep it.
  http.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    ApiError error(res.status, "invalid_request_error", "");
    // A known path with another method: httplib finds no route (404), or for a method it expects a
    // body with (PATCH without one) it fails to read the request (400). Either way the answer is 405.
    std::string allow;
    for (const Route& r : kRoutes) {
      if (req.path == r.path) allow += (allow.empty() ? "" : ", ") + std::string(r.method);
    }
    if (req.path.rfind("/v1/models/", 0) == 0 && req.path.size() > 11) allow = "GET";
    if (allow.find(req.method) != std::string::npos) allow.clear();
    if (res.status == 404 || res.status == 400) {
      if (!allow.empty()) {
        error.status = res.status = 405;
        error.message = "Method " + req.method + " is not allowed on " + req.path + " (allowed: " + allow + ")";
        error.code = "method_not_allowed";
        res.set_header("Allow", allow);
      } else if (res.status == 404) {
        error.message = "Unknown route " + printable(req.method) + " " + printable(req.path);
        error.code = "not_found";
      } else {
        error.message = "malformed HTTP request";
      }
    } else if (res.status == 413) {
      error.message = "The request body is larger than this server's limit of " +
                      std::to_string(options.max_body_bytes) + " bytes";
      error.code = "request_too_large";
    } else if (res.status >= 500) {
      error.type = "server_error";
      error.message = "internal server error";
    } else {
      error.message = "malformed HTTP request";
    }
    send_error(res, error);
  });
  http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    count([&](HttpCounters& c) {
      if (res.status >= 500) {
        ++c.responses_5xx;
      } else if (res.status >= 400) {
        ++c.responses_4xx;
      } else {
        ++c.responses_2xx;
      }
    });
    if (options.log_requests) {
      std::fprintf(stderr, "%s %s %d\n", printable(req.method).c_str(), printable(req.path).c_str(), res.status);
    }
  });
}

HttpServer::HttpServer(Engine& engine, ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, std::move(options))) {
  // A client that closes its connection makes the next write raise SIGPIPE, whose default action
  // ends the process; httplib's sends do not pass MSG_NOSIGNAL, so the signal is ignored process-wide
  // and the failed write is handled as an error instead.
  std::signal(SIGPIPE, SIG_IGN);
  impl_->setup();
}

HttpServer::~HttpServer() { stop(); }

int HttpServer::bind() {
  Impl& m = *impl_;
  int port = m.options.port;
  if (port == 0) {
    port = m.http.bind_to_any_port(m.options.host);
    if (port < 0) fail(m.options.host, "cannot bind a free port");
  } else if (!m.http.bind_to_port(m.options.host, port)) {
    fail(m.options.host + ":" + std::to_string(port), "cannot listen here (address in use or not local?)");
  }
  m.http.widen_backlog();
  return port;
}

void HttpServer::run() {
  Impl& m = *impl_;
  m.running = true;
  if (!m.stopping) m.http.listen_after_bind();
  m.running = false;
}

void HttpServer::stop() {
  Impl& m = *impl_;
  if (m.stopping.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(m.active_mu);
    for (uint64_t id : m.active) m.engine.cancel(id);
  }
  // run() may be between its start and httplib marking itself running; stop() only takes effect on a
  // running server, so wait for that moment (or for run() to have returned).
  while (m.running) {
    if (m.http.is_running()) {
      m.http.stop();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace dsv41::server
