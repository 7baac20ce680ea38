// Structured outputs' grammar (text/json_grammar.h) and its token masks (text/grammar_mask.h): what a
// schema lets through byte by byte, the keywords refused by name, and masks equal to trying every
// token of the DeepSeek vocabulary one by one; random walks through the masks write JSON that parses.
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/chat_output.h"
#include "text/grammar_mask.h"
#include "text/json_grammar.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "test_util.h"

namespace dsv41 {
namespace {

using json = nlohmann::json;

bool accepts(const std::shared_ptr<const Grammar>& g, const std::string& text) {
  GrammarMatcher m(g);
  return m.feed(text) && m.complete();
}

const json kPerson = json::parse(R"({
  "type": "object",
  "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer"},
    "role": {"enum": ["admin", "user", 3]},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2},
    "spouse": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"name": {"const": "x"}}, "required": ["name"], "additionalProperties": false}]},
    "score": {"type": ["number", "boolean"]}
  },
  "required": ["name", "age"],
  "additionalProperties": false
})");

TEST(JsonGrammar, ASchemaLetsThroughWhatValidatesAndNothingElse) {
  const auto g = json_schema_grammar(kPerson);
  for (const char* ok : {R"({"name":"Ann","age":3})",
                         R"({ "age" : -12 , "name" : "A\"\u00e9 é" })",
                         R"({"name":"","age":0,"role":"admin","tags":["a","b"],"spouse":null,"score":1.5e-3})",
                         R"({"name":"b","age":1,"role":3,"spouse":{"name":"x"},"score":true})"}) {
    EXPECT_TRUE(accepts(g, ok)) << ok;
  }
  for (const char* bad : {R"({"name":"Ann"})",                         // age is required
                          R"({"name":"Ann","age":3.5})",                // an integer
                          R"({"name":"Ann","age":3,"other":1})",        // no additional properties
                          R"({"name":"Ann","name":"B","age":3})",       // a key twice
                          R"({"name":"Ann","age":3,"role":"root"})",    // not in the enum
                          R"({"name":"Ann","age":3,"tags":[]})",        // minItems
                          R"({"name":"Ann","age":3,"tags":["a","b","c"]})",  // maxItems
                          R"({"name":"Ann","age":03})",                 // a leading zero
                          R"({"name":"A\q","age":3})",                  // a bad escape
                          "{\"name\":\"A\x01\",\"age\":3}",             // a control byte
                          "{\"name\":\"\xff\",\"age\":3}",              // not UTF-8
                          R"({"name":"Ann","age":3,"spouse":{"name":"y"}})",
                          R"({"name":"Ann","age":3} )",                 // nothing after the value
                          R"({"name":"Ann","age":3,})"}) {
    EXPECT_FALSE(accepts(g, bad)) << bad;
  }
}

TEST(JsonGrammar, CompleteFinishedAndFreeStrings) {
  GrammarMatcher m(json_schema_grammar(json::parse(R"({"type": "number"})")));
  EXPECT_TRUE(m.feed("12"));
  EXPECT_TRUE(m.complete());   // the number may end here
  EXPECT_FALSE(m.finished());  // or go on
  EXPECT_TRUE(m.feed(".5"));
  EXPECT_FALSE(m.feed('x'));

  GrammarMatcher o(json_object_grammar());
  EXPECT_FALSE(o.feed('['));  // json_object: an object at the top
  EXPECT_TRUE(o.feed("{\"k"));
  EXPECT_EQ(o.free_text(), GrammarMatcher::FreeText::JsonString);
  EXPECT_TRUE(o.feed("\": [1, {\"a\": null}, \"s\", true]}"));
  EXPECT_TRUE(o.finished());
  EXPECT_FALSE(o.feed(' '));

  GrammarMatcher raw(choice_grammar({"no"}));
  EXPECT_FALSE(raw.feed(' '));  // a choice is the text itself, no whitespace around it
  GrammarMatcher c(choice_grammar({"yes", "no", "yes please"}));
  EXPECT_TRUE(c.feed("yes"));
  EXPECT_TRUE(c.complete());
  EXPECT_FALSE(c.finished());  // "yes please" is still possible
  EXPECT_TRUE(c.feed(" please"));
  EXPECT_TRUE(c.finished());

  // whitespace between tokens is a pretty-printer's: bounded, one newline, tabs only to indent
  GrammarMatcher w(json_object_grammar());
  EXPECT_TRUE(w.feed("\n "));  // at the top: 2 bytes
  EXPECT_FALSE(w.feed(' '));
  EXPECT_TRUE(w.feed("{\n\t\"a\": [\n        1,\n        2\n    ]\n}"));  // 4 per level
  GrammarMatcher deep(json_object_grammar());
  EXPECT_FALSE(deep.feed("{\n" + std::string(kIndentPerLevel + 2, ' ')));
  for (const char* bad : {"{\n\n\"a\": 1}", "{\r\n\"a\": 1}", "{\t\"a\": 1}"}) {
    GrammarMatcher b(json_object_grammar());
    EXPECT_FALSE(b.feed(bad)) << bad;
  }
}

