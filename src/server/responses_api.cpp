#include "server/responses_api.h"

#include <set>
#include <string>

#include "server/access_policy.h"
#include "server/chat_fields.h"
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

// A message's content: a string, or parts of text (input_text, output_text, refusal) and images,
// as chat content parts.
ojson message_content(const ojson& content, const std::string& path) {
  if (content.is_string()) return content;
  if (!content.is_array()) {
    throw invalid_request(path, path + " must be a string or an array of content parts, got " + kind(content));
  }
  ojson parts = ojson::array();
  for (size_t i = 0; i < content.size(); ++i) {
    const ojson& part = content[i];
    const std::string where = at(path, i);
    if (!part.is_object()) throw invalid_request(where, where + " must be an object, got " + kind(part));
    const std::string& type = required_string(part, "type", where);
    if (type == "input_text" || type == "output_text") {
      parts.push_back({{"type", "text"}, {"text", required_string(part, "text", where)}});
    } else if (type == "refusal") {
      parts.push_back({{"type", "text"}, {"text", required_string(part, "refusal", where)}});
    } else if (type == "input_image") {
      parts.push_back({{"type", "image_url"}, {"image_url", {{"url", required_string(part, "image_url", where)}}}});
    } else {
      throw invalid_request(where + ".type", where + ".type \"" + printable(type) +
                                                 "\" is not supported (input_text, output_text, refusal, input_image)");
    }
  }
  return parts;
}

// A function_call_output's output: a string, or text parts joined.
std::string call_output(const ojson& output, const std::string& path) {
  if (output.is_string()) return output.get<std::string>();
  if (!output.is_array()) throw invalid_request(path, path + " must be a string or an array of input_text parts, got " + kind(output));
  std::string text;
  for (size_t i = 0; i < output.size(); ++i) {
    const std::string where = at(path, i);
    if (!output[i].is_object() || required_string(output[i], "type", where) != "input_text") {
      throw invalid_request(where, where + " must be an input_text part");
    }
    text += required_string(output[i], "text", where);
  }
  return text;
}

// A reasoning item's text: its reasoning_text content, else its summary.
std::string reasoning_text(const ojson& item, const std::string& path) {
  std::string text;
  for (const char* key : {"content", "summary"}) {
    const ojson* parts = field(item, key);
    if (parts == nullptr) continue;
    if (!parts->is_array()) throw invalid_request(path + "." + key, path + "." + key + " must be an array");
    for (size_t i = 0; i < parts->size(); ++i) {
      const std::string where = at(path + "." + key, i);
      if (!(*parts)[i].is_object()) throw invalid_request(where, where + " must be an object");
      text += required_string((*parts)[i], "text", where);
    }
    if (!text.empty()) break;
  }
  return text;
}

