// JSON Schema (the subset structured outputs read), json_object and choice lists compiled into
// grammar nodes (text/json_grammar.h). Anything the subset does not read is refused by name.
#include <algorithm>
#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "text/json_grammar.h"
#include "util/error.h"

namespace dsv41 {
namespace {

using json = nlohmann::json;
using Kind = GrammarNode::Kind;

constexpr size_t kMaxProperties = 64;

// The keywords the subset reads, and those that only annotate. (Constants without destructors: the
// server's threads compile schemas until the process ends.)
constexpr std::array<std::string_view, 15> kKnownKeywords = {
    "type",  "properties", "required",    "additionalProperties", "enum",    "const",   "items",   "minItems",
    "maxItems", "anyOf",   "title",       "description",          "$schema", "default", "examples"};

bool known_keyword(std::string_view key) {
  return std::find(kKnownKeywords.begin(), kKnownKeywords.end(), key) != kKnownKeywords.end();
}

class SchemaCompiler {
 public:
  explicit SchemaCompiler(Grammar& g) : g_(g) {}

  int compile(const json& s, const std::string& path, int depth) {
    if (depth > kMaxGrammarDepth) fail(path, "nests deeper than " + std::to_string(kMaxGrammarDepth) + " levels");
    if (s.is_boolean()) {
      if (!s.get<bool>()) fail(path, "the schema false allows nothing");
      return add({});
    }
    if (!s.is_object()) fail(path, "a schema must be an object or a boolean");
    for (const auto& [key, value] : s.items()) {
      if (!known_keyword(key)) fail(path + "." + key, "the keyword \"" + key + "\" is not supported here");
    }
    if (s.contains("enum") || s.contains("const")) {
      GrammarNode n;
      n.kind = Kind::Literals;
      if (s.contains("const")) n.literals.push_back(s["const"].dump());
      if (s.contains("enum")) {
        const json& e = s["enum"];
        if (!e.is_array() || e.empty()) fail(path + ".enum", "must be a non-empty array");
        for (const json& v : e) n.literals.push_back(v.dump());
      }
      if (s.contains("const") && s.contains("enum")) {
        if (std::find(n.literals.begin() + 1, n.literals.end(), n.literals[0]) == n.literals.end()) {
          fail(path, "const is not among the enum's values: nothing is allowed");
        }
        n.literals.resize(1);
      }
      return add(sorted(std::move(n)));
    }
    if (s.contains("anyOf")) {
      const json& any = s["anyOf"];
      if (!any.is_array() || any.empty()) fail(path + ".anyOf", "must be a non-empty array");
      for (const auto& [key, value] : s.items()) {
        if (key == "type" || key == "properties" || key == "required" || key == "additionalProperties" ||
            key == "items" || key == "minItems" || key == "maxItems") {
          fail(path + "." + key, "the keyword \"" + key + "\" beside anyOf is not supported: put it in each option");
        }
      }
      GrammarNode n;
      n.kind = Kind::AnyOf;
      for (size_t i = 0; i < any.size(); ++i) {
        n.options.push_back(compile(any[i], path + ".anyOf[" + std::to_string(i) + "]", depth + 1));
      }
      return add(std::move(n));
    }
    if (s.contains("type")) {
      const json& t = s["type"];
      if (t.is_string()) return typed(s, t.get<std::string>(), path, depth);
      if (!t.is_array() || t.empty()) fail(path + ".type", "must be a type name or a non-empty array of them");
      GrammarNode n;
      n.kind = Kind::AnyOf;
      for (const json& one : t) {
        if (!one.is_string()) fail(path + ".type", "must hold type names");
        n.options.push_back(typed(s, one.get<std::string>(), path, depth));
      }
      return add(std::move(n));
    }
    if (s.contains("properties") || s.contains("required") || s.contains("additionalProperties")) {
      return typed(s, "object", path, depth);
    }
    if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) return typed(s, "array", path, depth);
    return add({});  // no constraint: any JSON
  }

 private:
  int add(GrammarNode n) {
    g_.nodes.push_back(std::move(n));
    return static_cast<int>(g_.nodes.size()) - 1;
  }

  static GrammarNode sorted(GrammarNode n) {
    std::sort(n.literals.begin(), n.literals.end());
    n.literals.erase(std::unique(n.literals.begin(), n.literals.end()), n.literals.end());
    return n;
  }

