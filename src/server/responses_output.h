// Builds the Responses API answer (POST /v1/responses) from the engine's TokenEvents: the Response
// object of a plain request, or the typed events of a stream. The generated text is split by the
// ChatOutputParser into output items, in the order they appear: a reasoning item (reasoning_text),
// message items (output_text) and function_call items. A stream opens each item when its first text
// arrives and closes it when the next begins:
//   response.created, response.in_progress,
//   per item: response.output_item.added, then for reasoning and messages response.content_part.added,
//             response.reasoning_text.delta / response.output_text.delta …, their .done and
//             response.content_part.done; for calls response.function_call_arguments.delta … .done;
//             then response.output_item.done,
//   and last response.completed (finish "stop"), response.incomplete (max_output_tokens reached) or
//   response.failed (an engine failure, cancellation).
// Every event carries a sequence_number. Free of sockets, so tests drive it with made-up events.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/engine.h"
#include "server/api_error.h"
#include "server/openai_api.h"
#include "text/chat_output.h"

namespace dsv41::server {

class ResponsesBuilder {
 public:
  struct Event {
    std::string type;
    nlohmann::json data;  // includes "type" and "sequence_number"
  };

  // `id` is the response id ("resp_..."), `created` its Unix time.
  ResponsesBuilder(const ApiRequest& request, std::string id, int64_t created, ChatOutputOptions parser_options = {});

  // The stream's first events (response.created, response.in_progress).
  std::vector<Event> start();
  // Takes the next event; for a stream returns the events to send, in order; for a plain request
  // nothing.
  std::vector<Event> add(const TokenEvent& event);

  bool done() const { return done_; }
  const std::optional<ApiError>& failure() const { return failure_; }
  // The Response object: in progress, or after done the finished one.
  nlohmann::json response() const;

 private:
  enum class Kind { Reasoning, Message, Call };
  struct Item {
    Kind kind = Kind::Message;
    std::string id;
    std::string text;     // reasoning or message text; a call's arguments
    std::string call_id;  // calls
    std::string name;
    size_t call_index = 0;  // the parser's index of the call
    bool open = true;
  };
  Event event(const std::string& type, nlohmann::json data);
  nlohmann::json item_json(const Item& item) const;
  void open(Kind kind, std::vector<Event>& out, const ToolCallDelta* call = nullptr);
  void close(std::vector<Event>& out);
  void append(Kind kind, const std::string& text, std::vector<Event>& out);
  void take(const ChatDelta& delta, std::vector<Event>& out);

  ApiRequest request_;
  std::string id_;
  int64_t created_;
  ChatOutputParser parser_;
  std::vector<Item> items_;
  int64_t sequence_ = 0;
  bool done_ = false;
  std::optional<ApiError> failure_;
  std::string status_ = "in_progress";
  int64_t prompt_tokens_ = 0, completion_tokens_ = 0, cached_tokens_ = 0, reasoning_tokens_ = 0, tokens_seen_ = 0;
  bool reasoning_over_ = false;  // text other than reasoning has appeared
};

// One SSE event of a Responses stream: "event: TYPE" and its data.
std::string sse_typed_event(const ResponsesBuilder::Event& event);

}  // namespace dsv41::server
