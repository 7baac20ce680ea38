// Splits DeepSeek-V4.1 generated text into reasoning_content, content and OpenAI tool_calls
// (docs/chat-encoding.md §3.3, §4), for a whole text or incrementally while it streams.
//
// The parser is the tolerant, chunk-boundary-safe kind the document recommends:
//   - thinking mode starts in reasoning; </think> ends it; a stray <think> in reasoning and a stray
//     </think> in content are dropped;
//   - "<｜DSML｜ calls>" starts a tool-call block in content or in reasoning (ending reasoning); up
//     to two newlines right before it are its separator and not text; other newlines stay verbatim;
//   - whitespace between DSML tags is formatting; a string="false" value that is not valid JSON
//     becomes a JSON string; tool names stay namespace-qualified ("ns::tool") as rendered;
//   - EOS ends the output; text after a closed block is content again;
//   - calls are read only for the tools the request offered (ChatOutputOptions::tools): with none,
//     "<｜DSML｜ calls>" is ordinary text; an invoke naming another tool ends the block as malformed
//     DSML does, so that invoke and what follows it stay text;
//   - malformed DSML is never fatal: calls already started are closed (complete = false) and the
//     text no call represents goes out as reasoning / content, so nothing is lost; a block cut off
//     by the end of the output is handled the same way (whitespace-only leftovers are dropped).
// Arguments are JSON object text built as the reference does: {"key": value, ...}, {} when empty.
// Text is never emitted while it could still turn out to be part of a marker; the concatenation of
// all deltas equals the one-shot parse whatever the chunking.
#pragma once

#include <cstddef>
#include <functional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace dsv41 {

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON object text
  bool complete = true;   // false when the block was cut off or malformed inside this call
};

// One piece of a tool call. The first delta of a call carries its id and name (and "{"); later
// ones carry only further argument text.
struct ToolCallDelta {
  size_t index = 0;
  std::string id;
  std::string name;
  std::string arguments;
};

struct ChatDelta {
  std::string reasoning_content;
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return reasoning_content.empty() && content.empty() && tool_calls.empty(); }
};

struct ChatOutput {
  std::string reasoning_content;
  std::string content;
  std::vector<ToolCall> tool_calls;
};

struct ChatOutputOptions {
  bool thinking = true;  // the output begins inside reasoning (ChatPrompt::starts_in_reasoning)
  // The tools a call may name (ChatPrompt::tool_names: namespace-qualified, after tool_choice). A
  // client runs what comes back as tool_calls, so only a tool it declared and allowed is one; for any
  // other name the model's text is returned as text, as vLLM and llama-server return a call they
  // cannot parse, rather than dropped (the client still sees what the model wrote).
  std::vector<std::string> tools;
  // Mints the id of call `index` (0-based within this output); unset: "call_" + 24 random characters.
  std::function<std::string(size_t index)> make_call_id;
};

class ChatOutputParser {
 public:
  explicit ChatOutputParser(ChatOutputOptions options = {});

  // Takes the next piece of generated text; returns what can be decided so far.
  ChatDelta feed(std::string_view text);
  // End of generation: flushes held-back text and closes an unfinished block. Later feeds are ignored.
  ChatDelta finish();
  // Everything emitted so far (the sum of all deltas).
  const ChatOutput& output() const { return out_; }

 private:
  enum class Mode { Reasoning, Content, Block, AfterBlock, Done };
  enum class Place { Between, Body, StringValue, RawValue };  // where inside a block

  ChatDelta run(bool final);
  bool step_text(bool final);
  bool step_block(bool final);
  bool step_value(bool final);
  bool step_after_block(bool final);
  void end_block_early(size_t at, bool cut_off);
  void emit_text(Mode channel, std::string_view text);
  void open_call(const std::string& name);
  void append_arguments(std::string_view text);
  std::string next_call_id();

  bool offers(std::string_view name) const;

  ChatOutputOptions options_;
  std::mt19937_64 rng_;
  std::string buf_;      // text not yet consumed, plus (in a block) text not yet represented
  size_t pos_ = 0;       // next byte of buf_ to look at
  size_t commit_ = 0;    // in a block: start of text no emitted call represents
  Mode mode_;
  Mode block_return_ = Mode::Content;  // where text goes if a block fails before its first call
  Place place_ = Place::Between;
  bool block_has_call_ = false;
  bool call_open_ = false;
  bool first_param_ = true;
  bool finished_ = false;
  std::string param_key_;
  std::string raw_value_;
  ChatOutput out_;
  ChatDelta delta_;
};

// Whether an invoke tag can carry `name` as this parser reads it: 1 to 256 bytes with no '"', '<',
// '>' or newline. A tool named otherwise could never come back as a call.
bool is_dsml_name(std::string_view name);

// One-shot parse: feed(text) then finish().
ChatOutput parse_chat_output(std::string_view text, const ChatOutputOptions& options = {});

// OpenAI shapes: {"id","type":"function","function":{"name","arguments"}}; a streaming delta
// {"index", "id"?, "type"?, "function":{"name"?, "arguments"}}; and the assistant message
// {"role","content" (null when empty with tool calls),"reasoning_content"?,"tool_calls"?}.
nlohmann::json tool_call_json(const ToolCall& call);
nlohmann::json tool_call_delta_json(const ToolCallDelta& delta);
nlohmann::json chat_output_message_json(const ChatOutput& output);

}  // namespace dsv41
