// The DSML tool-call block as a grammar (text/json_grammar.h): what tool_choice "required" or a named
// function holds the output to, so the tool calls the server parses out of it always name an offered
// tool and carry arguments that fit its schema. The block's text is the encoder's (docs/
// chat-encoding.md §3.2): "\n\n<｜DSML｜ calls>\n", each invoke `<｜DSML｜ invoke name="NAME">\n`, its
// parameters `<｜DSML｜ parameter name="KEY" string="true|false">VALUE</｜DSML｜ parameter>` joined by
// "\n", then "\n</｜DSML｜ invoke>" (an invoke without parameters has an empty line), invokes joined by
// "\n", and "\n</｜DSML｜ calls>". A string parameter is written raw (string="true", its enum values
// as they are), any other as JSON (string="false"); a parameter whose schema allows both may be
// either.
#include <algorithm>
#include <string>
#include <vector>

#include "text/json_grammar.h"
#include "util/error.h"

namespace dsv41 {
namespace {

using json = nlohmann::json;
using Kind = GrammarNode::Kind;


// A Literals node of (text, tag) pairs, sorted with their tags.
int add_literals(Grammar& g, std::vector<std::pair<std::string, int>> texts) {
  std::sort(texts.begin(), texts.end());
  GrammarNode n;
  n.kind = Kind::Literals;
  for (auto& [text, tag] : texts) {
    n.literals.push_back(text);
    n.literal_tag.push_back(tag);
  }
  g.nodes.push_back(std::move(n));
  return static_cast<int>(g.nodes.size()) - 1;
}

// Whether a parameter's schema node allows a string (written raw) and anything else (written as JSON).
void value_forms(const Grammar& g, int node, bool& string, bool& other) {
  const GrammarNode& n = g.nodes[static_cast<size_t>(node)];
  switch (n.kind) {
    case Kind::Any:
      string = other = true;
      return;
    case Kind::String:
      string = true;
      return;
    case Kind::AnyOf:
      for (int o : n.options) value_forms(g, o, string, other);
      return;
    case Kind::Literals:
      for (const std::string& l : n.literals) (l.front() == '"' ? string : other) = true;
      return;
    default:
      other = true;
      return;
  }
}

// The raw texts of a string enum (its JSON literals decoded), or -1 when the strings are free.
int raw_choices(Grammar& g, int node) {
  const GrammarNode& n = g.nodes[static_cast<size_t>(node)];
  if (n.kind != Kind::Literals) return -1;
  std::vector<std::pair<std::string, int>> texts;
  for (const std::string& l : n.literals) {
    if (l.front() == '"') texts.emplace_back(json::parse(l).get<std::string>(), 0);
  }
  if (std::any_of(texts.begin(), texts.end(), [](const auto& t) { return t.first.empty(); })) {
    fail("tools", "an enum's empty string cannot be written as a raw DSML parameter");
  }
  return add_literals(g, std::move(texts));
}

}  // namespace

std::shared_ptr<const Grammar> tool_call_grammar(const json& tools, bool one_call) {
  if (!tools.is_array() || tools.empty()) fail("tools", "a tool call needs at least one tool");
  const std::string marker(1, kDsmlMarkerByte);
  auto g = std::make_shared<Grammar>();
  g->json = false;
  GrammarNode block;
  block.kind = Kind::DsmlCalls;
  block.one_call = one_call;
  std::vector<std::pair<std::string, int>> names;
  for (size_t t = 0; t < tools.size(); ++t) {
    const std::string where = "tools[" + std::to_string(t) + "].function";
    const json& fn = tools[t].contains("function") ? tools[t]["function"] : json();
    if (!fn.is_object() || !fn.contains("name") || !fn["name"].is_string()) fail(where + ".name", "must be a string");
    names.emplace_back(fn["name"].get<std::string>() + "\">\n", static_cast<int>(t));
    json parameters = fn.contains("parameters") ? fn["parameters"] : json::object();
    if (parameters.is_object() && !parameters.contains("type") && !parameters.contains("properties")) {
      parameters = json{{"type", "object"}, {"properties", json::object()}};
    }
    GrammarNode::Tool tool;
    tool.params = add_json_schema(*g, parameters, where + ".parameters");
    GrammarNode& params = g->nodes[static_cast<size_t>(tool.params)];
    if (params.kind != Kind::Object) fail(where + ".parameters", "must be an object schema");
    // the keys as DSML writes them: `KEY" string="true">` for the raw form, `KEY" string="false">`
    // for JSON; read back as (param index) in key_property, raw in tool.raw
    const std::vector<std::string> plain_keys = params.keys;  // `KEY"` (JSON-escaped) from the object
    const std::vector<int> key_params = params.key_property;
    std::vector<std::pair<std::string, std::pair<int, bool>>> keys;
    tool.raw_choices.assign(params.property_nodes.size(), -1);
    for (size_t k = 0; k < plain_keys.size(); ++k) {
      const int param = key_params[k];
      const int value = g->nodes[static_cast<size_t>(tool.params)].property_nodes[static_cast<size_t>(param)];
      const std::string name = json::parse("\"" + plain_keys[k]).get<std::string>();  // the raw name
      bool string = false, other = false;
      value_forms(*g, value, string, other);
      if (string) {
        keys.push_back({name + "\" string=\"true\">", {param, true}});
        tool.raw_choices[static_cast<size_t>(param)] = raw_choices(*g, value);
      }
      if (other) keys.push_back({name + "\" string=\"false\">", {param, false}});
    }
    std::sort(keys.begin(), keys.end());
    GrammarNode& p = g->nodes[static_cast<size_t>(tool.params)];
    p.keys.clear();
    p.key_property.clear();
    for (const auto& [text, info] : keys) {
      p.keys.push_back(text);
      p.key_property.push_back(info.first);
      tool.raw.push_back(info.second);
    }
    p.free_keys = false;
    block.tools.push_back(std::move(tool));
  }
  const std::string param_open = "<" + marker + " parameter name=\"", invoke_close = "\n</" + marker + " invoke>";
  block.lit_open = add_literals(*g, {{"\n\n<" + marker + " calls>\n", 0}});
  block.lit_invoke = add_literals(*g, {{"<" + marker + " invoke name=\"", 0}});
  block.lit_names = add_literals(*g, names);
  block.lit_after_name = add_literals(*g, {{param_open, 0}});
  block.lit_after_name_both = add_literals(*g, {{param_open, 0}, {invoke_close, 1}});
  block.lit_after_name_close = add_literals(*g, {{invoke_close, 1}});
  block.lit_param_close = add_literals(*g, {{"</" + marker + " parameter>", 0}});
  block.lit_after_param = add_literals(*g, {{"\n" + param_open, 0}});
  block.lit_after_param_both = add_literals(*g, {{"\n" + param_open, 0}, {invoke_close, 1}});
  block.lit_after_param_close = add_literals(*g, {{invoke_close, 1}});
  const std::string calls_close = "\n</" + marker + " calls>";
  block.lit_after_invoke = one_call ? add_literals(*g, {{calls_close, 1}})
                                    : add_literals(*g, {{"\n<" + marker + " invoke name=\"", 0}, {calls_close, 1}});
  g->nodes.push_back(std::move(block));
  g->root = static_cast<int>(g->nodes.size()) - 1;
  return g;
}

}  // namespace dsv41