TEST(JsonGrammar, UnsupportedKeywordsAreRefusedByName) {
  for (const auto& [schema, expect] : std::vector<std::pair<const char*, const char*>>{
           {R"({"type": "string", "pattern": "a+"})", "schema.pattern: the keyword \"pattern\" is not supported"},
           {R"({"properties": {"a": {"type": "string", "format": "date"}}})", "schema.properties.a.format"},
           {R"({"type": "object", "additionalProperties": {"type": "string"}})", "only true or false"},
           {R"({"type": "tuple"})", "\"tuple\" is not a JSON Schema type"},
           {R"({"type": "object", "properties": {"a": {}}, "required": ["b"]})", "which properties does not list"},
           {R"({"type": "array", "minItems": 3, "maxItems": 1})", "above maxItems"},
           {R"({"enum": []})", "must be a non-empty array"},
           {R"({"type": "string", "anyOf": [{"type": "null"}]})", "beside anyOf"},
           {R"(false)", "allows nothing"}}) {
    try {
      json_schema_grammar(json::parse(schema));
      ADD_FAILURE() << schema << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << schema << ": " << e.what();
    }
  }
  EXPECT_THROW(choice_grammar({}), Error);
  EXPECT_THROW(choice_grammar({"a", ""}), Error);
}

// The released model's vocabulary (the DeepSeek V3 tokenizer the npm reference ships), else the
// tiny model's: which the tests use is said in the output.
const Tokenizer& vocabulary_tokenizer(std::string* which) {
  static const char* path = std::getenv("DSV41_DEEPSEEK_TOKENIZER");
  static const Tokenizer tok = Tokenizer::from_file(path != nullptr && *path ? path : test::source_dir() + "/models/brown-tiny/tokenizer.json");
  *which = path != nullptr && *path ? "DeepSeek V3" : "brown-tiny";
  return tok;
}

// `text` with bytes outside printable ASCII as \xNN.
std::string printable(const std::string& text) {
  std::string out;
  for (const char c : text) {
    const auto b = static_cast<uint8_t>(c);
    char hex[8];
    std::snprintf(hex, sizeof hex, "\\x%02x", b);
    out += b >= 0x20 && b < 0x7f ? std::string(1, c) : std::string(hex);
  }
  return out;
}

// The tokens allowed by trying each one alone.
std::vector<uint64_t> brute_force(const GrammarVocabulary& v, const GrammarMatcher& m, int32_t end) {
  std::vector<uint64_t> bits((static_cast<size_t>(v.vocab()) + 63) / 64, 0);
  for (int32_t id = 0; id < v.vocab(); ++id) {
    GrammarMatcher c = m;
    const bool ok = id == end ? m.complete() : !v.bytes(id).empty() && c.feed(v.bytes(id));
    if (ok) bits[static_cast<size_t>(id) >> 6] |= uint64_t{1} << (id & 63);
  }
  return bits;
}

// Random walks through the masks: every step's mask equals the brute force, and each walk that ends
// writes JSON that parses and fits the schema's shape.
// `text` with every well-formed number outside strings written as 0. RFC 8259 gives a number no range and the
// grammar follows it, while nlohmann::json refuses one past a double's (error 406, "number
// overflow"): a random walk writes such numbers (8675e5155490327874728131414), so the walks' JSON is
// checked with each well-formed number as 0.
std::string numbers_as_zero(const std::string& text) {
  std::string out;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      in_string = escaped || c != '"';
      escaped = !escaped && c == '\\';
      out += c;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      const size_t start = i;
      while (i + 1 < text.size() && std::string_view("+-.0123456789eE").find(text[i + 1]) != std::string_view::npos) ++i;
      const std::string number = text.substr(start, i + 1 - start);
      static const std::regex rfc_number(R"(-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?)");
      out += std::regex_match(number, rfc_number) ? "0" : number;  // a malformed one stays, to fail the parse
    } else {
      in_string = c == '"';
      out += c;
    }
  }
  return out;
}

