// Rendering follows docs/chat-encoding.md §2–§3 (the release encoder): normalise each message, attach
// the request's tools / response_format to the index-0 system message, merge tool results into user
// turns, order them by call order, drop earlier reasoning, then render message by message.
#include "text/chat_encoding.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "text/chat_output.h"
#include "util/error.h"

namespace dsv41 {
namespace {

using ojson = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------------
// Python json.dumps(..., ensure_ascii=False)

// Python's float repr: the shortest round-trip digits, written positionally when the decimal
// point position is in [-3, 16], otherwise as d.ddde±XX; integral values keep a ".0".
void append_python_float(std::string& out, double value) {
  if (std::isnan(value)) {
    out += "NaN";
    return;
  }
  if (std::isinf(value)) {
    out += value < 0 ? "-Infinity" : "Infinity";
    return;
  }
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, value, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(res.ptr - buf));  // e.g. "-1.5e-07", "0e+00"
  if (sci.front() == '-') {
    out += '-';
    sci.remove_prefix(1);
  }
  const size_t e = sci.find('e');
  std::string digits;
  for (const char c : sci.substr(0, e)) {
    if (c != '.') digits += c;
  }
  int exponent = 0;
  std::string_view exp_text = sci.substr(e + 1);
  if (!exp_text.empty() && exp_text.front() == '+') exp_text.remove_prefix(1);
  std::from_chars(exp_text.data(), exp_text.data() + exp_text.size(), exponent);
  const int ndigits = static_cast<int>(digits.size());
  const int point = exponent + 1;  // digits before the decimal point
  if (point <= -4 || point > 16) {
    out += digits[0];
    if (ndigits > 1) {
      out += '.';
      out.append(digits, 1);
    }
    out += exponent < 0 ? "e-" : "e+";
    const int magnitude = std::abs(exponent);
    if (magnitude < 10) out += '0';
    out += std::to_string(magnitude);
  } else if (point <= 0) {
    out += "0.";
    out.append(static_cast<size_t>(-point), '0');
    out += digits;
  } else if (point >= ndigits) {
    out += digits;
    out.append(static_cast<size_t>(point - ndigits), '0');
    out += ".0";
  } else {
    out.append(digits, 0, static_cast<size_t>(point));
    out += '.';
    out.append(digits, static_cast<size_t>(point));
  }
}

void dump_to(std::string& out, const ojson& value) {
  switch (value.type()) {
    case ojson::value_t::null:
      out += "null";
      break;
    case ojson::value_t::boolean:
      out += value.get<bool>() ? "true" : "false";
      break;
    case ojson::value_t::number_integer:
      out += std::to_string(value.get<std::int64_t>());
      break;
    case ojson::value_t::number_unsigned:
      out += std::to_string(value.get<std::uint64_t>());
      break;
    case ojson::value_t::number_float:
      append_python_float(out, value.get<double>());
      break;
    case ojson::value_t::string:
      append_python_json_string(out, value.get_ref<const std::string&>());
      break;
    case ojson::value_t::array: {
      out += '[';
      bool first = true;
      for (const auto& item : value) {
        if (!first) out += ", ";
        first = false;
        dump_to(out, item);
      }
      out += ']';
      break;
    }
    case ojson::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [key, item] : value.items()) {
        if (!first) out += ", ";
        first = false;
        append_python_json_string(out, key);
        out += ": ";
        dump_to(out, item);
      }
      out += '}';
      break;
    }
    case ojson::value_t::binary:
    case ojson::value_t::discarded:
      fail("json", "binary or discarded values have no JSON text");
  }
}

// ---------------------------------------------------------------------------------------------
// Fixed prompt text (docs §2.3, §3.1)

constexpr std::string_view kEffortHead = "Reasoning Effort: ";
constexpr std::string_view kEffortTail =
    " (range 1-100, the higher the value, the more thorough the reasoning)\n\n";
constexpr std::string_view kResponseFormatHead =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";
constexpr std::string_view kToolsHead = R"(## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:

<｜DSML｜ calls>
<｜DSML｜ invoke name="$TOOL_NAME">
<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>
...
</｜DSML｜ invoke>
<｜DSML｜ invoke name="$TOOL_NAME2">
...
</｜DSML｜ invoke>
</｜DSML｜ calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

)";
constexpr std::string_view kToolsTail =
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

// ---------------------------------------------------------------------------------------------
// Normalised messages