  static int64_t count_of(const json& s, const char* key, const std::string& path) {
    const json& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0) fail(path + "." + key, "must be a non-negative integer");
    return v.get<int64_t>();
  }

  int typed(const json& s, const std::string& type, const std::string& path, int depth) {
    GrammarNode n;
    if (type == "object") {
      n.kind = Kind::Object;
      bool additional = true;
      if (s.contains("additionalProperties")) {
        const json& a = s["additionalProperties"];
        if (!a.is_boolean()) fail(path + ".additionalProperties", "only true or false is supported, not a schema");
        additional = a.get<bool>();
      }
      std::vector<std::string> names;
      if (s.contains("properties")) {
        const json& props = s["properties"];
        if (!props.is_object()) fail(path + ".properties", "must be an object");
        if (props.size() > kMaxProperties) {
          fail(path + ".properties", "lists more than " + std::to_string(kMaxProperties) + " properties");
        }
        for (const auto& [name, sub] : props.items()) {
          names.push_back(name);
          n.property_nodes.push_back(compile(sub, path + ".properties." + name, depth + 1));
        }
      }
      n.required.assign(names.size(), false);
      if (s.contains("required")) {
        const json& req = s["required"];
        if (!req.is_array()) fail(path + ".required", "must be an array of property names");
        for (const json& r : req) {
          const auto at = r.is_string() ? std::find(names.begin(), names.end(), r.get<std::string>()) : names.end();
          if (at == names.end()) fail(path + ".required", "names " + r.dump() + ", which properties does not list");
          n.required[static_cast<size_t>(at - names.begin())] = true;
        }
      }
      // With properties listed, a key is one of them: additional keys are allowed by such a schema
      // but never written, since a key read freely that named a property would escape its schema.
      n.free_keys = names.empty() && additional;
      std::vector<std::pair<std::string, int>> keys;
      for (size_t i = 0; i < names.size(); ++i) keys.emplace_back(json(names[i]).dump().substr(1), static_cast<int>(i));
      std::sort(keys.begin(), keys.end());
      for (auto& [text, prop] : keys) {
        n.keys.push_back(text);
        n.key_property.push_back(prop);
      }
    } else if (type == "array") {
      n.kind = Kind::Array;
      if (s.contains("items")) {
        if (s["items"].is_array()) fail(path + ".items", "a list of item schemas (a tuple) is not supported");
        n.items = compile(s["items"], path + ".items", depth + 1);
      }
      if (s.contains("minItems")) n.min_items = count_of(s, "minItems", path);
      if (s.contains("maxItems")) n.max_items = count_of(s, "maxItems", path);
      if (n.min_items > n.max_items) fail(path + ".minItems", "is above maxItems: nothing is allowed");
    } else if (type == "string") {
      n.kind = Kind::String;
    } else if (type == "number") {
      n.kind = Kind::Number;
    } else if (type == "integer") {
      n.kind = Kind::Integer;
    } else if (type == "boolean") {
      n.kind = Kind::Boolean;
    } else if (type == "null") {
      n.kind = Kind::Null;
    } else {
      fail(path + ".type", "\"" + type + "\" is not a JSON Schema type");
    }
    return add(std::move(n));
  }

  Grammar& g_;
};

}  // namespace

std::shared_ptr<const Grammar> json_object_grammar() {
  auto g = std::make_shared<Grammar>();
  GrammarNode n;
  n.kind = Kind::Object;
  g->nodes.push_back(n);
  return g;
}

int add_json_schema(Grammar& grammar, const json& schema, const std::string& path) {
  return SchemaCompiler(grammar).compile(schema, path, 0);
}

std::shared_ptr<const Grammar> json_schema_grammar(const json& schema) {
  auto g = std::make_shared<Grammar>();
  g->root = add_json_schema(*g, schema, "schema");
  return g;
}

std::shared_ptr<const Grammar> choice_grammar(const std::vector<std::string>& choices) {
  if (choices.empty()) fail("choice", "must list at least one string");
  GrammarNode n;
  n.kind = Kind::Literals;
  for (const std::string& c : choices) {
    if (c.empty()) fail("choice", "must not hold an empty string");
    n.literals.push_back(c);
  }
  std::sort(n.literals.begin(), n.literals.end());
  n.literals.erase(std::unique(n.literals.begin(), n.literals.end()), n.literals.end());
  auto g = std::make_shared<Grammar>();
  g->nodes.push_back(std::move(n));
  g->json = false;
  return g;
}

}  // namespace dsv41
