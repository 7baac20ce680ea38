#include "server/http_server.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <ctime>
#include <mutex>
#include <unordered_set>

#include "server/access_policy.h"
#include "server/http_connection.h"
#include "server/messages_api.h"
#include "server/messages_output.h"
#include "server/metrics_text.h"
#include "server/openai_api.h"
#include "server/openai_response.h"
#include "server/responses_api.h"
#include "server/responses_output.h"
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
constexpr Route kRoutes[] = {{"/v1/chat/completions", "POST"}, {"/v1/completions", "POST"}, {"/v1/responses", "POST"},
                             {"/v1/messages", "POST"},         {"/v1/messages/count_tokens", "POST"},
                             {"/v1/debug/render", "POST"},     {"/v1/models", "GET"},
                             {"/tokenize", "POST"},            {"/detokenize", "POST"},
                             {"/health", "GET"},               {"/metrics", "GET"}};

int64_t unix_now() { return static_cast<int64_t>(std::time(nullptr)); }

HttpReply json_reply(int status, const json& body) {
  HttpReply r;
  r.status = status;
  r.body = dump_json(body);
  return r;
}

// Anthropic's routes answer errors in Anthropic's shape (server/messages_api.h), the others in OpenAI's.
bool anthropic_route(const std::string& path) { return path.rfind("/v1/messages", 0) == 0; }

HttpReply error_reply(const ApiError& e, bool anthropic = false) {
  HttpReply r = json_reply(e.status, anthropic ? messages_error_body(e) : error_body(e));
  if (e.status == 401) r.headers.push_back({"WWW-Authenticate", "Bearer"});
  return r;
}

// What the engine's sink and the server share; held by both, so a sink that fires after the server
// object has gone (the engine outlives it) still finds it.
struct Shared {
  std::mutex mu;
  HttpCounters counters;
  std::unordered_set<uint64_t> active;  // engine ids of requests being answered
  std::atomic<bool> stopping{false};

  template <class F>
  void count(F f) {
    std::lock_guard<std::mutex> lock(mu);
    f(counters);
  }
  // Registers a submitted request so stop() can cancel it; false if the server is already stopping.
  bool track(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu);
    active.insert(id);
    return !stopping.load();
  }
  void untrack(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu);
    active.erase(id);
  }
};

// The answer being built for one generation request: chat / completions chunks ("data:" events
// ending in [DONE]), Responses events or Messages events ("event:" and "data:", no [DONE]).
struct Output {
  std::shared_ptr<ResponseBuilder> chat;        // /v1/chat/completions, /v1/completions
  std::shared_ptr<ResponsesBuilder> responses;  // /v1/responses
  std::shared_ptr<MessagesBuilder> messages;    // /v1/messages

  bool done() const { return chat ? chat->done() : responses ? responses->done() : messages->done(); }
  const std::optional<ApiError>& failure() const {
    return chat ? chat->failure() : responses ? responses->failure() : messages->failure();
  }
  json response() const { return chat ? chat->response() : responses ? responses->response() : messages->message(); }
  HttpReply error(const ApiError& e) const { return error_reply(e, messages != nullptr); }
  // What a stream sends first, before any token.
  std::string stream_start() {
    std::string out;
    if (responses) {
      for (const ResponsesBuilder::Event& e : responses->start()) out += sse_typed_event(e);
    }
    if (messages) {
      for (const MessagesBuilder::Event& e : messages->start()) out += sse_named_event(e);
    }
    return out;
  }
  // What a stream sends for the event; a failure becomes `replace` when one is given (a timeout).
  std::string stream_text(const TokenEvent& e, const ApiError* replace) {
    std::string out;
    if (chat) {
      const std::vector<json> payloads = chat->add(e);
      if (chat->done() && chat->failure() && replace) {
        out += sse_event(error_body(*replace));
      } else {
        for (const json& p : payloads) out += sse_event(p);
      }
      if (chat->done()) out += kSseDone;
      return out;
    }
    if (messages) {
      std::vector<MessagesBuilder::Event> events = messages->add(e);
      if (messages->done() && messages->failure() && replace && !events.empty()) {
        events.back() = {"error", {{"type", "error"}, {"error", messages_error_body(*replace)["error"]}}};
      }
      for (const MessagesBuilder::Event& ev : events) out += sse_named_event(ev);
      return out;
    }
    std::vector<ResponsesBuilder::Event> events = responses->add(e);
    if (responses->done() && responses->failure() && replace && !events.empty()) {
      events.back() = {"error", {{"type", "error"}, {"code", replace->code}, {"message", replace->message},
                                 {"param", nullptr}, {"sequence_number", events.back().data["sequence_number"]}}};
    }
    for (const ResponsesBuilder::Event& ev : events) out += sse_typed_event(ev);
    return out;
  }
  void add(const TokenEvent& e) {  // a plain request: builds only
    if (chat) {
      chat->add(e);
    } else if (responses) {
      responses->add(e);
    } else {
      messages->add(e);
    }
  }
};