TEST(GrammarMask, MasksEqualTryingEveryTokenAndWalksWriteJson) {
  std::string which;
  const Tokenizer& tok = vocabulary_tokenizer(&which);
  const GrammarVocabulary v(tok, tok.vocab_size());
  int32_t end = 0;  // a special token stands for the end of the sentence (a grammar never allows one)
  while (end < tok.vocab_size() && !tok.is_special(end)) ++end;
  ASSERT_LT(end, tok.vocab_size());
  std::printf("[ vocabulary ] %s, %d tokens\n", which.c_str(), v.vocab());
  std::mt19937 rng(7);
  // Under the sanitizers two walks per grammar: each step over the 128K-token vocabulary is their
  // slowest loop, and two walks reach every kind of state the six do.
  const int walks = test::kSanitized ? 2 : 6;
  int finished = 0;
  for (const auto& g : {json_schema_grammar(kPerson), json_object_grammar()}) {
    for (int walk = 0; walk < walks; ++walk) {
      GrammarMatcher m(g);
      std::string text;
      std::vector<uint64_t> mask;
      for (int step = 0; step < 200; ++step) {
        v.allowed(m, end, mask);
        if (step % 40 == 0) {
          ASSERT_EQ(mask, brute_force(v, m, end)) << "after " << text;
        }
        std::vector<int32_t> ids;
        for (int32_t id = 0; id < v.vocab(); ++id) {
          if (mask[static_cast<size_t>(id) >> 6] >> (id & 63) & 1) ids.push_back(id);
        }
        ASSERT_FALSE(ids.empty()) << "a dead end after " << text;
        // the end when allowed (half the time), else a random allowed token, a one-byte one three
        // times in four (the quotes and brackets that close what is open), so walks end
        std::vector<int32_t> bytes;
        for (int32_t id : ids) {
          if (id != end && v.bytes(id).size() == 1) bytes.push_back(id);
        }
        const bool one_byte = !bytes.empty() && rng() % 4 != 0;
        const int32_t id = m.complete() && rng() % 2 ? end : one_byte ? bytes[rng() % bytes.size()] : ids[rng() % ids.size()];
        if (id == end) break;
        ASSERT_TRUE(m.feed(v.bytes(id)));
        text += v.bytes(id);
      }
      if (!m.complete()) continue;
      std::printf("[ walk ] %d ends after %zu bytes\n", walk, text.size());
      ++finished;
      const json parsed = json::parse(numbers_as_zero(text), nullptr, false);
      ASSERT_FALSE(parsed.is_discarded()) << printable(text);
      EXPECT_TRUE(parsed.is_object()) << text;
    }
  }
  std::printf("[ walks ] %d of %d ended within 200 tokens, all JSON\n", finished, 2 * walks);
  EXPECT_GE(finished, walks * 2 / 3);
}

const json kTools = json::parse(R"([
  {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "lines": {"type": "integer"}, "mode": {"enum": ["text", "hex"]},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}, "required": ["path"]}}},
  {"type": "function", "function": {"name": "list", "parameters": {"type": "object", "properties": {}}}}])");

// DSML text as the grammar reads it: the marker token as its byte.
std::string marked(std::string text) {
  for (size_t at; (at = text.find("｜DSML｜")) != std::string::npos;) text.replace(at, std::string("｜DSML｜").size(), 1, kDsmlMarkerByte);
  return text;
}

