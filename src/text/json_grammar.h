// Structured outputs: what a constrained request's output must be, as a byte-level recognizer the
// sampler consults at every step (text/grammar_mask.h turns it into the tokens allowed next).
//
// A Grammar is compiled from what a request asks for: any JSON object (`response_format:
// json_object`), a JSON Schema of the subset agents send (`json_schema`), one of a list of strings
// (vLLM's `structured_outputs.choice`), or a DSML tool-call block whose calls name offered tools and
// whose parameters fit their schemas (`tool_choice` required or named; docs/chat-encoding.md §3.2). The schema subset: `type` (a name or a list of them), `properties`,
// `required`, `additionalProperties` (false, true, or absent), `enum`, `const`, `items`, `minItems`,
// `maxItems`, `anyOf`, nested objects and arrays, string/number/integer/boolean/null, and the keywords
// that only annotate (`title`, `description`, `$schema`, `default`, `examples`); any other keyword is
// refused, naming it, so nothing a client asks for is silently ignored.
//
// A GrammarMatcher follows the output byte by byte. It is a set of parse stacks (an `anyOf` or an
// enum with a value that is a prefix of another forks one), each a stack of frames (an object being
// read, an array, a string, a number, a literal); it never backtracks, so feeding a byte costs a few
// frame operations. Whitespace between JSON tokens is what a pretty-printer writes: spaces, or one
// newline and an indent, at most kIndentPerLevel bytes per level of nesting and 2 more (no carriage
// return, no blank lines, tabs only to indent), so a weak model cannot spend its tokens padding;
// nothing may follow the value, and a number has at most kMaxNumberBytes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dsv41 {

constexpr int kIndentPerLevel = 4;
// The DSML marker (｜DSML｜, a special token) as the grammar reads it: a byte UTF-8 text never holds.
constexpr char kDsmlMarkerByte = '\xff';
constexpr int kMaxNumberBytes = 32;
constexpr int kMaxGrammarDepth = 64;  // nesting of a schema, and of the JSON a matcher reads

struct GrammarNode {
  enum class Kind : uint8_t { Any, Object, Array, String, Number, Integer, Boolean, Null, Literals, AnyOf, DsmlCalls };
  Kind kind = Kind::Any;
  // Object: its properties, which of them are required, and how a key reads: with properties, one
  // of `keys` (their JSON-escaped names and the closing quote, sorted, with the property each names);
  // without, any string, its value any JSON (`json_object`, `{"type": "object"}`).
  std::vector<int> property_nodes;
  std::vector<bool> required;
  std::vector<std::string> keys;
  std::vector<int> key_property;
  bool free_keys = true;  // no properties listed and others allowed
  // Array
  int items = -1;  // -1: any JSON
  int64_t min_items = 0, max_items = INT64_MAX;
  // Literals: the exact texts allowed, sorted (an enum's or const's values as JSON, or choice strings)
  std::vector<std::string> literals;
  // Literals: what each sorted text stands for, where the reader needs it (DSML's tags and names)
  std::vector<int> literal_tag;
  // AnyOf
  std::vector<int> options;
  // DsmlCalls: the tools that may be called (their parameters as an Object node's, each value read
  // raw when its schema is a string, as JSON otherwise), and the literal nodes of its fixed pieces
  struct Tool {
    int params = -1;              // an Object node: property_nodes, required, keys (`KEY" string="…">`)
    std::vector<bool> raw;        // per key (sorted order): string="true"
    std::vector<int> raw_choices; // per property: a Literals node of its raw enum values (-1: free text)
  };
  std::vector<Tool> tools;
  bool one_call = false;  // a named tool_choice: exactly one invoke
  // (what follows a name or a parameter: another parameter, the invoke's end, or either; after an
  // invoke: another or the block's end, only the end for one call)
  int lit_open = -1, lit_invoke = -1, lit_names = -1, lit_after_name = -1, lit_after_name_both = -1,
      lit_after_name_close = -1, lit_param_close = -1, lit_after_param = -1, lit_after_param_both = -1,
      lit_after_param_close = -1, lit_after_invoke = -1;
};

struct Grammar {
  std::vector<GrammarNode> nodes;
  int root = 0;
  bool json = true;  // false: raw text (a choice), with no whitespace around it
};