// A message's content parts in order, joined by "\n\n" when rendered. An image part is exactly the
// placeholder: text that spells it is refused (docs §2.2 step 1), so every placeholder is a slot.
using Parts = std::vector<std::string>;

struct Block {
  bool tool_result = false;
  Parts parts;  // a user text or image part, or the content of a tool result
  std::string tool_call_id;
  bool plain = false;  // its role may not write control tokens (SpecialTokenRoles)
};

struct Call {
  std::string id;               // only used to order tool results
  std::string name;             // namespace-qualified ("ns::name") as rendered
  const ojson* arguments = nullptr;  // points into the request, which outlives rendering
};

struct Msg {
  std::string role;             // system, user, assistant, latest_reminder; tool until merged
  Parts content;                // all roles but user / tool
  std::vector<Block> blocks;    // user and tool
  std::string reasoning;        // assistant
  std::vector<Call> calls;      // assistant
  std::string tool_schemas;     // index-0 system: the tools' schema lines (docs §3.1)
  std::string response_format;  // index-0 system: the response_format object as JSON text
  bool has_tools = false;
  bool wo_eos = false;
  bool plain = false;           // content, reasoning and calls: the role may not write control tokens
};

std::string type_name(const ojson& v) { return v.type_name(); }

bool truthy(const ojson& v) {
  if (v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_string() || v.is_array() || v.is_object()) return !v.empty();
  if (v.is_number()) return v.get<double>() != 0.0;
  return true;
}

const ojson* find_key(const ojson& obj, const char* key) {
  const auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

// A string field that may be absent or null (then `fallback`).
std::string optional_string(const ojson& obj, const char* key, const std::string& where,
                            const std::string& fallback = "") {
  const ojson* v = find_key(obj, key);
  if (v == nullptr) return fallback;
  if (!v->is_string()) fail(where + "." + key, "must be a string, got " + type_name(*v));
  return v->get<std::string>();
}

std::optional<bool> optional_bool(const ojson& obj, const char* key, const std::string& where) {
  const ojson* v = find_key(obj, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_boolean()) fail(where + key, "must be a boolean, got " + type_name(*v));
  return v->get<bool>();
}

void reject_placeholder(const std::string& text, const std::string& where) {
  // The reference refuses text that would forge an image slot (docs §2.2 step 1).
  if (text.find(kImagePlaceholder) != std::string::npos) {
    fail(where, "contains the reserved image placeholder " + std::string(kImagePlaceholder) +
                    "; send images as image_url parts");
  }
}

ojson image_record(const ojson& part, const std::string& where) {
  ojson record = ojson::object();
  record["type"] = "image";
  if (part["type"] == "image_url") {
    const ojson* u = find_key(part, "image_url");
    std::string url;
    if (u != nullptr && u->is_string()) {
      url = u->get<std::string>();
    } else if (u != nullptr && u->is_object()) {
      url = optional_string(*u, "url", where + ".image_url");
    } else if (u != nullptr) {
      fail(where + ".image_url", "must be an object with a url or a string");
    }
    if (url.empty()) fail(where + ".image_url", "has no url");
    record["url"] = url;
  } else {
    bool any = false;
    for (const char* key : {"source", "url", "data"}) {
      if (part.contains(key)) {
        record[key] = part[key];
        any = any || truthy(part[key]);
      }
    }
    if (!any) fail(where, "image part has no source, url or data");
  }
  return record;
}

// The text of each content part: a string is one part, null is one empty part, an array gives one
// part per element (image → placeholder, recorded in `images` when that is not null).
std::vector<std::string> content_parts(const ojson& msg, const std::string& where, std::vector<ojson>* images) {
  const ojson* content = find_key(msg, "content");
  const std::string cwhere = where + ".content";
  if (content == nullptr) return {""};
  if (content->is_string()) {
    reject_placeholder(content->get<std::string>(), cwhere);
    return {content->get<std::string>()};
  }
  if (!content->is_array()) {
    fail(cwhere, "must be a string, an array of content parts or null, got " + type_name(*content));
  }
  std::vector<std::string> parts;
  for (size_t k = 0; k < content->size(); ++k) {
    const ojson& part = (*content)[k];
    const std::string pwhere = cwhere + "[" + std::to_string(k) + "]";
    if (!part.is_object()) fail(pwhere, "must be an object, got " + type_name(part));
    const ojson* type = find_key(part, "type");
    if (type == nullptr || !type->is_string()) fail(pwhere + ".type", "must be a string");
    const std::string& t = type->get_ref<const std::string&>();
    if (t == "text") {
      std::string text = optional_string(part, "text", pwhere);
      reject_placeholder(text, pwhere + ".text");
      parts.push_back(std::move(text));
    } else if (t == "image_url" || t == "image") {
      ojson record = image_record(part, pwhere);
      if (images != nullptr) images->push_back(std::move(record));
      parts.emplace_back(kImagePlaceholder);
    } else {
      // Docs §3.4: other part types are kept visible rather than silently dropped.
      parts.push_back("[Unsupported " + t + "]");
    }
  }
  return parts;
}

std::string join(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out += sep;
    out += parts[i];
  }
  return out;
}