// `input` (a string or a list of items) after `instructions`, as chat messages.
ojson messages_of(const ojson& body) {
  ojson messages = ojson::array();
  if (const ojson* instructions = field(body, "instructions")) {
    if (!instructions->is_string()) throw invalid_request("instructions", "instructions must be a string, got " + kind(*instructions));
    messages.push_back({{"role", "system"}, {"content", *instructions}});
  }
  const ojson* input = field(body, "input");
  if (input == nullptr) throw invalid_request("input", "input is required");
  if (input->is_string()) {
    messages.push_back({{"role", "user"}, {"content", *input}});
    return messages;
  }
  if (!input->is_array() || input->empty()) {
    throw invalid_request("input", "input must be a string or a non-empty array of items, got " + kind(*input));
  }
  std::set<std::string> call_ids;  // of the function calls so far: an output must answer one
  std::string reasoning;           // a reasoning item's text, for the assistant turn that follows
  // The assistant message that function calls join: the one just added, if it is an assistant's.
  auto assistant_turn = [&]() -> ojson& {
    if (messages.empty() || messages.back()["role"] != "assistant") {
      messages.push_back({{"role", "assistant"}, {"content", ""}});
    }
    ojson& m = messages.back();
    if (!reasoning.empty()) {
      m["reasoning_content"] = reasoning;
      reasoning.clear();
    }
    return m;
  };
  for (size_t i = 0; i < input->size(); ++i) {
    const ojson& item = (*input)[i];
    const std::string where = at("input", i);
    if (!item.is_object()) throw invalid_request(where, where + " must be an object, got " + kind(item));
    const ojson* type_field = field(item, "type");
    if (type_field != nullptr && !type_field->is_string()) throw invalid_request(where + ".type", where + ".type must be a string");
    const std::string type = type_field ? type_field->get<std::string>() : "message";
    if (type == "message") {
      const std::string& role = required_string(item, "role", where);
      if (role != "user" && role != "assistant" && role != "system" && role != "developer") {
        throw invalid_request(where + ".role", where + ".role must be user, assistant, system or developer, got \"" +
                                                   printable(role) + "\"");
      }
      const ojson* content = field(item, "content");
      if (content == nullptr) throw invalid_request(where + ".content", where + ".content is required");
      if (role == "assistant") {
        messages.push_back({{"role", "assistant"}, {"content", message_content(*content, where + ".content")}});
        if (!reasoning.empty()) {
          messages.back()["reasoning_content"] = reasoning;
          reasoning.clear();
        }
      } else {
        messages.push_back({{"role", role}, {"content", message_content(*content, where + ".content")}});
      }
    } else if (type == "function_call") {
      const std::string& call_id = required_string(item, "call_id", where);
      if (call_id.empty()) throw invalid_request(where + ".call_id", where + ".call_id must not be empty");
      if (call_ids.count(call_id) != 0) {
        throw invalid_request(where + ".call_id", where + ".call_id \"" + printable(call_id) + "\" is an earlier call's");
      }
      const std::string& name = required_string(item, "name", where);
      if (!is_dsml_name(name)) {
        throw invalid_request(where + ".name", where + ".name must be at most 256 bytes without '\"', '<', '>' or a newline");
      }
      const std::string& arguments = required_string(item, "arguments", where);
      if (!is_arguments_object(arguments)) {
        throw invalid_request(where + ".arguments", where + ".arguments must be JSON text of an object");
      }
      ojson call = {{"id", call_id},
                    {"type", "function"},
                    {"function", {{"name", name}, {"arguments", arguments}}}};
      ojson& turn = assistant_turn();
      if (!turn.contains("tool_calls")) turn["tool_calls"] = ojson::array();
      turn["tool_calls"].push_back(std::move(call));
      call_ids.insert(call_id);
    } else if (type == "function_call_output") {
      const std::string& call_id = required_string(item, "call_id", where);
      if (call_ids.count(call_id) == 0) {
        throw invalid_request(where + ".call_id", where + ".call_id \"" + printable(call_id) +
                                                      "\" answers no function_call earlier in input");
      }
      const ojson* output = field(item, "output");
      if (output == nullptr) throw invalid_request(where + ".output", where + ".output is required");
      messages.push_back({{"role", "tool"}, {"tool_call_id", call_id}, {"content", call_output(*output, where + ".output")}});
    } else if (type == "reasoning") {
      reasoning += reasoning_text(item, where);
    } else if (type == "item_reference") {
      throw invalid_request(where + ".type", "item_reference is not supported: this server keeps no responses; "
                                             "send the items themselves in input");
    } else {
      throw invalid_request(where + ".type", where + ".type \"" + printable(type) +
                                                 "\" is not supported (message, function_call, function_call_output, reasoning)");
    }
  }
  return messages;
}

// Function tools in the chat shape.
ojson tools_of(const ojson& tools) {
  if (!tools.is_array()) throw invalid_request("tools", "tools must be an array, got " + kind(tools));
  ojson out = ojson::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string where = at("tools", i);
    if (!tools[i].is_object()) throw invalid_request(where, where + " must be an object");
    const std::string& type = required_string(tools[i], "type", where);
    if (type != "function") {
      throw invalid_request(where + ".type", where + ".type \"" + printable(type) + "\" is not supported (only function tools)");
    }
    required_string(tools[i], "name", where);
    ojson function = ojson::object();  // name, description, parameters, strict: in the client's order
    for (const auto& [key, value] : tools[i].items()) {
      if (key != "type") function[key] = value;
    }
    out.push_back({{"type", "function"}, {"function", std::move(function)}});
  }
  return out;
}

ojson tool_choice_of(const ojson& choice) {
  if (choice.is_string()) return choice;  // auto, none, required (the chat route checks the value)
  if (!choice.is_object()) throw invalid_request("tool_choice", "tool_choice must be a string or an object, got " + kind(choice));
  const std::string& type = required_string(choice, "type", "tool_choice");
  if (type != "function") {
    throw invalid_request("tool_choice.type", "tool_choice.type \"" + printable(type) + "\" is not supported (only function)");
  }
  return {{"type", "function"}, {"function", {{"name", required_string(choice, "name", "tool_choice")}}}};
}

// text.format as a chat response_format (absent for plain text).
const ojson* text_format(const ojson& body) {
  const ojson* text = field(body, "text");
  if (text == nullptr) return nullptr;
  if (!text->is_object()) throw invalid_request("text", "text must be an object, got " + kind(*text));
  const ojson* format = field(*text, "format");
  if (format != nullptr && !format->is_object()) throw invalid_request("text.format", "text.format must be an object");
  return format;
}