// One generation request between the engine's events and its exchange. Events can come before the
// request is wired (the engine starts at once), so they wait in `held` until `wire` has run; `mu`
// keeps the builder to one thread at a time.
struct Generation {
  std::mutex mu;
  bool wired = false;
  std::vector<TokenEvent> held;
  std::atomic<bool> timed_out{false};
  uint64_t id = 0;
  bool stream = false;
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<HttpExchange> exchange;
  Output builder;
  std::shared_ptr<Shared> shared;
  std::chrono::steady_clock::time_point arrived, last_token;
  bool first_token = true;

  void deliver(const TokenEvent& e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!wired) {
      held.push_back(e);
      return;
    }
    take(e);
  }
  void wire() {
    std::lock_guard<std::mutex> lock(mu);
    wired = true;
    for (const TokenEvent& e : held) take(e);
    held.clear();
  }
  ApiError timeout_error() const {
    return ApiError(504, "server_error",
                    "the request ran past the server's request timeout of " + std::to_string(timeout.count()) + " ms",
                    "", "request_timeout");
  }
  // The latency histograms: time to first token, between tokens, in the queue, and end to end.
  void observe(const TokenEvent& e) {
    const auto now = std::chrono::steady_clock::now();
    const auto secs = [](auto d) { return std::chrono::duration<double>(d).count(); };
    shared->count([&](HttpCounters& c) {
      if (e.token >= 0) {
        (first_token ? c.time_to_first_token : c.inter_token_latency).observe(secs(now - (first_token ? arrived : last_token)));
        if (e.queue_seconds >= 0) c.queue_time.observe(e.queue_seconds);
      }
      if (e.done && (e.finish_reason == FinishReason::Stop || e.finish_reason == FinishReason::Length)) c.e2e_latency.observe(secs(now - arrived));
    });
    if (e.token >= 0) first_token = false, last_token = now;
  }
  void take(const TokenEvent& e) {
    if (builder.done()) return;
    observe(e);
    if (stream) {
      const ApiError late = timeout_error();
      exchange->send(builder.stream_text(e, timed_out ? &late : nullptr));
    } else {
      builder.add(e);
    }
    if (!builder.done()) return;
    shared->untrack(id);
    if (stream) {
      exchange->finish();
      shared->count([](HttpCounters& c) { --c.streams_open; });
    } else if (timed_out && builder.failure()) {
      exchange->reply(builder.error(timeout_error()));
    } else if (builder.failure()) {
      exchange->reply(builder.error(*builder.failure()));
    } else {
      exchange->reply(json_reply(200, builder.response()));
    }
  }
};

}  // namespace

struct HttpServer::Impl {
  Engine& engine;
  ServerOptions options;
  ModelInfo info;
  int64_t started = unix_now();
  AccessPolicy policy;
  std::shared_ptr<Shared> shared = std::make_shared<Shared>();
  boost::asio::thread_pool workers;
  std::unique_ptr<HttpListener> listener;