// Splits "ns::name" and checks it against an explicit namespace (docs §3.1 namespaces). The result is
// what an invoke tag carries, so it must be a name the output parser can read back.
std::string qualified_name(const std::string& name, std::optional<std::string> space, const std::string& where) {
  if (name.empty()) fail(where, "must not be empty");
  std::string bare = name;
  const size_t sep = name.find("::");
  if (sep != std::string::npos) {
    const std::string prefix = name.substr(0, sep);
    if (space && *space != prefix) {
      fail(where, "namespace \"" + *space + "\" conflicts with the name's prefix \"" + prefix + "\"");
    }
    space = prefix;
    bare = name.substr(sep + 2);
  }
  if (bare.find("::") != std::string::npos) fail(where, "a tool name must not contain '::' twice");
  if (space && space->find("::") != std::string::npos) fail(where, "a namespace must not contain '::'");
  std::string qualified = space ? *space + "::" + bare : bare;
  if (!is_dsml_name(qualified)) {
    fail(where, "a tool name must be at most 256 bytes without '\"', '<', '>' or a newline (a DSML invoke tag "
                "carries it)");
  }
  return qualified;
}

std::vector<Call> parse_calls(const ojson& msg, const std::string& where) {
  std::vector<Call> calls;
  const ojson* list = find_key(msg, "tool_calls");
  if (list == nullptr) return calls;
  if (!list->is_array()) fail(where + ".tool_calls", "must be an array, got " + type_name(*list));
  for (size_t j = 0; j < list->size(); ++j) {
    const ojson& tc = (*list)[j];
    const std::string cw = where + ".tool_calls[" + std::to_string(j) + "]";
    if (!tc.is_object()) fail(cw, "must be an object");
    if (optional_string(tc, "type", cw, "function") != "function") fail(cw + ".type", "must be \"function\"");
    const ojson* fn = find_key(tc, "function");
    if (fn == nullptr || !fn->is_object()) fail(cw + ".function", "must be an object");
    const ojson* name = find_key(*fn, "name");
    if (name == nullptr || !name->is_string()) fail(cw + ".function.name", "must be a string");
    const auto args = fn->find("arguments");
    if (args == fn->end()) fail(cw + ".function.arguments", "is required");
    std::optional<std::string> space;
    std::string ns = optional_string(tc, "namespace", cw);
    if (ns.empty()) ns = optional_string(*fn, "namespace", cw + ".function");
    if (!ns.empty()) space = ns;
    Call call;
    call.id = optional_string(tc, "id", cw);
    if (call.id.empty()) call.id = optional_string(*fn, "id", cw + ".function");
    call.name = qualified_name(name->get<std::string>(), space, cw + ".function.name");
    call.arguments = &*args;
    calls.push_back(std::move(call));
  }
  return calls;
}

// One request message → Msg. `index` is its position in context + messages (developer maps on it).
Msg parse_message(const ojson& m, size_t index, const std::string& where, std::vector<ojson>* images,
                  const SpecialTokenRoles& roles) {
  if (!m.is_object()) fail(where, "must be an object, got " + type_name(m));
  const ojson* role_v = find_key(m, "role");
  if (role_v == nullptr || !role_v->is_string()) fail(where + ".role", "must be a string");
  Msg msg;
  msg.role = role_v->get<std::string>();
  if (msg.role == "developer") msg.role = index == 0 ? "system" : "user";  // docs §2.2 recommendation
  if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool" &&
      msg.role != "latest_reminder") {
    fail(where + ".role", "unknown role \"" + role_v->get<std::string>() +
                              "\" (expected system, user, assistant, tool, latest_reminder or developer)");
  }
  msg.plain = !roles.parses(msg.role);
  Parts parts = content_parts(m, where, images);
  if (msg.role == "user") {
    for (std::string& p : parts) msg.blocks.push_back(Block{false, {std::move(p)}, "", msg.plain});
  } else if (msg.role == "tool") {
    msg.blocks.push_back(Block{true, std::move(parts), optional_string(m, "tool_call_id", where), msg.plain});
  } else {
    msg.content = std::move(parts);
  }
  if (msg.role == "assistant") {
    const char* key = m.contains("reasoning_content") ? "reasoning_content" : "reasoning";
    msg.reasoning = optional_string(m, key, where);
    reject_placeholder(msg.reasoning, where + "." + key);
    msg.calls = parse_calls(m, where);
  }
  return msg;
}