// Any JSON object (its values any JSON).
std::shared_ptr<const Grammar> json_object_grammar();
// What `schema` allows; Error naming the keyword (and its path) for what the subset does not cover.
std::shared_ptr<const Grammar> json_schema_grammar(const nlohmann::json& schema);
// Adds the nodes `schema` needs to `grammar` and returns its root node; Error naming the keyword (at
// `path`) for what the subset does not cover. (For grammars built of several schemas.)
int add_json_schema(Grammar& grammar, const nlohmann::json& schema, const std::string& path);

// Exactly one of `choices`, as raw text (not JSON). Error when the list is empty or holds an empty string.
std::shared_ptr<const Grammar> choice_grammar(const std::vector<std::string>& choices);
// "\n\n" and a DSML calls block (docs/chat-encoding.md §3.2) calling `tools` (OpenAI function tools,
// already filtered by tool_choice): one invoke when `one_call`, else one or more; each names one of
// the tools and gives its required parameters and no others, each parameter's value fitting its
// schema. Error naming the tool's field for a schema outside the subset.
std::shared_ptr<const Grammar> tool_call_grammar(const nlohmann::json& tools, bool one_call);

// What a UTF-8 lead byte starts: its continuation bytes (0: not a lead byte) and the range of the
// first of them; the others are 80-BF.
struct Utf8Lead {
  uint8_t continuations, lo, hi;
};
Utf8Lead utf8_lead(uint8_t byte);

class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const Grammar> grammar);

  // Feeds one byte; false (and the matcher unchanged) when the grammar does not allow it here.
  bool feed(uint8_t byte);
  // Feeds bytes one by one; false when one is refused (the matcher is then left after the bytes
  // accepted before it: use a copy to try).
  bool feed(const std::string& bytes);
  // True when the output read so far is a whole value: the end may come now.
  bool complete() const;
  // True when no byte can follow (a whole value that nothing may extend): only the end may come.
  bool finished() const;
  // The free text the matcher sits in, if any (every parse stack the same): a JSON string whose next
  // bytes are free (no enum, no key to match, no escape or character half read: any bytes but '"',
  // '\\' and controls keep it there), or a DSML parameter's raw text (any bytes but '<' and controls
  // other than newline and tab).
  enum class FreeText : uint8_t { None, JsonString, Raw };
  FreeText free_text() const;

 private:
  struct Frame {
    enum class Kind : uint8_t { Value, Object, Array, String, Number, Literal, Raw, Dsml, End };
    Kind kind = Kind::Value;
    uint8_t state = 0;      // where in its syntax the frame is (per kind, json_grammar.cpp)
    uint8_t utf8_left = 0;  // String: continuation bytes of a character still to come
    uint8_t hex_left = 0;   // String: hex digits of a \u escape still to come
    uint8_t utf8_lo = 0x80, utf8_hi = 0xBF;  // String: the range of the next continuation byte (RFC 3629)
    bool key = false;       // String or Literal: an object's key (the object frame is below)
    int node = -1;          // the grammar node read (-1: any JSON)
    int32_t lo = 0, hi = 0; // Literal: the candidates still possible, a range of the sorted texts
    int64_t count = 0;      // Array: items read; Literal: bytes matched; Object: the property being read (-1: a free key's)
    uint64_t seen = 0;      // Object: the properties read (objects of more than 64 properties are refused)
    bool operator==(const Frame&) const = default;
  };
  using Stack = std::vector<Frame>;

  // A text frame's byte as UTF-8 (RFC 3629): a continuation its character expects, or a lead byte
  // that starts a character (Taken); one that breaks a character (Refused); an ASCII byte, left to the
  // frame (Ascii).
  enum class Utf8Step : uint8_t { Ascii, Taken, Refused };
  static Utf8Step utf8_step(Frame& f, uint8_t byte);
  // Advances one stack by one byte into `out`: none when refused, several when an `anyOf` or a
  // literal that is a prefix of another forks it. `whitespace`: the byte is JSON whitespace.
  void advance(Stack stack, uint8_t byte, std::vector<Stack>& out) const;
  // The top frame's value is whole: pops it and moves the frame below on.
  void pop_value(Stack& stack) const;
  bool stack_complete(const Stack& stack) const;
  const std::vector<std::string>& literal_texts(const Frame& f) const;
  // A DSML block's next piece after the frame above it ended (`done`); the block frame is on top.
  void dsml_next(Stack& stack, const Frame& done) const;

  std::shared_ptr<const Grammar> grammar_;
  std::vector<Stack> stacks_, scratch_;
  int whitespace_run_ = 0;        // whitespace bytes since the last other byte (outside strings)
  bool whitespace_newline_ = false;  // one of them was a newline
};

}  // namespace dsv41