  Impl(Engine& e, ServerOptions o)
      : engine(e), options(std::move(o)), workers(static_cast<size_t>(std::max(options.threads, 1))) {
    if (!options.log) options.log = std::make_shared<LineLog>(2);
    if (options.served_model_names.empty()) {
      info.name = engine.model_name();
    } else {
      info.name = options.served_model_names.front();
      info.aliases.assign(options.served_model_names.begin() + 1, options.served_model_names.end());
    }
    info.context_length = engine.config().max_seq_len;
    info.bos_id = static_cast<int32_t>(engine.config().bos_token_id);
    info.tokenizer = &engine.tokenizer();
    info.chat = options.chat;
    info.test_hooks = options.test_hooks;
    info.default_max_tokens = options.default_max_tokens;
    info.draft_block_size = engine.draft_block_size();
    info.priority_scheduling = engine.scheduling() == SchedulingPolicy::Priority;
    info.vision = engine.sees_images() ? &engine.config().vision : nullptr;
    info.images = options.images;
    policy.api_key = options.api_key;
    policy.cors_origins = options.cors_origins;
    policy.loopback_only_hosts = is_loopback_address(options.host);

    HttpLimits limits;
    limits.header_bytes = options.max_header_bytes;
    limits.body_bytes = options.max_body_bytes;
    limits.header_timeout = options.header_timeout;
    limits.body_timeout = options.body_timeout;
    limits.write_timeout = options.write_timeout;
    limits.max_connections = options.max_connections;
    limits.max_client_connections = options.max_client_connections;
    limits.probe_connections = options.probe_connections;
    limits.body_bytes_in_flight = options.body_bytes_in_flight;
    limits.stream_buffer_bytes = options.stream_buffer_bytes;
    ListenerEvents events;
    events.log = [log = options.log](const std::string& line) { log->write("http: " + line); };
    events.accept_failed = [sh = shared] { sh->count([](HttpCounters& c) { ++c.accept_failures; }); };
    events.turned_away = [sh = shared](int) { sh->count([](HttpCounters& c) { ++c.turned_away; }); };
    listener = std::make_unique<HttpListener>(
        limits, [this](const RequestHead& head, std::vector<std::pair<std::string, std::string>>& add) { return check(head, add); },
        [this](std::shared_ptr<HttpExchange> ex, HttpRequest req) { handle(std::move(ex), std::move(req)); },
        [this](int status, const std::string& method, const std::string& path) { observe(status, method, path); },
        std::move(events));
  }
  ~Impl() {
    listener.reset();  // no more requests reach the workers
    workers.join();
  }

  std::optional<HttpReply> check(const RequestHead& head, std::vector<std::pair<std::string, std::string>>& add) const;
  void handle(std::shared_ptr<HttpExchange> ex, HttpRequest req);
  void observe(int status, const std::string& method, const std::string& path);
  void generate(Endpoint endpoint, const std::shared_ptr<HttpExchange>& ex, const HttpRequest& req,
                std::chrono::steady_clock::time_point arrived);
  // /v1/messages/count_tokens: the prompt's tokens, image spans expanded, as a request would count them.
  json count_tokens(const std::string& body) const {
    const ApiRequest api = parse_messages_request(body, info, /*counting=*/true);
    try {
      return {{"input_tokens", engine.prompt_length(api.params.prompt, api.params.images)}};
    } catch (const Error& e) {
      throw api_error_from(e);
    }
  }
  // 200 while the engine makes progress; 503 while one step has run past the stall timeout (a peer
  // that stopped answering, a wedged kernel), so a supervisor's probe sees what clients feel.
  HttpReply health() const {
    const double step = engine.metrics().step_running_seconds;
    const double limit = std::chrono::duration<double>(options.stall_timeout).count();
    if (limit > 0 && step > limit) {
      return json_reply(503, {{"status", "stalled"}, {"model", info.name}, {"step_running_seconds", step},
                              {"stall_timeout_seconds", limit}});
    }
    return json_reply(200, {{"status", "ok"}, {"model", info.name}});
  }
  json model_object(const std::string& id) const {
    return {{"id", id}, {"object", "model"}, {"created", started}, {"owned_by", "dsv41"},
            {"max_model_len", info.context_length}};
  }
  bool serves(const std::string& id) const {
    return id == info.name || std::find(info.aliases.begin(), info.aliases.end(), id) != info.aliases.end();
  }
};

std::optional<HttpReply> HttpServer::Impl::check(const RequestHead& head,
                                                 std::vector<std::pair<std::string, std::string>>& add) const {
  const AccessDecision d = decide_access(head, policy);
  add = d.headers;
  if (d.refusal) return error_reply(*d.refusal, anthropic_route(head.path));
  if (d.preflight) {
    HttpReply r;
    r.status = 204;
    r.content_type = "text/plain";
    return r;
  }
  return std::nullopt;
}

void HttpServer::Impl::observe(int status, const std::string& method, const std::string& path) {
  shared->count([&](HttpCounters& c) {
    if (status >= 500) {
      ++c.responses_5xx;
    } else if (status >= 400) {
      ++c.responses_4xx;
    } else {
      ++c.responses_2xx;
    }
  });
  if (options.log_requests) options.log->write(printable(method) + " " + printable(path) + " " + std::to_string(status));
}