std::vector<Msg> parse_messages(const ojson& list, const char* name, size_t first_index, std::vector<ojson>* images,
                                const SpecialTokenRoles& roles) {
  std::vector<Msg> out;
  for (size_t i = 0; i < list.size(); ++i) {
    out.push_back(
        parse_message(list[i], first_index + i, std::string(name) + "[" + std::to_string(i) + "]", images, roles));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Request-level parts

// The tools the prompt offers, after tool_choice filtering: their schema lines (docs §3.1) and names.
struct OfferedTools {
  std::string schemas;
  std::vector<std::string> names;
};

OfferedTools render_tools(const ojson& request) {
  const ojson* tools = find_key(request, "tools");
  if (tools != nullptr && !tools->is_array()) fail("tools", "must be an array, got " + type_name(*tools));
  const size_t tool_count = tools == nullptr ? 0 : tools->size();

  std::optional<std::string> only;  // a named tool_choice
  bool none = false;
  if (const ojson* choice = find_key(request, "tool_choice")) {
    if (choice->is_string()) {
      const std::string& c = choice->get_ref<const std::string&>();
      if (c == "none") {
        none = true;
      } else if (c == "required") {
        if (tool_count == 0) fail("tool_choice", "\"required\" needs at least one tool");
      } else if (c != "auto") {
        fail("tool_choice", "must be \"none\", \"auto\", \"required\" or a named function");
      }
    } else if (choice->is_object()) {
      const ojson* fn = find_key(*choice, "function");
      const ojson* n = fn != nullptr && fn->is_object() ? find_key(*fn, "name") : nullptr;
      if (n == nullptr || !n->is_string()) fail("tool_choice.function.name", "must be a string");
      only = n->get<std::string>();
    } else {
      fail("tool_choice", "must be a string or an object, got " + type_name(*choice));
    }
  }

  std::vector<std::string> schemas;
  std::vector<std::string> names;     // offered, after tool_choice
  std::vector<std::string> declared;  // all
  bool found_only = false;
  for (size_t k = 0; k < tool_count; ++k) {
    const ojson& tool = (*tools)[k];
    const std::string where = "tools[" + std::to_string(k) + "]";
    if (!tool.is_object()) fail(where, "must be an object");
    if (optional_string(tool, "type", where, "function") != "function") fail(where + ".type", "must be \"function\"");
    const ojson* fn_v = find_key(tool, "function");
    if (fn_v == nullptr || !fn_v->is_object()) fail(where + ".function", "must be an object");
    const ojson* name = find_key(*fn_v, "name");
    if (name == nullptr || !name->is_string()) fail(where + ".function.name", "must be a string");

    // The schema line is the function object as sent, with the name namespace-qualified and a
    // namespace description put in front of the tool's description.
    ojson fn = *fn_v;
    if (const ojson* ns = find_key(tool, "namespace")) fn["namespace"] = *ns;
    std::optional<std::string> space;
    ojson ns_value;
    if (fn.contains("namespace")) {
      ns_value = fn["namespace"];
      fn.erase("namespace");
      if (ns_value.is_string()) {
        space = ns_value.get<std::string>();
      } else if (ns_value.is_object()) {
        const ojson* n = find_key(ns_value, "name");
        if (n == nullptr || !n->is_string()) fail(where + ".namespace.name", "must be a string");
        space = n->get<std::string>();
      } else if (!ns_value.is_null()) {
        fail(where + ".namespace", "must be a string or an object");
      }
    }
    const std::string qualified = qualified_name(name->get<std::string>(), space, where + ".function.name");
    // A call names its tool, so two tools of one name would leave a call's target to chance.
    if (std::find(declared.begin(), declared.end(), qualified) != declared.end()) {
      fail(where + ".function.name", "\"" + qualified + "\" names an earlier tool too");
    }
    declared.push_back(qualified);
    if (only && name->get<std::string>() != *only) continue;
    found_only = true;
    fn["name"] = qualified;
    names.push_back(qualified);
    if (ns_value.is_object()) {
      const ojson* d = find_key(ns_value, "description");
      if (d != nullptr && d->is_string() && !d->get_ref<const std::string&>().empty()) {
        const ojson* own = find_key(fn, "description");
        const std::string own_text = own != nullptr && own->is_string() ? own->get<std::string>() : "";
        fn["description"] = d->get<std::string>() + "\n" + own_text;
      }
    }
    schemas.push_back(python_json_dumps(fn));
  }
  if (only && !found_only) fail("tool_choice.function.name", "names \"" + *only + "\", which is not in tools");
  if (none || schemas.empty()) return {};
  return {join(schemas, "\n"), std::move(names)};
}

std::string render_response_format(const ojson& request) {
  const ojson* rf = find_key(request, "response_format");
  if (rf == nullptr) return "";
  if (!rf->is_object()) fail("response_format", "must be an object, got " + type_name(*rf));
  const ojson* type = find_key(*rf, "type");
  if (type == nullptr || !type->is_string()) fail("response_format.type", "must be a string");
  if (*type == "text") return "";  // OpenAI's default: no constraint to state
  return python_json_dumps(*rf);
}

struct Knobs {
  bool thinking = true;
  bool drop_thinking = true;
  int effort = 75;
  bool continue_final = false;
};

Knobs read_knobs(const ojson& request, const ChatOptions& options) {
  Knobs k;
  bool any_on = false;
  bool any_off = false;
  auto note = [&](std::optional<bool> on) {
    if (on) (*on ? any_on : any_off) = true;
  };

  if (const ojson* t = find_key(request, "thinking")) {
    if (t->is_boolean()) {
      note(t->get<bool>());
    } else if (t->is_object()) {
      const std::string type = optional_string(*t, "type", "thinking");
      if (type != "enabled" && type != "disabled") fail("thinking.type", "must be \"enabled\" or \"disabled\"");
      note(type == "enabled");
    } else {
      fail("thinking", "must be a boolean or {\"type\": \"enabled\"|\"disabled\"}");
    }
  }
  note(optional_bool(request, "enable_thinking", ""));
  if (const ojson* mode = find_key(request, "thinking_mode")) {
    if (*mode != "thinking" && *mode != "chat") fail("thinking_mode", "must be \"thinking\" or \"chat\"");
    note(*mode == "thinking");
  }
  std::optional<bool> drop = optional_bool(request, "drop_thinking", "");
  if (const ojson* kw = find_key(request, "chat_template_kwargs")) {
    if (!kw->is_object()) fail("chat_template_kwargs", "must be an object");
    note(optional_bool(*kw, "thinking", "chat_template_kwargs."));
    note(optional_bool(*kw, "enable_thinking", "chat_template_kwargs."));
    if (!drop) drop = optional_bool(*kw, "drop_thinking", "chat_template_kwargs.");
  }

  if (const ojson* e = find_key(request, "reasoning_effort")) {
    static const std::map<std::string, int, std::less<>> kEfforts = {
        {"minimal", 50}, {"low", 50}, {"medium", 75}, {"high", 75}, {"xhigh", 75}, {"max", 100}};
    const char* expected = "must be an integer from 1 to 100 or one of none, minimal, low, medium, high, xhigh, max";
    if (e->is_number_integer()) {
      const std::int64_t v = e->get<std::int64_t>();
      if (v < 1 || v > 100) fail("reasoning_effort", expected);
      k.effort = static_cast<int>(v);
    } else if (e->is_string()) {
      const std::string& s = e->get_ref<const std::string&>();
      if (s == "none") {
        any_off = true;
      } else {
        const auto it = kEfforts.find(s);
        if (it == kEfforts.end()) fail("reasoning_effort", expected);
        k.effort = it->second;
      }
    } else {
      fail("reasoning_effort", expected);
    }
  }

  k.thinking = any_off ? false : any_on ? true : options.thinking;
  k.drop_thinking = drop.value_or(options.drop_thinking);
  k.continue_final = optional_bool(request, "continue_final_message", "").value_or(false);
  return k;
}

// ---------------------------------------------------------------------------------------------
// Pre-processing (docs §2.2)

// Tool results join the user turn before them; consecutive user turns collapse into one.
std::vector<Msg> merge_user_turns(std::vector<Msg> in) {
  std::vector<Msg> out;
  for (Msg& m : in) {
    const bool user_like = m.role == "user" || m.role == "tool";
    if (user_like && !out.empty() && out.back().role == "user") {
      for (Block& b : m.blocks) out.back().blocks.push_back(std::move(b));
      continue;
    }
    if (user_like) m.role = "user";
    out.push_back(std::move(m));
  }
  return out;
}

// Re-orders the tool results of each user turn to the call order of the latest assistant calls;
// unknown ids count as position 0 and text blocks keep their slots.
void sort_tool_results(std::vector<Msg>& msgs) {
  std::map<std::string, size_t> order;
  for (Msg& m : msgs) {
    if (m.role == "assistant" && !m.calls.empty()) {
      order.clear();
      for (size_t i = 0; i < m.calls.size(); ++i) {
        if (!m.calls[i].id.empty()) order[m.calls[i].id] = i;
      }
      continue;
    }
    if (m.role != "user" || order.empty()) continue;
    std::vector<Block> results;
    for (const Block& b : m.blocks) {
      if (b.tool_result) results.push_back(b);
    }
    if (results.size() < 2) continue;
    auto position = [&](const Block& b) {
      const auto it = order.find(b.tool_call_id);
      return it == order.end() ? size_t{0} : it->second;
    };
    std::stable_sort(results.begin(), results.end(),
                     [&](const Block& a, const Block& b) { return position(a) < position(b); });
    size_t next = 0;
    for (Block& b : m.blocks) {
      if (b.tool_result) b = results[next++];
    }
  }
}

// L of docs §2.2 step 4: the last user turn or mid-conversation system message, or -1.
std::ptrdiff_t last_user_index(const std::vector<Msg>& msgs) {
  for (size_t i = msgs.size(); i-- > 0;) {
    if (msgs[i].role == "user" || (msgs[i].role == "system" && i > 0)) return static_cast<std::ptrdiff_t>(i);
  }
  return -1;
}

// ---------------------------------------------------------------------------------------------
// Rendering (docs §2.3, §3.2)

// The prompt as it is written: the template's markup (control tokens included) and message text,
// whose span is recorded when its role may not write control tokens.
class PromptWriter {
 public:
  explicit PromptWriter(ChatPrompt& prompt) : prompt_(prompt) {}

  void markup(std::string_view s) { prompt_.text += s; }
  void text(std::string_view s, bool plain) {
    std::vector<TextSpan>& spans = prompt_.plain_spans;
    const size_t at = prompt_.text.size();
    if (plain && !s.empty()) {
      if (!spans.empty() && spans.back().end == at) {
        spans.back().end += s.size();
      } else {
        spans.push_back(TextSpan{at, at + s.size()});
      }
    }
    prompt_.text += s;
  }
  // Content parts: an image's placeholder stays markup, so its slot is a control token whatever the role.
  void parts(const Parts& parts, bool plain) {
    for (size_t i = 0; i < parts.size(); ++i) {
      if (i > 0) markup("\n\n");
      if (parts[i] == kImagePlaceholder) {
        markup(parts[i]);
      } else {
        text(parts[i], plain);
      }
    }
  }

 private:
  ChatPrompt& prompt_;
};

// A call's arguments as an object: an object, a JSON string or a doubly encoded one; anything else
// becomes a single string parameter "arguments" holding the value as sent (docs §3.2).
ojson arguments_object(const ojson& arguments) {
  if (arguments.is_object()) return arguments;
  ojson decoded = arguments;
  for (int round = 0; round < 2 && decoded.is_string(); ++round) {
    try {
      decoded = ojson::parse(decoded.get<std::string>());
    } catch (const nlohmann::json::exception&) {
      break;
    }
  }
  if (decoded.is_object()) return decoded;
  ojson wrapped = ojson::object();
  wrapped["arguments"] = arguments;
  return wrapped;
}

// The DSML block of an assistant turn's calls; names, keys and values are the message's text.
void write_calls(PromptWriter& out, const std::vector<Call>& calls, bool plain) {
  out.markup("\n\n");
  out.markup(kDsmlCallsOpen);
  out.markup("\n");
  for (size_t i = 0; i < calls.size(); ++i) {
    if (i > 0) out.markup("\n");
    out.markup(kDsmlInvokeOpen);
    out.markup(" name=\"");
    out.text(calls[i].name, plain);
    out.markup("\">\n");
    bool first = true;
    const ojson arguments = arguments_object(*calls[i].arguments);
    for (const auto& [key, value] : arguments.items()) {
      if (!first) out.markup("\n");
      first = false;
      out.markup(kDsmlParamOpen);
      out.markup(" name=\"");
      out.text(key, plain);
      out.markup(value.is_string() ? "\" string=\"true\">" : "\" string=\"false\">");
      out.text(value.is_string() ? value.get_ref<const std::string&>() : python_json_dumps(value), plain);
      out.markup(kDsmlParamClose);
    }
    out.markup("\n");
    out.markup(kDsmlInvokeClose);
  }
  out.markup("\n");
  out.markup(kDsmlCallsClose);
}

void render_message(PromptWriter& out, const std::vector<Msg>& msgs, size_t index, const Knobs& k, bool drop,
                    std::ptrdiff_t last_user) {
  const Msg& m = msgs[index];
  const auto i = static_cast<std::ptrdiff_t>(index);
  const bool effort_prefix = index == 0 && k.thinking;
  if (index == 0 && (effort_prefix || m.role == "system")) out.markup(kSystemToken);
  if (effort_prefix) {
    out.markup(kEffortHead);
    out.markup(std::to_string(k.effort));
    out.markup(kEffortTail);
  }

  if (m.role == "system") {
    if (index > 0) out.markup(kSystemToken);
    out.parts(m.content, m.plain);
    if (!m.tool_schemas.empty()) {
      out.markup("\n\n");
      out.markup(kToolsHead);
      out.text(m.tool_schemas, m.plain);
      out.markup(kToolsTail);
    }
    if (!m.response_format.empty()) {
      out.markup("\n\n");
      out.markup(kResponseFormatHead);
      out.text(m.response_format, m.plain);
    }
  } else if (m.role == "user") {
    out.markup(kUserToken);
    for (size_t b = 0; b < m.blocks.size(); ++b) {
      const Block& block = m.blocks[b];
      if (b > 0) out.markup("\n\n");
      if (block.tool_result) out.markup("<tool_result>");
      out.parts(block.parts, block.plain);
      if (block.tool_result) out.markup("</tool_result>");
    }
  } else if (m.role == "latest_reminder") {
    out.markup(kLatestReminderToken);
    out.parts(m.content, m.plain);
  } else {  // assistant
    if (k.thinking && (!drop || i > last_user)) {
      out.text(m.reasoning, m.plain);
      out.markup(kThinkClose);
    }
    out.parts(m.content, m.plain);
    if (!m.calls.empty()) write_calls(out, m.calls, m.plain);
    if (!m.wo_eos) out.markup(kEosToken);
  }

  // The generation header follows a user turn or mid-conversation system message when it is last
  // or an assistant / latest_reminder comes next.
  const bool user_like = m.role == "user" || (m.role == "system" && index > 0);
  const bool next_answers = index + 1 == msgs.size() || msgs[index + 1].role == "assistant" ||
                            msgs[index + 1].role == "latest_reminder";
  if (user_like && next_answers) {
    out.markup(kAssistantToken);
    out.markup(k.thinking && (!drop || i >= last_user) ? kThinkOpen : kThinkClose);
  }
}

// A tool result needs an assistant tool call before it (user / system turns may sit between).
void check_tool_messages(const std::vector<Msg>& msgs, const char* name, bool& calls_pending) {
  for (size_t i = 0; i < msgs.size(); ++i) {
    if (msgs[i].role == "assistant") calls_pending = !msgs[i].calls.empty();
    if (msgs[i].role == "tool" && !calls_pending) {
      fail(std::string(name) + "[" + std::to_string(i) + "]", "tool message without a preceding assistant tool call");
    }
  }
}

}  // namespace

void append_python_json_escaped(std::string& out, std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  for (const char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += "\\u00";
          out += kHex[static_cast<unsigned char>(c) >> 4];
          out += kHex[static_cast<unsigned char>(c) & 15];
        } else {
          out += c;
        }
    }
  }
}

