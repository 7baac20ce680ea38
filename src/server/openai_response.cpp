#include "server/openai_response.h"

#include <random>
#include <utility>

namespace dsv41::server {
namespace {

using json = nlohmann::json;

json byte_list(const std::string& bytes) {
  json list = json::array();
  for (unsigned char c : bytes) list.push_back(static_cast<int>(c));
  return list;
}

bool is_chat(const ApiRequest& r) { return r.endpoint == Endpoint::ChatCompletions; }

}  // namespace

std::optional<ApiError> failure_of(const TokenEvent& done) {
  if (done.finish_reason == FinishReason::Error) {
    return server_error(done.error.empty() ? "the engine failed on this request" : done.error);
  }
  if (done.finish_reason == FinishReason::Cancelled) {
    return ApiError(503, "server_error", "the request was cancelled (the server is shutting down)");
  }
  return std::nullopt;
}

std::string dump_json(const json& value) { return value.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string sse_event(const json& payload) { return "data: " + dump_json(payload) + "\n\n"; }

std::string make_response_id(const std::string& prefix) {
  static constexpr char kAlphabet[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::random_device entropy;  // a fresh draw per response: nothing shared between requests
  std::mt19937_64 rng((static_cast<uint64_t>(entropy()) << 32) ^ entropy());
  std::string id = prefix;
  for (int i = 0; i < 24; ++i) id += kAlphabet[rng() % (sizeof kAlphabet - 1)];
  return id;
}

ResponseBuilder::ResponseBuilder(const ApiRequest& request, const Tokenizer& tokenizer, std::string id,
                                 int64_t created, ChatOutputOptions parser_options)
    : request_(request), tokenizer_(tokenizer), id_(std::move(id)), created_(created), parser_([&] {
        parser_options.thinking = request.thinking;
        parser_options.tools = request.tool_names;
        return parser_options;
      }()) {
  request_.params.prompt = {};
  if (!request_.echo) request_.prompt_text = {};
  if (is_chat(request_)) {
    logprobs_ = json::array();
  } else {
    logprobs_ = {{"tokens", json::array()},
                 {"token_logprobs", json::array()},
                 {"top_logprobs", json::array()},
                 {"text_offset", json::array()}};
  }
  if (request_.echo) text_ = request_.prompt_text;
}

json ResponseBuilder::chunk(json choice) const {
  json c = {{"id", id_},
            {"object", is_chat(request_) ? "chat.completion.chunk" : "text_completion"},
            {"created", created_},
            {"model", request_.model}};
  c["choices"] = choice.is_null() ? json::array() : json::array({std::move(choice)});
  if (request_.include_usage) c["usage"] = nullptr;  // OpenAI: null on every chunk but the last
  return c;
}

json ResponseBuilder::usage() const {
  return {{"prompt_tokens", prompt_tokens_},
          {"completion_tokens", completion_tokens_},
          {"total_tokens", prompt_tokens_ + completion_tokens_},
          {"prompt_tokens_details", {{"cached_tokens", cached_tokens_}}}};
}

json ResponseBuilder::logprob_entry(const TokenEvent& event) const {
  auto one = [&](int32_t token, double logprob) {
    const std::string bytes = tokenizer_.token_bytes(token);
    return json{{"token", tokenizer_.decode({token})}, {"logprob", logprob}, {"bytes", byte_list(bytes)}};
  };
  json entry = one(event.token, event.logprob);
  json top = json::array();
  for (const auto& [token, logprob] : event.top_logprobs) top.push_back(one(token, logprob));
  entry["top_logprobs"] = std::move(top);
  return entry;
}

void ResponseBuilder::add_completion_logprobs(const TokenEvent& event, json& into, size_t text_offset) const {
  into["tokens"].push_back(tokenizer_.decode({event.token}));
  into["token_logprobs"].push_back(event.logprob);
  json top = json::object();
  for (const auto& [token, logprob] : event.top_logprobs) top[tokenizer_.decode({token})] = logprob;
  into["top_logprobs"].push_back(std::move(top));
  into["text_offset"].push_back(text_offset);
}

void ResponseBuilder::finish(const TokenEvent& event) {
  done_ = true;
  prompt_tokens_ = event.prompt_tokens;
  completion_tokens_ = event.completion_tokens;
  cached_tokens_ = event.cached_tokens;
  failure_ = failure_of(event);
  if (!failure_) {
    finish_reason_ = finish_reason_name(event.finish_reason);
    if (is_chat(request_) && finish_reason_ == "stop" && !parser_.output().tool_calls.empty()) {
      finish_reason_ = "tool_calls";
    }
  }
}

std::vector<json> ResponseBuilder::add(const TokenEvent& event) {
  std::vector<json> out;
  if (done_) return out;
  const bool stream = request_.stream;
  const bool chat = is_chat(request_);
  const bool token = event.token >= 0;

  if (chat) {
    if (stream && !started_) {
      out.push_back(chunk({{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}},
                           {"logprobs", nullptr}, {"finish_reason", nullptr}}));
    }
    started_ = true;
    ChatDelta delta = parser_.feed(event.text);
    if (event.done) {
      ChatDelta rest = parser_.finish();
      delta.reasoning_content += rest.reasoning_content;
      delta.content += rest.content;
      for (auto& d : rest.tool_calls) delta.tool_calls.push_back(std::move(d));
    }
    json lp = nullptr;
    if (token && request_.logprobs) {
      json entry = logprob_entry(event);
      logprobs_.push_back(entry);
      lp = {{"content", json::array({std::move(entry)})}};
    }
    if (stream && (!delta.empty() || !lp.is_null())) {
      json d = json::object();
      if (!delta.reasoning_content.empty()) d["reasoning_content"] = delta.reasoning_content;
      if (!delta.content.empty()) d["content"] = delta.content;
      if (!delta.tool_calls.empty()) {
        json calls = json::array();
        for (const ToolCallDelta& c : delta.tool_calls) calls.push_back(tool_call_delta_json(c));
        d["tool_calls"] = std::move(calls);
      }
      out.push_back(chunk({{"index", 0}, {"delta", std::move(d)}, {"logprobs", std::move(lp)},
                           {"finish_reason", nullptr}}));
    }
  } else {
    std::string piece;
    if (stream && !started_ && request_.echo) piece = request_.prompt_text;
    started_ = true;
    const size_t offset = text_.size();
    text_ += event.text;
    piece += event.text;
    json lp = nullptr;
    if (token && request_.logprobs) {
      add_completion_logprobs(event, logprobs_, offset);
      if (stream) {
        lp = {{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()},
              {"text_offset", json::array()}};
        add_completion_logprobs(event, lp, offset);
      }
    }
    if (stream && (!piece.empty() || !lp.is_null())) {
      out.push_back(chunk({{"index", 0}, {"text", piece}, {"logprobs", std::move(lp)}, {"finish_reason", nullptr}}));
    }
  }

  if (!event.done) return out;
  finish(event);
  if (!stream) return out;
  if (failure_) {
    out.push_back(error_body(*failure_));
    return out;
  }
  if (chat) {
    out.push_back(chunk({{"index", 0}, {"delta", json::object()}, {"logprobs", nullptr},
                         {"finish_reason", finish_reason_}}));
  } else {
    out.push_back(chunk({{"index", 0}, {"text", ""}, {"logprobs", nullptr}, {"finish_reason", finish_reason_}}));
  }
  if (request_.include_usage) {
    json last = chunk(nullptr);
    last["usage"] = usage();
    out.push_back(std::move(last));
  }
  return out;
}

json ResponseBuilder::response() const {
  json choice = {{"index", 0}};
  if (is_chat(request_)) {
    choice["message"] = chat_output_message_json(parser_.output());
    choice["logprobs"] = request_.logprobs ? json{{"content", logprobs_}} : json(nullptr);
  } else {
    choice["text"] = text_;
    choice["logprobs"] = request_.logprobs ? logprobs_ : json(nullptr);
  }
  choice["finish_reason"] = finish_reason_;
  return {{"id", id_},
          {"object", is_chat(request_) ? "chat.completion" : "text_completion"},
          {"created", created_},
          {"model", request_.model},
          {"choices", json::array({std::move(choice)})},
          {"usage", usage()}};
}

}  // namespace dsv41::server