void HttpServer::Impl::handle(std::shared_ptr<HttpExchange> ex, HttpRequest req) {
  const std::string& path = req.head.path;
  const std::string& method = req.head.method;
  // Quick routes answer on the I/O thread, so probes keep working however busy the workers are. HEAD
  // gets the same answer, without its body (the connection leaves it out).
  if (method == "GET" || method == "HEAD") {
    if (path == "/health") return ex->reply(health());
    if (path == "/metrics") {
      HttpCounters c;
      {
        std::lock_guard<std::mutex> lock(shared->mu);
        c = shared->counters;
      }
      c.log_lines_dropped = options.log->dropped();
      HttpReply r;
      r.content_type = "text/plain; version=0.0.4";
      r.body = render_metrics(engine.metrics(), c);
      return ex->reply(std::move(r));
    }
    if (path == "/v1/models") {
      json data = json::array({model_object(info.name)});
      for (const std::string& alias : info.aliases) data.push_back(model_object(alias));
      return ex->reply(json_reply(200, {{"object", "list"}, {"data", data}}));
    }
    if (path.rfind("/v1/models/", 0) == 0 && path.size() > 11) {
      const std::string id = path.substr(11);
      if (!serves(id)) {
        return ex->reply(error_reply(ApiError(404, "invalid_request_error", "The model `" + printable(id) + "` does not exist",
                                              "model", "model_not_found")));
      }
      return ex->reply(json_reply(200, model_object(id)));
    }
  }
  if (method == "POST") {
    for (const Route& r : kRoutes) {
      if (path != r.path || std::string(r.method) != "POST") continue;
      const auto arrived = std::chrono::steady_clock::now();
      boost::asio::post(workers, [this, ex, arrived, req = std::move(req)] {
        if (ex->gone()) return;  // its client left while it waited for a worker: nothing to parse for
        try {
          const std::string& p = req.head.path;
          if (p == "/v1/chat/completions") return generate(Endpoint::ChatCompletions, ex, req, arrived);
          if (p == "/v1/completions") return generate(Endpoint::Completions, ex, req, arrived);
          if (p == "/v1/responses") return generate(Endpoint::Responses, ex, req, arrived);
          if (p == "/v1/messages") return generate(Endpoint::Messages, ex, req, arrived);
          if (p == "/v1/messages/count_tokens") return ex->reply(json_reply(200, count_tokens(req.body)));
          if (p == "/tokenize") return ex->reply(json_reply(200, tokenize(req.body, info)));
          if (p == "/detokenize") return ex->reply(json_reply(200, detokenize(req.body, info)));
          ApiRequest api = parse_request(Endpoint::ChatCompletions, req.body, info);  // /v1/debug/render
          ex->reply(json_reply(200, {{"model", api.model},
                                     {"prompt", api.prompt_text},
                                     {"token_ids", api.params.prompt},
                                     {"prompt_tokens", api.params.prompt.size()},
                                     {"thinking", api.thinking},
                                     {"max_tokens", api.params.max_tokens}}));
        } catch (const ApiError& e) {
          ex->reply(error_reply(e, anthropic_route(req.head.path)));
        } catch (const std::exception& e) {
          ex->reply(error_reply(server_error(std::string("internal error: ") + e.what()), anthropic_route(req.head.path)));
        }
      });
      return;
    }
  }
  // A known path with another method is 405 with the methods it takes; anything else 404.
  std::string allow;
  for (const Route& r : kRoutes) {
    if (path == r.path) allow += (allow.empty() ? "" : ", ") + std::string(r.method) + (r.method == std::string("GET") ? ", HEAD" : "");
  }
  if (path.rfind("/v1/models/", 0) == 0 && path.size() > 11) allow = "GET, HEAD";
  if (!allow.empty()) {
    HttpReply r = error_reply(ApiError(405, "invalid_request_error",
                                       "Method " + printable(method) + " is not allowed on " + printable(path) +
                                           " (allowed: " + allow + ")",
                                       "", "method_not_allowed"));
    r.headers.push_back({"Allow", allow});
    return ex->reply(std::move(r));
  }
  ex->reply(error_reply(ApiError(404, "invalid_request_error", "Unknown route " + printable(method) + " " + printable(path),
                                 "", "not_found"),
                        anthropic_route(path)));
}

