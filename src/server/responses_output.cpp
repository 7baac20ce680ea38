#include "server/responses_output.h"

#include <utility>

#include "server/openai_response.h"

namespace dsv41::server {

using json = nlohmann::json;

std::string sse_typed_event(const ResponsesBuilder::Event& event) {
  return "event: " + event.type + "\ndata: " + dump_json(event.data) + "\n\n";
}

ResponsesBuilder::ResponsesBuilder(const ApiRequest& request, std::string id, int64_t created,
                                   ChatOutputOptions parser_options)
    : request_(request), id_(std::move(id)), created_(created), parser_([&] {
        parser_options.thinking = request.thinking;
        parser_options.tools = request.tool_names;
        return parser_options;
      }()) {
  request_.params.prompt = {};
  request_.prompt_text = {};
}

ResponsesBuilder::Event ResponsesBuilder::event(const std::string& type, json data) {
  data["type"] = type;
  data["sequence_number"] = sequence_++;
  return {type, std::move(data)};
}

json ResponsesBuilder::item_json(const Item& item) const {
  const char* status = item.open ? "in_progress" : "completed";
  switch (item.kind) {
    case Kind::Reasoning:
      return {{"type", "reasoning"}, {"id", item.id}, {"status", status}, {"summary", json::array()},
              {"content", json::array({{{"type", "reasoning_text"}, {"text", item.text}}})}};
    case Kind::Message:
      return {{"type", "message"}, {"id", item.id}, {"status", status}, {"role", "assistant"},
              {"content", json::array({{{"type", "output_text"}, {"text", item.text}, {"annotations", json::array()},
                                        {"logprobs", json::array()}}})}};
    case Kind::Call:
      return {{"type", "function_call"}, {"id", item.id}, {"status", status}, {"call_id", item.call_id},
              {"name", item.name}, {"arguments", item.text}};
  }
  return nullptr;
}

void ResponsesBuilder::open(Kind kind, std::vector<Event>& out, const ToolCallDelta* call) {
  close(out);
  Item item;
  item.kind = kind;
  item.id = make_response_id(kind == Kind::Reasoning ? "rs_" : kind == Kind::Message ? "msg_" : "fc_");
  if (call) {
    item.call_id = call->id;
    item.name = call->name;
    item.call_index = call->index;
  }
  items_.push_back(std::move(item));
  const size_t index = items_.size() - 1;
  json added = item_json(items_.back());
  if (kind != Kind::Call) added["content"] = json::array();  // parts are added next
  out.push_back(event("response.output_item.added", {{"output_index", index}, {"item", std::move(added)}}));
  if (kind == Kind::Call) return;
  const json part = kind == Kind::Reasoning ? json{{"type", "reasoning_text"}, {"text", ""}}
                                            : json{{"type", "output_text"}, {"text", ""}, {"annotations", json::array()}};
  out.push_back(event("response.content_part.added",
                      {{"item_id", items_.back().id}, {"output_index", index}, {"content_index", 0}, {"part", part}}));
}

void ResponsesBuilder::close(std::vector<Event>& out) {
  if (items_.empty() || !items_.back().open) return;
  Item& item = items_.back();
  item.open = false;
  const size_t index = items_.size() - 1;
  const json where = {{"item_id", item.id}, {"output_index", index}};
  if (item.kind == Kind::Call) {
    json d = where;
    d["arguments"] = item.text;
    out.push_back(event("response.function_call_arguments.done", std::move(d)));
  } else {
    const bool reasoning = item.kind == Kind::Reasoning;
    json d = where;
    d["content_index"] = 0;
    d["text"] = item.text;
    out.push_back(event(reasoning ? "response.reasoning_text.done" : "response.output_text.done", d));
    json part = item_json(item)["content"][0];
    json p = where;
    p["content_index"] = 0;
    p["part"] = std::move(part);
    out.push_back(event("response.content_part.done", std::move(p)));
  }
  out.push_back(event("response.output_item.done", {{"output_index", index}, {"item", item_json(item)}}));
}

void ResponsesBuilder::append(Kind kind, const std::string& text, std::vector<Event>& out) {
  if (text.empty()) return;
  if (items_.empty() || !items_.back().open || items_.back().kind != kind) open(kind, out);
  Item& item = items_.back();
  item.text += text;
  json d = {{"item_id", item.id}, {"output_index", items_.size() - 1}, {"content_index", 0}, {"delta", text}};
  if (kind == Kind::Message) d["logprobs"] = json::array();
  out.push_back(event(kind == Kind::Reasoning ? "response.reasoning_text.delta" : "response.output_text.delta", std::move(d)));
}

void ResponsesBuilder::take(const ChatDelta& delta, std::vector<Event>& out) {
  append(Kind::Reasoning, delta.reasoning_content, out);
  append(Kind::Message, delta.content, out);
  for (const ToolCallDelta& c : delta.tool_calls) {
    const bool same = !items_.empty() && items_.back().open && items_.back().kind == Kind::Call &&
                      items_.back().call_index == c.index;
    if (!same) open(Kind::Call, out, &c);
    Item& item = items_.back();
    item.text += c.arguments;
    if (!c.arguments.empty()) {
      out.push_back(event("response.function_call_arguments.delta",
                          {{"item_id", item.id}, {"output_index", items_.size() - 1}, {"delta", c.arguments}}));
    }
  }
}

std::vector<ResponsesBuilder::Event> ResponsesBuilder::start() {
  std::vector<Event> out;
  out.push_back(event("response.created", {{"response", response()}}));
  out.push_back(event("response.in_progress", {{"response", response()}}));
  return out;
}

std::vector<ResponsesBuilder::Event> ResponsesBuilder::add(const TokenEvent& e) {
  std::vector<Event> out;
  if (done_) return out;
  ChatDelta delta = parser_.feed(e.text);
  if (e.done) {
    ChatDelta rest = parser_.finish();
    delta.reasoning_content += rest.reasoning_content;
    delta.content += rest.content;
    for (auto& c : rest.tool_calls) delta.tool_calls.push_back(std::move(c));
  }
  if (!delta.content.empty() || !delta.tool_calls.empty()) reasoning_over_ = true;
  if (e.token >= 0) {
    ++tokens_seen_;
    if (request_.thinking && !reasoning_over_) reasoning_tokens_ = tokens_seen_;  // tokens until reasoning ended
  }
  take(delta, out);
  if (e.done) {
    close(out);
    done_ = true;
    prompt_tokens_ = e.prompt_tokens;
    completion_tokens_ = e.completion_tokens;
    cached_tokens_ = e.cached_tokens;
    failure_ = failure_of(e);
    status_ = failure_ ? "failed" : e.finish_reason == FinishReason::Length ? "incomplete" : "completed";
    out.push_back(event("response." + status_, {{"response", response()}}));
  }
  if (!request_.stream) out.clear();
  return out;
}

json ResponsesBuilder::response() const {
  json output = json::array();
  for (const Item& item : items_) output.push_back(item_json(item));
  json r = {{"id", id_},
            {"object", "response"},
            {"created_at", created_},
            {"status", status_},
            {"background", false},
            {"error", nullptr},
            {"incomplete_details", nullptr},
            {"model", request_.model},
            {"output", std::move(output)},
            {"previous_response_id", nullptr},
            {"store", false},
            {"truncation", "disabled"},
            {"user", nullptr}};
  for (const auto& [key, value] : request_.responses_echo.items()) r[key] = value;
  if (status_ == "incomplete") r["incomplete_details"] = {{"reason", "max_output_tokens"}};
  if (failure_) r["error"] = {{"code", "server_error"}, {"message", failure_->message}};
  if (done_) {
    r["usage"] = {{"input_tokens", prompt_tokens_},
                  {"input_tokens_details", {{"cached_tokens", cached_tokens_}}},
                  {"output_tokens", completion_tokens_},
                  {"output_tokens_details", {{"reasoning_tokens", reasoning_tokens_}}},
                  {"total_tokens", prompt_tokens_ + completion_tokens_}};
  } else {
    r["usage"] = nullptr;
  }
  return r;
}

}  // namespace dsv41::server
