// Builds the OpenAI response objects of one request from the engine's TokenEvents: the
// chat.completion / text_completion object for a plain request, or the chunk objects of a stream
// (chat.completion.chunk deltas: role first, then reasoning_content / content / tool_calls as the
// ChatOutputParser decides them, then the finish_reason chunk and, if asked, the usage chunk).
// It is the code the HTTP handler runs per event, kept free of sockets so tests can drive it with
// made-up events (e.g. a DSML tool call the random test model will never write).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/engine.h"
#include "server/api_error.h"
#include "server/openai_api.h"
#include "text/chat_output.h"
#include "text/tokenizer.h"

namespace dsv41::server {

class ResponseBuilder {
 public:
  // `id` is the response id ("chatcmpl-..." / "cmpl-..."), `created` its Unix time.
  ResponseBuilder(const ApiRequest& request, const Tokenizer& tokenizer, std::string id, int64_t created,
                  ChatOutputOptions parser_options = {});

  // Takes the next event. For a streaming request returns the payloads to send, in order (each one
  // becomes a "data: ..." SSE event; a failed request's last payload is an error body); for a plain
  // request returns nothing.
  std::vector<nlohmann::json> add(const TokenEvent& event);

  bool done() const { return done_; }
  // After done: why the request failed (engine error, cancellation), if it did.
  const std::optional<ApiError>& failure() const { return failure_; }
  // After done (and without failure): the complete non-streaming response.
  nlohmann::json response() const;
  // The finish_reason as the client sees it ("stop", "length", "tool_calls").
  const std::string& finish_reason() const { return finish_reason_; }

 private:
  nlohmann::json chunk(nlohmann::json choice) const;
  nlohmann::json usage() const;
  nlohmann::json logprob_entry(const TokenEvent& event) const;  // chat shape
  void add_completion_logprobs(const TokenEvent& event, nlohmann::json& into, size_t text_offset) const;
  void finish(const TokenEvent& event);

  ApiRequest request_;  // params.prompt is not kept (moved out before the engine gets it)
  Tokenizer tokenizer_;
  std::string id_;
  int64_t created_;
  ChatOutputParser parser_;
  bool started_ = false;
  bool done_ = false;
  std::optional<ApiError> failure_;
  std::string finish_reason_;
  int64_t prompt_tokens_ = 0, completion_tokens_ = 0, cached_tokens_ = 0;
  std::string text_;                 // completions: the returned text so far
  nlohmann::json logprobs_;          // accumulated logprobs (chat: list; completions: the object)
};

// How an engine's final event that did not finish ("error", "cancelled") is told to the client;
// nothing for "stop" and "length".
std::optional<ApiError> failure_of(const TokenEvent& done);

// Serialises JSON for the wire; invalid UTF-8 (a token's partial bytes) becomes U+FFFD rather than
// an exception.
std::string dump_json(const nlohmann::json& value);
// One SSE event carrying `payload`.
std::string sse_event(const nlohmann::json& payload);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

// A fresh response id: prefix + 24 random alphanumerics.
std::string make_response_id(const std::string& prefix);

}  // namespace dsv41::server