TEST(ToolCallGrammar, ABlockCallsOfferedToolsWithParametersThatFit) {
  const auto g = tool_call_grammar(kTools, false);
  const std::string ok = marked(
      "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"read_file\">\n"
      "<｜DSML｜ parameter name=\"path\" string=\"true\">a \"b\" <c></d>\n</｜DSML｜ parameter>\n"
      "<｜DSML｜ parameter name=\"lines\" string=\"false\">12</｜DSML｜ parameter>\n"
      "<｜DSML｜ parameter name=\"mode\" string=\"true\">hex</｜DSML｜ parameter>\n"
      "<｜DSML｜ parameter name=\"note\" string=\"false\">null</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n"
      "<｜DSML｜ invoke name=\"list\">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>");
  EXPECT_TRUE(accepts(g, ok));
  GrammarMatcher whole(g);
  ASSERT_TRUE(whole.feed(ok));
  EXPECT_TRUE(whole.finished());
  const std::string path = marked("\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"read_file\">\n<｜DSML｜ parameter name=\"path\" string=\"true\">x</｜DSML｜ parameter>");
  const std::string end = marked("\n</｜DSML｜ invoke>\n</｜DSML｜ calls>");
  EXPECT_TRUE(accepts(g, path + end));
  for (const std::string& bad : {
           marked("\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"delete\">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>"),  // not offered
           marked("\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"read_file\">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>"),  // path is required
           path + marked("\n<｜DSML｜ parameter name=\"lines\" string=\"true\">12</｜DSML｜ parameter>") + end,  // an integer is JSON
           path + marked("\n<｜DSML｜ parameter name=\"lines\" string=\"false\">1.5</｜DSML｜ parameter>") + end,
           path + marked("\n<｜DSML｜ parameter name=\"mode\" string=\"true\">bin</｜DSML｜ parameter>") + end,  // not in the enum
           path + marked("\n<｜DSML｜ parameter name=\"path\" string=\"true\">y</｜DSML｜ parameter>") + end,  // twice
           path + marked("\n<｜DSML｜ parameter name=\"other\" string=\"true\">y</｜DSML｜ parameter>") + end,  // not a parameter
           marked("\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"read_file\">\n<｜DSML｜ parameter name=\"path\" string=\"true\">a<｜DSML｜ </｜DSML｜ parameter>") + end}) {
    EXPECT_FALSE(accepts(g, bad)) << bad;
  }
  const auto one = tool_call_grammar(kTools, true);  // a named tool_choice: one call
  EXPECT_TRUE(accepts(one, path + end));
  EXPECT_FALSE(accepts(one, path + marked("\n</｜DSML｜ invoke>\n<｜DSML｜ invoke name=\"list\">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>")));
  EXPECT_THROW(tool_call_grammar(json::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string", "format": "uri"}}}}}])"), false), Error);
}

// Walks through the tool-call masks on brown-tiny's vocabulary (which has the ｜DSML｜ token): every
// step's mask is the brute force's, and what a finished walk wrote parses as tool calls of offered
// tools whose arguments are JSON objects with the required parameter.
TEST(ToolCallGrammar, MasksEqualTryingEveryTokenAndWalksParseAsToolCalls) {
  const Tokenizer tok = Tokenizer::from_file(test::source_dir() + "/models/brown-tiny/tokenizer.json");
  const std::optional<int32_t> dsml = tok.token_id("｜DSML｜");
  ASSERT_TRUE(dsml.has_value());
  const GrammarVocabulary v(tok, tok.vocab_size(), {{*dsml, std::string(1, kDsmlMarkerByte)}});
  int32_t end = 0;
  while (end < tok.vocab_size() && (!tok.is_special(end) || end == *dsml)) ++end;
  const auto g = tool_call_grammar(kTools, false);
  std::mt19937 rng(11);
  int finished = 0;
  for (int walk = 0; walk < 10; ++walk) {
    GrammarMatcher m(g);
    std::vector<int32_t> ids;
    std::vector<uint64_t> mask;
    for (int step = 0; step < 300 && !m.finished(); ++step) {
      v.allowed(m, end, mask);
      if (step % 25 == 0) {
        ASSERT_EQ(mask, brute_force(v, m, end)) << "step " << step;
      }
      std::vector<int32_t> options, short_ones;
      for (int32_t id = 0; id < v.vocab(); ++id) {
        if (id != end && mask[static_cast<size_t>(id) >> 6] >> (id & 63) & 1) {
          options.push_back(id);
          if (v.bytes(id).size() == 1 || id == *dsml) short_ones.push_back(id);
        }
      }
      ASSERT_FALSE(options.empty());
      const int32_t id = !short_ones.empty() && rng() % 4 != 0 ? short_ones[rng() % short_ones.size()] : options[rng() % options.size()];
      ASSERT_TRUE(m.feed(v.bytes(id)));
      ids.push_back(id);
    }
    if (!m.finished()) continue;
    ++finished;
    ChatOutputOptions o;
    o.thinking = false;
    o.tools = {"read_file", "list"};
    const ChatOutput out = parse_chat_output(tok.decode(ids), o);
    ASSERT_FALSE(out.tool_calls.empty()) << tok.decode(ids);
    EXPECT_TRUE(out.content.empty()) << out.content;
    for (const ToolCall& call : out.tool_calls) {
      const json args = json::parse(call.arguments, nullptr, false);
      ASSERT_TRUE(args.is_object()) << call.arguments;
      if (call.name == "read_file") {
        EXPECT_TRUE(args.contains("path") && args["path"].is_string()) << call.arguments;
      } else {
        EXPECT_EQ(call.name, "list");
        EXPECT_TRUE(args.empty()) << call.arguments;
      }
    }
  }
  std::printf("[ walks ] %d of 10 tool-call blocks finished within 300 tokens, all parsed as calls\n", finished);
  EXPECT_GE(finished, 3);
}

}  // namespace
}  // namespace dsv41
