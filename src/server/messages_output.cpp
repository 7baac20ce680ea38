#include "server/messages_output.h"

#include <algorithm>
#include <utility>

#include "server/messages_api.h"
#include "server/openai_response.h"

namespace dsv41::server {

using json = nlohmann::json;

std::string sse_named_event(const MessagesBuilder::Event& event) {
  return "event: " + event.type + "\ndata: " + dump_json(event.data) + "\n\n";
}

MessagesBuilder::MessagesBuilder(const ApiRequest& request, std::string id, ChatOutputOptions parser_options)
    : request_(request), id_(std::move(id)), parser_([&] {
        parser_options.thinking = request.thinking;
        parser_options.tools = request.tool_names;
        if (!parser_options.make_call_id) {
          parser_options.make_call_id = [](size_t) { return make_response_id("toolu_"); };
        }
        return parser_options;
      }()) {
  prompt_tokens_ = static_cast<int64_t>(request_.params.prompt.size());
  request_.params.prompt = {};
  request_.prompt_text = {};
}

MessagesBuilder::Event MessagesBuilder::event(const std::string& type, json data) {
  data["type"] = type;
  return {type, std::move(data)};
}

json MessagesBuilder::block_json(const Block& b) const {
  switch (b.kind) {
    case Kind::Thinking:
      return {{"type", "thinking"}, {"thinking", b.text}, {"signature", ""}};
    case Kind::Text:
      return {{"type", "text"}, {"text", b.text}};
    case Kind::ToolUse: {
      // The parser writes a call's arguments as a JSON object; a call cut off by max_tokens is not
      // one yet, and its input is then empty (stop_reason max_tokens says why).
      json input = json::parse(b.text, nullptr, /*allow_exceptions=*/false);
      if (!input.is_object()) input = json::object();
      return {{"type", "tool_use"}, {"id", b.id}, {"name", b.name}, {"input", std::move(input)}};
    }
  }
  return nullptr;
}

void MessagesBuilder::open(Kind kind, std::vector<Event>& out, const ToolCallDelta* call) {
  close(out);
  Block b;
  b.kind = kind;
  if (call) {
    b.id = call->id;
    b.name = call->name;
    b.call_index = call->index;
  }
  blocks_.push_back(std::move(b));
  json start = block_json(blocks_.back());
  if (kind == Kind::ToolUse) start["input"] = json::object();  // its JSON comes in input_json_delta events
  out.push_back(event("content_block_start", {{"index", blocks_.size() - 1}, {"content_block", std::move(start)}}));
}

void MessagesBuilder::close(std::vector<Event>& out) {
  if (blocks_.empty() || !blocks_.back().open) return;
  blocks_.back().open = false;
  out.push_back(event("content_block_stop", {{"index", blocks_.size() - 1}}));
}

void MessagesBuilder::append(Kind kind, const std::string& text, std::vector<Event>& out) {
  if (text.empty()) return;
  if (blocks_.empty() || !blocks_.back().open || blocks_.back().kind != kind) open(kind, out);
  blocks_.back().text += text;
  const json delta = kind == Kind::Thinking ? json{{"type", "thinking_delta"}, {"thinking", text}}
                                            : json{{"type", "text_delta"}, {"text", text}};
  out.push_back(event("content_block_delta", {{"index", blocks_.size() - 1}, {"delta", delta}}));
}

void MessagesBuilder::take(const ChatDelta& delta, std::vector<Event>& out) {
  append(Kind::Thinking, delta.reasoning_content, out);
  append(Kind::Text, delta.content, out);
  for (const ToolCallDelta& c : delta.tool_calls) {
    const bool same = !blocks_.empty() && blocks_.back().open && blocks_.back().kind == Kind::ToolUse &&
                      blocks_.back().call_index == c.index;
    if (!same) open(Kind::ToolUse, out, &c);
    blocks_.back().text += c.arguments;
    if (!c.arguments.empty()) {
      out.push_back(event("content_block_delta", {{"index", blocks_.size() - 1},
                                                  {"delta", {{"type", "input_json_delta"}, {"partial_json", c.arguments}}}}));
    }
  }
}

std::vector<MessagesBuilder::Event> MessagesBuilder::start() {
  std::vector<Event> out;
  json m = message();
  m["usage"]["output_tokens"] = 0;
  out.push_back(event("message_start", {{"message", std::move(m)}}));
  out.push_back(event("ping", json::object()));
  return out;
}

std::vector<MessagesBuilder::Event> MessagesBuilder::add(const TokenEvent& e) {
  std::vector<Event> out;
  if (done_) return out;
  ChatDelta delta = parser_.feed(e.text);
  if (e.done) {
    ChatDelta rest = parser_.finish();
    delta.reasoning_content += rest.reasoning_content;
    delta.content += rest.content;
    for (auto& c : rest.tool_calls) delta.tool_calls.push_back(std::move(c));
  }
  take(delta, out);
  if (e.done) {
    close(out);
    done_ = true;
    prompt_tokens_ = e.prompt_tokens;
    completion_tokens_ = e.completion_tokens;
    cached_tokens_ = e.cached_tokens;
    stored_tokens_ = e.report.cache_tokens_stored;
    failure_ = failure_of(e);
    const bool called = std::any_of(blocks_.begin(), blocks_.end(), [](const Block& b) { return b.kind == Kind::ToolUse; });
    if (failure_) {
      out.push_back(event("error", {{"error", messages_error_body(*failure_)["error"]}}));
    } else {
      stop_reason_ = e.finish_reason == FinishReason::Length ? "max_tokens"
                     : !e.stop_string.empty()    ? "stop_sequence"
                     : called                    ? "tool_use"
                                                 : "end_turn";
      stop_sequence_ = e.stop_string;
      out.push_back(event("message_delta",
                          {{"delta", {{"stop_reason", stop_reason_},
                                      {"stop_sequence", stop_sequence_.empty() ? json(nullptr) : json(stop_sequence_)}}},
                           {"usage", usage()}}));
      out.push_back(event("message_stop", json::object()));
    }
  }
  if (!request_.stream) out.clear();
  return out;
}

json MessagesBuilder::usage() const {
  const int64_t created = std::clamp<int64_t>(stored_tokens_ - cached_tokens_, 0, prompt_tokens_ - cached_tokens_);
  return {{"input_tokens", std::max<int64_t>(0, prompt_tokens_ - cached_tokens_ - created)},
          {"cache_creation_input_tokens", created},
          {"cache_read_input_tokens", cached_tokens_},
          {"output_tokens", completion_tokens_}};
}

json MessagesBuilder::message() const {
  json content = json::array();
  for (const Block& b : blocks_) content.push_back(block_json(b));
  return {{"id", id_},
          {"type", "message"},
          {"role", "assistant"},
          {"model", request_.model},
          {"content", std::move(content)},
          {"stop_reason", stop_reason_.empty() ? json(nullptr) : json(stop_reason_)},
          {"stop_sequence", stop_sequence_.empty() ? json(nullptr) : json(stop_sequence_)},
          {"usage", usage()}};
}

}  // namespace dsv41::server
