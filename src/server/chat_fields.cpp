#include "server/chat_fields.h"

#include <algorithm>
#include <string>
#include <vector>

#include "server/access_policy.h"
#include "server/api_error.h"

namespace dsv41::server {
namespace {

std::string at(const std::string& path, size_t i) { return path + "[" + std::to_string(i) + "]"; }

[[noreturn]] void refuse(const std::string& param, const std::string& rule) {
  throw invalid_request(param, param + " " + rule);
}

void check_content_parts(const ojson& message, const std::string& path) {
  const ojson* content = field(message, "content");
  if (content == nullptr || !content->is_array()) return;  // a string or null; other types: the encoder
  for (size_t k = 0; k < content->size(); ++k) {
    const ojson& part = (*content)[k];
    const std::string where = at(path + ".content", k);
    if (!part.is_object()) continue;  // the encoder names it
    const ojson* type = field(part, "type");
    if (type == nullptr || !type->is_string()) continue;
    const std::string& t = type->get_ref<const std::string&>();
    if (t == "text") {
      const ojson* text = field(part, "text");
      if (text == nullptr) refuse(where + ".text", "is required in a text part");
    } else if (t != "image_url" && t != "image") {
      refuse(where + ".type", "\"" + printable(t) + "\" is not supported (text, image_url, image)");
    }
  }
}

// An assistant message's call ids, after checking each call's id and arguments.
std::vector<std::string> check_tool_calls(const ojson& calls, const std::string& path) {
  std::vector<std::string> ids;
  if (!calls.is_array()) return ids;  // the encoder names it
  for (size_t j = 0; j < calls.size(); ++j) {
    const ojson& call = calls[j];
    const std::string where = at(path, j);
    if (!call.is_object()) continue;
    const ojson* id = field(call, "id");
    if (id == nullptr) refuse(where + ".id", "is required: a tool result names the call it answers by its id");
    if (!id->is_string() || id->get_ref<const std::string&>().empty()) {
      refuse(where + ".id", "must be a non-empty string, got " + (id->is_string() ? "\"\"" : kind(*id)));
    }
    const std::string& text = id->get_ref<const std::string&>();
    if (std::find(ids.begin(), ids.end(), text) != ids.end()) {
      refuse(where + ".id", "\"" + printable(text) + "\" is the id of an earlier call of this message");
    }
    ids.push_back(text);
    const ojson* function = field(call, "function");
    if (function == nullptr || !function->is_object()) continue;
    const auto arguments = function->find("arguments");  // absent: the encoder names it
    if (arguments != function->end() && !is_arguments_object(*arguments)) {
      refuse(where + ".function.arguments", "must be JSON text of an object (or an object), got " +
                                                (arguments->is_string() ? "text that is not" : kind(*arguments)));
    }
  }
  return ids;
}

// One list of messages; `pending` holds the call ids of the latest assistant message with calls.
void check_messages(const ojson& list, const char* name, std::vector<std::string>& pending) {
  if (!list.is_array()) return;
  for (size_t i = 0; i < list.size(); ++i) {
    const ojson& m = list[i];
    const std::string path = at(name, i);
    if (!m.is_object()) continue;
    const ojson* role = field(m, "role");
    const std::string r = role != nullptr && role->is_string() ? role->get<std::string>() : "";
    if (const ojson* n = field(m, "name"); n != nullptr && !n->is_string()) {
      refuse(path + ".name", "must be a string, got " + kind(*n));
    }
    check_content_parts(m, path);
    const ojson* calls = field(m, "tool_calls");
    if (calls != nullptr && r != "assistant") refuse(path + ".tool_calls", "are only carried by assistant messages");
    if (r == "assistant") pending = calls != nullptr ? check_tool_calls(*calls, path + ".tool_calls") : std::vector<std::string>{};
    // A tool message with no call before it at all is the encoder's to refuse.
    if (r == "tool" && !pending.empty()) {
      const ojson* id = field(m, "tool_call_id");
      if (id == nullptr) refuse(path + ".tool_call_id", "is required: it names the call this result answers");
      if (!id->is_string() || id->get_ref<const std::string&>().empty()) {
        refuse(path + ".tool_call_id", "must be a non-empty string, got " + (id->is_string() ? "\"\"" : kind(*id)));
      }
      const std::string& text = id->get_ref<const std::string&>();
      if (std::find(pending.begin(), pending.end(), text) == pending.end()) {
        refuse(path + ".tool_call_id", "\"" + printable(text) + "\" answers none of the calls of the assistant message before it");
      }
    }
  }
}

void check_tools(const ojson& body) {
  const ojson* tools = field(body, "tools");
  if (tools == nullptr || !tools->is_array()) return;
  for (size_t k = 0; k < tools->size(); ++k) {
    const ojson& tool = (*tools)[k];
    if (!tool.is_object()) continue;
    const ojson* function = field(tool, "function");
    if (function == nullptr || !function->is_object()) continue;
    const std::string where = at("tools", k) + ".function";
    if (const ojson* d = field(*function, "description"); d != nullptr && !d->is_string()) {
      refuse(where + ".description", "must be a string, got " + kind(*d));
    }
    if (const ojson* p = field(*function, "parameters"); p != nullptr && !p->is_object()) {
      refuse(where + ".parameters", "must be a JSON Schema object, got " + kind(*p));
    }
    if (const ojson* s = field(*function, "strict"); s != nullptr && !s->is_boolean()) {
      refuse(where + ".strict", "must be a boolean, got " + kind(*s));
    }
  }
  const ojson* choice = field(body, "tool_choice");
  if (choice != nullptr && choice->is_object()) {
    const ojson* type = field(*choice, "type");
    if (type != nullptr && *type != "function") refuse("tool_choice.type", "must be \"function\"");
  }
}

}  // namespace

bool is_arguments_object(const ojson& arguments) {
  ojson decoded = arguments;
  for (int round = 0; round < 2 && decoded.is_string(); ++round) {
    decoded = ojson::parse(decoded.get_ref<const std::string&>(), nullptr, /*allow_exceptions=*/false);
  }
  return decoded.is_object();
}

void check_chat_fields(const ojson& body) {
  std::vector<std::string> pending;
  if (const ojson* context = field(body, "context")) check_messages(*context, "context", pending);
  if (const ojson* messages = field(body, "messages")) check_messages(*messages, "messages", pending);
  check_tools(body);
}

}  // namespace dsv41::server
