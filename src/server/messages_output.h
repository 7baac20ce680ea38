// Builds the Messages API answer (POST /v1/messages) from the engine's TokenEvents: the Message object
// of a plain request, or the named events of a stream. The generated text is split by the
// ChatOutputParser into content blocks in the order they appear: thinking, text and tool_use. A
// stream opens each block when its first text arrives and closes it when the next begins:
//   message_start (the message with no content), ping,
//   per block: content_block_start, content_block_delta ... (text_delta, thinking_delta,
//              input_json_delta), content_block_stop,
//   message_delta (stop_reason, stop_sequence, usage), message_stop;
//   or, on a failure, an error event, which ends the stream.
// stop_reason: end_turn (the model's end of sentence), max_tokens, stop_sequence (with the one that
// matched) or tool_use (the answer holds a tool call). usage splits the prompt as Anthropic does:
// cache_read_input_tokens restored from the prompt cache, cache_creation_input_tokens newly stored
// in it by this request (its prompt prefix up to the stored boundary, less what was read), and
// input_tokens the rest; the three add up to the prompt.
// Free of sockets, so tests drive it with made-up events.
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

class MessagesBuilder {
 public:
  struct Event {
    std::string type;
    nlohmann::json data;  // includes "type"
  };

  // `id` is the message id ("msg_..."). Tool-call ids are minted as "toolu_..." unless
  // `parser_options` says otherwise.
  MessagesBuilder(const ApiRequest& request, std::string id, ChatOutputOptions parser_options = {});

  // The stream's first events (message_start, ping).
  std::vector<Event> start();
  // Takes the next event; for a stream returns the events to send, in order; for a plain request nothing.
  std::vector<Event> add(const TokenEvent& event);

  bool done() const { return done_; }
  const std::optional<ApiError>& failure() const { return failure_; }
  // The Message object: in progress, or after done the finished one.
  nlohmann::json message() const;

 private:
  enum class Kind { Thinking, Text, ToolUse };
  struct Block {
    Kind kind = Kind::Text;
    std::string text;  // thinking or text; a tool call's arguments (JSON object text)
    std::string id, name;
    size_t call_index = 0;
    bool open = true;
  };
  static Event event(const std::string& type, nlohmann::json data);
  nlohmann::json block_json(const Block& block) const;
  void open(Kind kind, std::vector<Event>& out, const ToolCallDelta* call = nullptr);
  void close(std::vector<Event>& out);
  void append(Kind kind, const std::string& text, std::vector<Event>& out);
  void take(const ChatDelta& delta, std::vector<Event>& out);
  nlohmann::json usage() const;

  ApiRequest request_;
  std::string id_;
  ChatOutputParser parser_;
  std::vector<Block> blocks_;
  bool done_ = false;
  std::optional<ApiError> failure_;
  std::string stop_reason_, stop_sequence_;
  int64_t prompt_tokens_ = 0, completion_tokens_ = 0, cached_tokens_ = 0, stored_tokens_ = 0;
};

// One SSE event with a name: "event: TYPE" and its data.
std::string sse_named_event(const MessagesBuilder::Event& event);

}  // namespace dsv41::server