void append_python_json_string(std::string& out, std::string_view text) {
  out += '"';
  append_python_json_escaped(out, text);
  out += '"';
}

std::string python_json_dumps(const nlohmann::ordered_json& value) {
  std::string out;
  dump_to(out, value);
  return out;
}

bool SpecialTokenRoles::parses(std::string_view role) const {
  if (role == "system") return system;
  if (role == "user") return user;
  if (role == "assistant") return assistant;
  if (role == "tool") return tool;
  return role == "latest_reminder" && latest_reminder;
}

SpecialTokenRoles parse_special_token_roles(std::string_view list, const std::string& where) {
  SpecialTokenRoles none{false, false, false, false, false};
  if (list == "none") return none;
  if (list == "all") return {true, true, true, true, true};
  SpecialTokenRoles roles = none;
  for (size_t start = 0; start <= list.size();) {
    const size_t comma = std::min(list.find(',', start), list.size());
    const std::string_view role = list.substr(start, comma - start);
    bool* flag = role == "system"            ? &roles.system
                 : role == "user"            ? &roles.user
                 : role == "assistant"       ? &roles.assistant
                 : role == "tool"            ? &roles.tool
                 : role == "latest_reminder" ? &roles.latest_reminder
                                             : nullptr;
    if (flag == nullptr) {
      fail(where, "unknown role \"" + std::string(role) +
                      "\": give all, none or a comma-separated list of system, user, assistant, tool, latest_reminder");
    }
    *flag = true;
    start = comma + 1;
  }
  return roles;
}