ojson response_format_of(const ojson& format) {
  const std::string& type = required_string(format, "type", "text.format");
  if (type == "text" || type == "json_object") return {{"type", type}};
  if (type != "json_schema") {
    throw invalid_request("text.format.type", "text.format.type must be text, json_object or json_schema, got \"" +
                                                  printable(type) + "\"");
  }
  required_string(format, "name", "text.format");
  ojson schema = ojson::object();  // name, description, schema, strict: in the client's order
  for (const auto& [key, value] : format.items()) {
    if (key != "type") schema[key] = value;
  }
  return {{"type", "json_schema"}, {"json_schema", std::move(schema)}};
}

}  // namespace

ApiRequest parse_responses_request(std::string_view text, const ModelInfo& model) {
  const ojson body = parse_json_body(text);
  for (const char* key : {"previous_response_id", "conversation"}) {
    if (field(body, key) != nullptr) {
      throw invalid_request(key, std::string(key) + " is not supported: this server keeps no responses; send the "
                                                    "whole conversation in input");
    }
  }
  if (get_bool(body, "background", false)) throw invalid_request("background", "background responses are not supported");

  ojson chat = ojson::object();
  // the chat route reads these as they are
  for (const char* key : {"model", "stream", "temperature", "top_p", "seed", "ignore_eos", "cache_salt", "thinking",
                          "chat_template_kwargs", "speculative", "draft_length", "acceptance_guard", "prefill_mode",
                          "priority", "dsv41_forced_output"}) {
    if (const ojson* v = field(body, key)) chat[key] = *v;
  }
  chat["messages"] = messages_of(body);
  if (const ojson* tools = field(body, "tools")) chat["tools"] = tools_of(*tools);
  if (const ojson* choice = field(body, "tool_choice")) chat["tool_choice"] = tool_choice_of(*choice);
  if (const ojson* max = field(body, "max_output_tokens")) {
    const int64_t n = require_integer(*max, "max_output_tokens");
    if (n < 1) throw invalid_request("max_output_tokens", "max_output_tokens must be at least 1, got " + std::to_string(n));
    chat["max_tokens"] = n;
  }
  ojson reasoning_echo = {{"effort", nullptr}, {"summary", nullptr}};
  if (const ojson* reasoning = field(body, "reasoning")) {
    if (!reasoning->is_object()) throw invalid_request("reasoning", "reasoning must be an object, got " + kind(*reasoning));
    if (const ojson* effort = field(*reasoning, "effort")) {
      if (!effort->is_string()) throw invalid_request("reasoning.effort", "reasoning.effort must be a string, got " + kind(*effort));
      chat["reasoning_effort"] = *effort;
      reasoning_echo["effort"] = *effort;
    }
  }
  ojson format_echo = {{"type", "text"}};
  if (const ojson* format = text_format(body)) {
    chat["response_format"] = response_format_of(*format);
    format_echo = *format;
  }
  if (const ojson* parallel = field(body, "parallel_tool_calls"); parallel != nullptr && !parallel->is_boolean()) {
    throw invalid_request("parallel_tool_calls", "parallel_tool_calls must be a boolean, got " + kind(*parallel));
  }
  if (const ojson* metadata = field(body, "metadata"); metadata != nullptr && !metadata->is_object()) {
    throw invalid_request("metadata", "metadata must be an object, got " + kind(*metadata));
  }

  ApiRequest req;
  try {
    req = parse_request_json(Endpoint::ChatCompletions, chat, model);
  } catch (ApiError& e) {
    // the chat route's names for the fields this route renames; tools keep their order, their
    // function's fields sit on the tool itself
    if (e.param == "max_tokens") e.param = "max_output_tokens";
    if (const size_t f = e.param.find("].function."); e.param.starts_with("tools[") && f != std::string::npos) {
      e.param.erase(f + 1, std::string_view(".function").size());
    }
    if (e.param == "reasoning_effort") e.param = "reasoning.effort";
    if (e.param == "response_format") e.param = "text.format";
    throw;
  }
  req.endpoint = Endpoint::Responses;
  const auto echo = [&](const char* key, nlohmann::json fallback) -> nlohmann::json {
    const ojson* v = field(body, key);
    return v ? nlohmann::json::parse(v->dump()) : std::move(fallback);
  };
  req.responses_echo = {
      {"instructions", echo("instructions", nullptr)},
      {"max_output_tokens", echo("max_output_tokens", nullptr)},
      {"parallel_tool_calls", echo("parallel_tool_calls", true)},
      {"temperature", req.params.sampling.temperature},
      {"top_p", req.params.sampling.top_p},
      {"tool_choice", echo("tool_choice", "auto")},
      {"tools", echo("tools", nlohmann::json::array())},
      {"reasoning", nlohmann::json::parse(reasoning_echo.dump())},
      {"text", {{"format", nlohmann::json::parse(format_echo.dump())}}},
      {"metadata", echo("metadata", nlohmann::json::object())},
  };
  return req;
}

}  // namespace dsv41::server