// On a worker: parse, submit, and wire the engine's events to the exchange.
void HttpServer::Impl::generate(Endpoint endpoint, const std::shared_ptr<HttpExchange>& ex, const HttpRequest& req,
                                std::chrono::steady_clock::time_point arrived) {
  // The deadline counts from the request's arrival: its wait for a worker and its parsing are in it.
  const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - arrived);
  if (options.request_timeout.count() > 0 && spent >= options.request_timeout) {
    return ex->reply(error_reply(ApiError(504, "server_error",
                                          "the request waited past the server's request timeout of " +
                                              std::to_string(options.request_timeout.count()) + " ms before it could start",
                                          "", "request_timeout"),
                                 endpoint == Endpoint::Messages));
  }
  ApiRequest api = endpoint == Endpoint::Responses ? parse_responses_request(req.body, info)
                   : endpoint == Endpoint::Messages ? parse_messages_request(req.body, info)
                                                    : parse_request(endpoint, req.body, info);
  RequestParams params = std::move(api.params);  // the engine's; the builder needs only the rest
  auto g = std::make_shared<Generation>();
  g->arrived = arrived;
  g->stream = api.stream;
  g->timeout = options.request_timeout;
  g->exchange = ex;
  g->shared = shared;
  if (endpoint == Endpoint::Responses) {
    g->builder.responses = std::make_shared<ResponsesBuilder>(api, make_response_id("resp_"), unix_now());
  } else if (endpoint == Endpoint::Messages) {
    g->builder.messages = std::make_shared<MessagesBuilder>(api, make_response_id("msg_"));
  } else {
    g->builder.chat = std::make_shared<ResponseBuilder>(
        api, engine.tokenizer(), make_response_id(endpoint == Endpoint::ChatCompletions ? "chatcmpl-" : "cmpl-"), unix_now());
  }
  try {
    if (shared->stopping) throw ApiError(503, "server_error", "the server is shutting down");
    g->id = engine.submit(std::move(params), [g](const TokenEvent& e) { g->deliver(e); });
  } catch (const Error& e) {
    // The engine refuses what can never run (validation catches the usual cases first), naming the
    // request field at fault, or what it cannot take now.
    return ex->reply(g->builder.error(api_error_from(e)));
  }
  const uint64_t id = g->id;
  if (!shared->track(id)) engine.cancel(id);
  Engine* eng = &engine;
  std::shared_ptr<Shared> sh = shared;
  ex->on_gone([eng, id, sh] {
    eng->cancel(id);  // the client went away (or the server stops): free its pages now
    sh->count([](HttpCounters& c) { ++c.client_disconnects; });
  });
  if (options.request_timeout.count() > 0) {
    const auto left = options.request_timeout -
                      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - arrived);
    ex->after(std::max(left, std::chrono::milliseconds(0)), [eng, id, g] {
      g->timed_out = true;
      eng->cancel(id);
    });
  }
  if (g->stream) {
    shared->count([](HttpCounters& c) { ++c.streams_open; });
    // Anthropic's clients are kept alive by its ping event; the others by an SSE comment
    ex->start_stream(200, "text/event-stream", {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}},
                     endpoint == Endpoint::Messages ? "event: ping\ndata: {\"type\": \"ping\"}\n\n" : ": keep-alive\n\n",
                     options.heartbeat);
    std::string first;
    {
      std::lock_guard<std::mutex> lock(g->mu);  // events may already be arriving (held until wired)
      first = g->builder.stream_start();
    }
    if (!first.empty()) ex->send(std::move(first));
  }
  g->wire();
}

HttpServer::HttpServer(Engine& engine, ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, std::move(options))) {}

HttpServer::~HttpServer() { stop(); }

int HttpServer::bind() { return impl_->listener->bind(impl_->options.host, impl_->options.port); }

void HttpServer::run() { impl_->listener->run(); }

void HttpServer::stop() {
  Impl& m = *impl_;
  if (m.shared->stopping.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(m.shared->mu);
    for (uint64_t id : m.shared->active) m.engine.cancel(id);
  }
  m.listener->stop(m.options.shutdown_grace);
}

bool HttpServer::stop_requested() const { return impl_->shared->stopping; }

}  // namespace dsv41::server