ChatPrompt render_chat(const nlohmann::ordered_json& request, const ChatOptions& options) {
  if (!request.is_object()) fail("request", "must be a JSON object");
  const ojson* messages_v = find_key(request, "messages");
  if (messages_v == nullptr || !messages_v->is_array() || messages_v->empty()) {
    fail("messages", "must be a non-empty array");
  }
  const ojson* context_v = find_key(request, "context");
  if (context_v != nullptr && !context_v->is_array()) fail("context", "must be an array");

  const Knobs knobs = read_knobs(request, options);
  ChatPrompt result;
  result.thinking = knobs.thinking;

  const SpecialTokenRoles& roles = options.special_tokens_in;
  std::vector<Msg> context =
      context_v ? parse_messages(*context_v, "context", 0, nullptr, roles) : std::vector<Msg>{};
  std::vector<Msg> messages = parse_messages(*messages_v, "messages", context.size(), &result.images, roles);
  bool calls_pending = false;
  check_tool_messages(context, "context", calls_pending);
  check_tool_messages(messages, "messages", calls_pending);
  if (knobs.continue_final) {
    if (messages.back().role != "assistant") {
      fail("continue_final_message", "the last message must be an assistant message");
    }
    messages.back().wo_eos = true;
  }

  // Tools and response_format belong to the system message at index 0 of the whole conversation;
  // one is inserted when the conversation does not start with a system message (as vLLM does).
  OfferedTools tools = render_tools(request);
  const std::string response_format = render_response_format(request);
  if (!tools.schemas.empty() || !response_format.empty()) {
    std::vector<Msg>& head = context.empty() ? messages : context;
    if (head.front().role != "system") {
      Msg system;
      system.role = "system";
      system.plain = !roles.system;
      head.insert(head.begin(), std::move(system));
    }
    // The schemas and the format are the request's text, as trusted as its system prompt.
    head.front().tool_schemas = tools.schemas;
    head.front().response_format = response_format;
    head.front().has_tools = !tools.schemas.empty();
  }
  result.tool_names = std::move(tools.names);

  // Context and new messages merge separately but are ordered, and judged for dropping, together.
  context = merge_user_turns(std::move(context));
  messages = merge_user_turns(std::move(messages));
  const size_t context_len = context.size();
  std::vector<Msg> full = std::move(context);
  for (Msg& m : messages) full.push_back(std::move(m));
  sort_tool_results(full);

  const bool drop = knobs.drop_thinking && std::none_of(full.begin(), full.end(), [](const Msg& m) { return m.has_tools; });
  const std::ptrdiff_t last_user = last_user_index(full);
  if (knobs.thinking && drop) {
    for (size_t i = 0; static_cast<std::ptrdiff_t>(i) < last_user; ++i) {
      if (full[i].role == "assistant") full[i].reasoning.clear();
    }
  }

  // Only a final assistant turn (continued, or a complete history) leaves reasoning closed.
  result.starts_in_reasoning = knobs.thinking && full.back().role != "assistant";
  PromptWriter out(result);
  if (options.add_bos && context_len == 0) out.markup(kBosToken);
  for (size_t i = context_len; i < full.size(); ++i) render_message(out, full, i, knobs, drop, last_user);
  return result;
}

}  // namespace dsv41
