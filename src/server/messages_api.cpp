#include "server/messages_api.h"

#include <set>
#include <string>
#include <vector>

#include "server/access_policy.h"
#include "server/json_fields.h"
#include "text/chat_output.h"

namespace dsv41::server {
namespace {

std::string at(const std::string& path, size_t i) { return path + "[" + std::to_string(i) + "]"; }

const std::string& required_string(const ojson& item, const char* key, const std::string& path) {
  const ojson* v = field(item, key);
  if (v == nullptr) throw invalid_request(path + "." + key, path + "." + key + " is required");
  if (!v->is_string()) throw invalid_request(path + "." + key, path + "." + key + " must be a string, got " + kind(*v));
  return v->get_ref<const std::string&>();
}

const ojson& required_object(const ojson& item, const char* key, const std::string& path) {
  const ojson* v = field(item, key);
  if (v == nullptr) throw invalid_request(path + "." + key, path + "." + key + " is required");
  if (!v->is_object()) throw invalid_request(path + "." + key, path + "." + key + " must be an object, got " + kind(*v));
  return *v;
}

std::string block_type(const ojson& block, const std::string& path) {
  if (!block.is_object()) throw invalid_request(path, path + " must be an object, got " + kind(block));
  return required_string(block, "type", path);
}

// An image block as a chat image part: only base64 sources (the server fetches nothing).
ojson image_part(const ojson& block, const std::string& path) {
  const ojson& source = required_object(block, "source", path);
  const std::string& type = required_string(source, "type", path + ".source");
  if (type != "base64") {
    throw invalid_request(path + ".source.type", path + ".source.type \"" + printable(type) +
                                                     "\" is not supported: images come as base64 data (this server fetches nothing)");
  }
  const std::string& media = required_string(source, "media_type", path + ".source");
  const std::string& data = required_string(source, "data", path + ".source");
  return {{"type", "image_url"}, {"image_url", {{"url", "data:" + media + ";base64," + data}}}};
}

[[noreturn]] void unsupported_block(const std::string& type, const std::string& path, const char* allowed) {
  throw invalid_request(path + ".type", path + ".type \"" + printable(type) + "\" is not supported here (" + allowed + ")");
}

// The chat messages a request stands for, with where each came from (for naming fields in errors).
struct Translation {
  ojson messages = ojson::array();
  std::vector<std::string> origin;  // per chat message: "system", "messages[3]", "messages[3].content[0]"
  void add(ojson message, std::string from) {
    messages.push_back(std::move(message));
    origin.push_back(std::move(from));
  }
};

// `system`: a string or text blocks.
void add_system(const ojson& body, Translation& t) {
  const ojson* system = field(body, "system");
  if (system == nullptr) return;
  std::string text;
  if (system->is_string()) {
    text = system->get<std::string>();
  } else if (system->is_array()) {
    for (size_t i = 0; i < system->size(); ++i) {
      const std::string where = at("system", i);
      if (block_type((*system)[i], where) != "text") throw invalid_request(where + ".type", where + ".type must be \"text\"");
      text += (i ? "\n" : "") + required_string((*system)[i], "text", where);
    }
  } else {
    throw invalid_request("system", "system must be a string or an array of text blocks, got " + kind(*system));
  }
  t.add({{"role", "system"}, {"content", text}}, "system");
}

// A tool_result block's content: a string, or text and image blocks.
ojson tool_result_content(const ojson& block, const std::string& path) {
  const ojson* content = field(block, "content");
  if (content == nullptr) return "";
  if (content->is_string()) return *content;
  if (!content->is_array()) throw invalid_request(path + ".content", path + ".content must be a string or an array of blocks");
  ojson parts = ojson::array();
  for (size_t i = 0; i < content->size(); ++i) {
    const std::string where = at(path + ".content", i);
    const std::string type = block_type((*content)[i], where);
    if (type == "text") {
      parts.push_back({{"type", "text"}, {"text", required_string((*content)[i], "text", where)}});
    } else if (type == "image") {
      parts.push_back(image_part((*content)[i], where));
    } else {
      unsupported_block(type, where, "text, image");
    }
  }
  return parts;
}

// A user message: tool results first (each a tool message answering a call of the last assistant
// turn), then its text and images as one user message.
void add_user(const ojson& content, const std::string& path, const std::set<std::string>& open_calls, Translation& t) {
  if (content.is_string()) return t.add({{"role", "user"}, {"content", content}}, path);
  ojson parts = ojson::array();
  for (size_t i = 0; i < content.size(); ++i) {
    const std::string where = at(path + ".content", i);
    const ojson& block = content[i];
    const std::string type = block_type(block, where);
    if (type == "text") {
      parts.push_back({{"type", "text"}, {"text", required_string(block, "text", where)}});
    } else if (type == "image") {
      parts.push_back(image_part(block, where));
    } else if (type == "tool_result") {
      const std::string& id = required_string(block, "tool_use_id", where);
      if (open_calls.count(id) == 0) {
        throw invalid_request(where + ".tool_use_id", where + ".tool_use_id \"" + printable(id) +
                                                          "\" answers no tool_use of the assistant message before it");
      }
      if (const ojson* e = field(block, "is_error"); e != nullptr && !e->is_boolean()) {
        throw invalid_request(where + ".is_error", where + ".is_error must be a boolean, got " + kind(*e));
      }
      t.add({{"role", "tool"}, {"tool_call_id", id}, {"content", tool_result_content(block, where)}}, where);
    } else {
      unsupported_block(type, where, "text, image, tool_result");
    }
  }
  if (!parts.empty()) t.add({{"role", "user"}, {"content", std::move(parts)}}, path);
}

// An assistant message: its text, its reasoning and its tool calls (whose ids later tool results
// answer). Text blocks around the calls are joined: the V4.1 template writes calls after the text.
void add_assistant(const ojson& content, const std::string& path, std::set<std::string>& open_calls, Translation& t) {
  open_calls.clear();
  if (content.is_string()) return t.add({{"role", "assistant"}, {"content", content}}, path);
  std::string text, reasoning;
  ojson calls = ojson::array();
  for (size_t i = 0; i < content.size(); ++i) {
    const std::string where = at(path + ".content", i);
    const ojson& block = content[i];
    const std::string type = block_type(block, where);
    if (type == "text") {
      text += required_string(block, "text", where);
    } else if (type == "thinking") {
      reasoning += required_string(block, "thinking", where);
    } else if (type == "redacted_thinking") {
      // another model's encrypted reasoning: nothing this model can read
    } else if (type == "tool_use") {
      const std::string& id = required_string(block, "id", where);
      if (id.empty()) throw invalid_request(where + ".id", where + ".id must not be empty");
      if (!open_calls.insert(id).second) throw invalid_request(where + ".id", where + ".id \"" + printable(id) + "\" is repeated");
      const std::string& name = required_string(block, "name", where);
      if (!is_dsml_name(name)) {
        throw invalid_request(where + ".name", where + ".name must be at most 256 bytes without '\"', '<', '>' or a newline");
      }
      calls.push_back({{"id", id}, {"type", "function"},
                       {"function", {{"name", name}, {"arguments", required_object(block, "input", where)}}}});
    } else {
      unsupported_block(type, where, "text, thinking, redacted_thinking, tool_use");
    }
  }
  ojson m = {{"role", "assistant"}, {"content", text}};
  if (!reasoning.empty()) m["reasoning_content"] = reasoning;
  if (!calls.empty()) m["tool_calls"] = std::move(calls);
  t.add(std::move(m), path);
}

Translation translate_messages(const ojson& body) {
  Translation t;
  add_system(body, t);
  const ojson* messages = field(body, "messages");
  if (messages == nullptr) throw invalid_request("messages", "messages is required");
  if (!messages->is_array() || messages->empty()) {
    throw invalid_request("messages", "messages must be a non-empty array, got " + kind(*messages));
  }
  std::set<std::string> open_calls;  // the ids of the last assistant message's tool_use blocks
  for (size_t i = 0; i < messages->size(); ++i) {
    const std::string where = at("messages", i);
    const ojson& m = (*messages)[i];
    if (!m.is_object()) throw invalid_request(where, where + " must be an object, got " + kind(m));
    const std::string& role = required_string(m, "role", where);
    const ojson* content = field(m, "content");
    if (content == nullptr) throw invalid_request(where + ".content", where + ".content is required");
    if (!content->is_string() && !content->is_array()) {
      throw invalid_request(where + ".content", where + ".content must be a string or an array of blocks, got " + kind(*content));
    }
    if (role == "user") {
      add_user(*content, where, open_calls, t);
    } else if (role == "assistant") {
      add_assistant(*content, where, open_calls, t);
    } else {
      throw invalid_request(where + ".role", where + ".role must be user or assistant, got \"" + printable(role) + "\"");
    }
  }
  return t;
}

ojson tools_of(const ojson& tools) {
  if (!tools.is_array()) throw invalid_request("tools", "tools must be an array, got " + kind(tools));
  ojson out = ojson::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string where = at("tools", i);
    const ojson& tool = tools[i];
    if (!tool.is_object()) throw invalid_request(where, where + " must be an object, got " + kind(tool));
    if (const ojson* type = field(tool, "type"); type != nullptr && *type != "custom") {
      throw invalid_request(where + ".type", where + ".type " + type->dump() +
                                                 " is not supported: only client tools (custom) run here, no server tools");
    }
    required_string(tool, "name", where);
    required_object(tool, "input_schema", where);
    // name, description, input_schema as parameters: in the client's order, which the prompt keeps
    ojson function = ojson::object();
    for (const auto& [key, value] : tool.items()) {
      if (key == "input_schema") {
        function["parameters"] = value;
      } else if (key != "type" && key != "cache_control") {
        function[key] = value;
      }
    }
    out.push_back({{"type", "function"}, {"function", std::move(function)}});
  }
  return out;
}

ojson tool_choice_of(const ojson& choice) {
  if (!choice.is_object()) throw invalid_request("tool_choice", "tool_choice must be an object, got " + kind(choice));
  if (const ojson* p = field(choice, "disable_parallel_tool_use"); p != nullptr && !p->is_boolean()) {
    throw invalid_request("tool_choice.disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use must be a boolean");
  }
  const std::string& type = required_string(choice, "type", "tool_choice");
  if (type == "auto" || type == "none") return type;
  if (type == "any") return "required";
  if (type == "tool") return {{"type", "function"}, {"function", {{"name", required_string(choice, "name", "tool_choice")}}}};
  throw invalid_request("tool_choice.type", "tool_choice.type must be auto, any, tool or none, got \"" + printable(type) + "\"");
}

// `thinking` as the chat route's switch. Anthropic's default is no thinking, whatever the server's
// default for OpenAI clients.
ojson thinking_of(const ojson& body, bool counting) {
  const ojson* thinking = field(body, "thinking");
  if (thinking == nullptr) return {{"type", "disabled"}};
  if (!thinking->is_object()) throw invalid_request("thinking", "thinking must be an object, got " + kind(*thinking));
  const std::string& type = required_string(*thinking, "type", "thinking");
  if (type == "disabled") return {{"type", "disabled"}};
  if (type != "enabled") throw invalid_request("thinking.type", "thinking.type must be enabled or disabled, got \"" + printable(type) + "\"");
  const ojson* budget = field(*thinking, "budget_tokens");
  if (budget == nullptr) throw invalid_request("thinking.budget_tokens", "thinking.budget_tokens is required");
  const int64_t n = require_integer(*budget, "thinking.budget_tokens");
  if (n < 1024) throw invalid_request("thinking.budget_tokens", "thinking.budget_tokens must be at least 1024, got " + std::to_string(n));
  if (const ojson* max = field(body, "max_tokens"); !counting && max != nullptr) {
    if (int64_t m = 0; integer_of(*max, m) && n >= m) {
      throw invalid_request("thinking.budget_tokens", "thinking.budget_tokens must be less than max_tokens");
    }
  }
  return {{"type", "enabled"}};
}

// The chat route names what it refuses by its own fields; these are the Messages names for them.
void rename_param(ApiError& e, const Translation& t) {
  std::string& p = e.param;
  if (p == "stop") p = "stop_sequences";
  if (p.starts_with("tools[")) {
    if (const size_t f = p.find("].function.parameters"); f != std::string::npos) p.replace(f + 1, 20, ".input_schema");
    if (const size_t f = p.find("].function."); f != std::string::npos) p.erase(f + 1, std::string_view(".function").size());
  }
  if (p.starts_with("messages[")) {
    const size_t close = p.find(']');
    const size_t index = std::stoul(p.substr(9, close - 9));
    if (index < t.origin.size()) p = t.origin[index] + p.substr(close + 1);
  }
}

}  // namespace

ApiRequest parse_messages_request(std::string_view text, const ModelInfo& model, bool counting) {
  const ojson body = parse_json_body(text);
  for (const char* key : {"mcp_servers", "container", "context_management"}) {
    if (field(body, key) != nullptr) throw invalid_request(key, std::string(key) + " is not supported by this server");
  }
  if (const ojson* tier = field(body, "service_tier"); tier != nullptr && *tier != "auto" && *tier != "standard_only") {
    throw invalid_request("service_tier", "service_tier must be auto or standard_only");
  }
  if (const ojson* metadata = field(body, "metadata"); metadata != nullptr && !metadata->is_object()) {
    throw invalid_request("metadata", "metadata must be an object, got " + kind(*metadata));
  }
  if (!counting) {
    const ojson* max = field(body, "max_tokens");
    if (max == nullptr) throw invalid_request("max_tokens", "max_tokens is required");
  }
  get_number(body, "temperature", 1.0, 0.0, 1.0);  // Anthropic's range; the chat route takes up to 2
  if (const ojson* k = field(body, "top_k"); k != nullptr && require_integer(*k, "top_k") < 1) {
    throw invalid_request("top_k", "top_k must be a positive integer");
  }

  const Translation t = translate_messages(body);
  ojson chat = ojson::object();
  // the chat route reads these as they are
  for (const char* key : {"model", "stream", "temperature", "top_p", "top_k", "max_tokens", "seed", "ignore_eos",
                          "cache_salt", "speculative", "draft_length", "acceptance_guard", "prefill_mode", "priority", "dsv41_forced_output"}) {
    if (counting && std::string_view(key) == "max_tokens") continue;
    if (const ojson* v = field(body, key)) chat[key] = *v;
  }
  chat["messages"] = t.messages;
  chat["thinking"] = thinking_of(body, counting);
  if (const ojson* stop = field(body, "stop_sequences")) {
    if (!stop->is_array()) throw invalid_request("stop_sequences", "stop_sequences must be an array of strings, got " + kind(*stop));
    chat["stop"] = *stop;
  }
  if (const ojson* tools = field(body, "tools")) chat["tools"] = tools_of(*tools);
  if (const ojson* choice = field(body, "tool_choice")) chat["tool_choice"] = tool_choice_of(*choice);

  ApiRequest req;
  try {
    req = parse_request_json(Endpoint::ChatCompletions, chat, model);
  } catch (ApiError& e) {
    rename_param(e, t);
    throw;
  }
  req.endpoint = Endpoint::Messages;
  return req;
}

nlohmann::json messages_error_body(const ApiError& e) {
  const char* type = "api_error";
  switch (e.status) {
    case 400: case 405: case 411: case 415: case 422: case 431: type = "invalid_request_error"; break;
    case 401: type = "authentication_error"; break;
    case 403: type = "permission_error"; break;
    case 404: type = "not_found_error"; break;
    case 413: type = "request_too_large"; break;
    case 429: type = "rate_limit_error"; break;
    case 503: case 529: type = "overloaded_error"; break;
    case 504: type = "timeout_error"; break;
    default: break;
  }
  return {{"type", "error"}, {"error", {{"type", type}, {"message", e.message}}}};
}

}  // namespace dsv41::server
