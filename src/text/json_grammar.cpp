#include "text/json_grammar.h"

#include <algorithm>
#include <string_view>
#include <tuple>

namespace dsv41 {
namespace {

using Kind = GrammarNode::Kind;

constexpr size_t kMaxStacks = 64;    // parse stacks at once; more (a pathological anyOf) refuse the byte

// The literal texts of JSON's own values. Made once and never destroyed: a scheduler thread may
// still read them while the process destroys its statics at exit.
const std::vector<std::string>& any_literals() {
  static const auto* texts = new std::vector<std::string>{"false", "null", "true"};
  return *texts;
}
const std::vector<std::string>& boolean_literals() {
  static const auto* texts = new std::vector<std::string>{"false", "true"};
  return *texts;
}
const std::vector<std::string>& null_literals() {
  static const auto* texts = new std::vector<std::string>{"null"};
  return *texts;
}

bool is_whitespace(uint8_t b) { return b == ' ' || b == '\n' || b == '\t' || b == '\r'; }
bool is_digit(uint8_t b) { return b >= '0' && b <= '9'; }
bool is_hex(uint8_t b) { return is_digit(b) || (b >= 'a' && b <= 'f') || (b >= 'A' && b <= 'F'); }

}  // namespace

Utf8Lead utf8_lead(uint8_t b) {
  // RFC 3629: no overlong forms (C0, C1, E0 80-9F, F0 80-8F), no surrogates (ED A0-BF), nothing past
  // U+10FFFF (F4 90-BF, F5-FF)
  if (b >= 0xC2 && b <= 0xDF) return {1, 0x80, 0xBF};
  if (b == 0xE0) return {2, 0xA0, 0xBF};
  if (b == 0xED) return {2, 0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return {2, 0x80, 0xBF};
  if (b == 0xF0) return {3, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {3, 0x80, 0xBF};
  if (b == 0xF4) return {3, 0x80, 0x8F};
  return {0, 0, 0};
}

// ---- the matcher ------------------------------------------------------------------------------
//
// Frame states. Object: 0 after '{', 1 reading a key (its frame above), 2 after the key, 3 reading
// the value (its frame above), 4 after the value, 5 after ','. Array: 0 after '[', 1 reading an item,
// 2 after an item, 3 after ','. String: 0 in text, 1 after '\'. Number: 0 start, 1 after '-', 2 a
// leading 0, 3 integer digits, 4 after '.', 5 fraction digits, 6 after 'e', 7 after its sign,
// 8 exponent digits; 2, 3, 5 and 8 may end it.

GrammarMatcher::GrammarMatcher(std::shared_ptr<const Grammar> grammar) : grammar_(std::move(grammar)) {
  Frame root;
  root.kind = Frame::Kind::Value;
  root.node = grammar_->root;
  stacks_.push_back({root});
}

const std::vector<std::string>& GrammarMatcher::literal_texts(const Frame& f) const {
  if (f.node < 0) return any_literals();
  const GrammarNode& n = grammar_->nodes[static_cast<size_t>(f.node)];
  if (f.key) return n.keys;
  if (n.kind == Kind::Boolean) return boolean_literals();
  if (n.kind == Kind::Null) return null_literals();
  return n.literals;
}

namespace {
bool number_may_end(uint8_t state) { return state == 2 || state == 3 || state == 5 || state == 8; }
}  // namespace

void GrammarMatcher::pop_value(Stack& stack) const {
  const Frame done = stack.back();
  stack.pop_back();
  if (stack.empty()) {
    Frame end;
    end.kind = Frame::Kind::End;
    stack.push_back(end);
    return;
  }
  Frame& p = stack.back();
  if (p.kind == Frame::Kind::Object) {
    if (p.state == 1) {
      p.state = 2;
      p.count = done.kind == Frame::Kind::Literal
                    ? grammar_->nodes[static_cast<size_t>(p.node)].key_property[static_cast<size_t>(done.lo)]
                    : -1;
    } else {
      p.state = 4;
      if (p.count >= 0) p.seen |= uint64_t{1} << p.count;
    }
  } else if (p.kind == Frame::Kind::Array) {
    p.state = 2;
    ++p.count;
  } else if (p.kind == Frame::Kind::Dsml) {
    dsml_next(stack, done);
  }
}

// The DSML block's states (Dsml frame): 1 its opening read, 2 `<M invoke name="` read, 3 a tool's
// name, 4 what follows the name (a parameter or the invoke's end), 5 a parameter's key, 6 its value,
// 7 `</M parameter>`, 8 what follows a parameter, 9 what follows an invoke. count: the tool being
// called; seen: its parameters given; lo: invokes made; hi: the parameter being read (+1 when raw).
void GrammarMatcher::dsml_next(Stack& stack, const Frame& done) const {
  Frame& d = stack.back();
  const GrammarNode& block = grammar_->nodes[static_cast<size_t>(d.node)];
  const auto push_literal = [&](int node, uint8_t next_state) {
    d.state = next_state;
    Frame lit;
    lit.kind = Frame::Kind::Literal;
    lit.node = node;
    lit.hi = static_cast<int32_t>(grammar_->nodes[static_cast<size_t>(node)].literals.size());
    stack.push_back(lit);
  };
  const auto tag = [&]() {
    return grammar_->nodes[static_cast<size_t>(done.node)].literal_tag[static_cast<size_t>(done.lo)];
  };
  const auto push_key = [&] {
    d.state = 5;
    Frame key;
    key.kind = Frame::Kind::Literal;
    key.key = true;
    key.node = block.tools[static_cast<size_t>(d.count)].params;
    key.hi = static_cast<int32_t>(grammar_->nodes[static_cast<size_t>(key.node)].keys.size());
    stack.push_back(key);
  };
  const auto invoke_done = [&] {
    ++d.lo;
    push_literal(block.lit_after_invoke, 9);
  };
  const auto param_done = [&] {
    const GrammarNode& params = grammar_->nodes[static_cast<size_t>(block.tools[static_cast<size_t>(d.count)].params)];
    const int param = d.hi >> 1;
    d.seen |= uint64_t{1} << param;
    bool required_left = false, open_left = false;
    for (size_t i = 0; i < params.property_nodes.size(); ++i) {
      required_left |= params.required[i] && !(d.seen >> i & 1);
      open_left |= !(d.seen >> i & 1);
    }
    push_literal(required_left ? block.lit_after_param : open_left ? block.lit_after_param_both : block.lit_after_param_close, 8);
  };
  switch (d.state) {
    case 1:
      push_literal(block.lit_invoke, 2);
      return;
    case 2:
      push_literal(block.lit_names, 3);
      return;
    case 3: {  // the tool's name (and `">\n`)
      d.count = tag();
      d.seen = 0;
      const GrammarNode& params = grammar_->nodes[static_cast<size_t>(block.tools[static_cast<size_t>(d.count)].params)];
      const bool required = std::find(params.required.begin(), params.required.end(), true) != params.required.end();
      push_literal(params.property_nodes.empty() ? block.lit_after_name_close
                   : required                    ? block.lit_after_name
                                                 : block.lit_after_name_both,
                   4);
      return;
    }
    case 4:
    case 8:  // tag 0: a parameter's key follows; tag 1: the invoke ended
      if (tag() == 0) {
        push_key();
      } else {
        invoke_done();
      }
      return;
    case 5: {  // the key (and its string attribute): the value follows
      const GrammarNode::Tool& tool = block.tools[static_cast<size_t>(d.count)];
      const GrammarNode& params = grammar_->nodes[static_cast<size_t>(tool.params)];
      const int param = params.key_property[static_cast<size_t>(done.lo)];
      const bool raw = tool.raw[static_cast<size_t>(done.lo)];
      d.hi = param << 1 | (raw ? 1 : 0);
      d.state = 6;
      Frame value;
      if (raw && tool.raw_choices[static_cast<size_t>(param)] >= 0) {
        value.kind = Frame::Kind::Literal;
        value.node = tool.raw_choices[static_cast<size_t>(param)];
        value.hi = static_cast<int32_t>(grammar_->nodes[static_cast<size_t>(value.node)].literals.size());
      } else if (raw) {
        value.kind = Frame::Kind::Raw;
      } else {
        value.node = params.property_nodes[static_cast<size_t>(param)];
      }
      stack.push_back(value);
      return;
    }
    case 6:  // the value: a raw text ends with its closing tag, the others are followed by it
      if (done.kind == Frame::Kind::Raw) {
        param_done();
      } else {
        push_literal(block.lit_param_close, 7);
      }
      return;
    case 7:
      param_done();
      return;
    case 9:  // tag 0: another invoke; tag 1: the block ended
      if (tag() == 0) {
        push_literal(block.lit_names, 3);
      } else {
        pop_value(stack);
      }
      return;
    default:
      return;
  }
}

GrammarMatcher::Utf8Step GrammarMatcher::utf8_step(Frame& f, uint8_t b) {
  if (f.utf8_left > 0) {
    if (b < f.utf8_lo || b > f.utf8_hi) return Utf8Step::Refused;
    --f.utf8_left;
    f.utf8_lo = 0x80;
    f.utf8_hi = 0xBF;
    return Utf8Step::Taken;
  }
  if (b < 0x80) return Utf8Step::Ascii;
  const Utf8Lead lead = utf8_lead(b);
  if (lead.continuations == 0) return Utf8Step::Refused;
  f.utf8_left = lead.continuations;
  f.utf8_lo = lead.lo;
  f.utf8_hi = lead.hi;
  return Utf8Step::Taken;
}

void GrammarMatcher::advance(Stack stack, uint8_t b, std::vector<Stack>& out) const {
  if (stack.size() > static_cast<size_t>(kMaxGrammarDepth)) return;
  Frame& f = stack.back();
  const GrammarNode* node = f.node >= 0 ? &grammar_->nodes[static_cast<size_t>(f.node)] : nullptr;
  const auto push = [&](Frame frame) {
    stack.push_back(frame);
    return &stack.back();
  };
  switch (f.kind) {
    case Frame::Kind::End:
      return;

    case Frame::Kind::Value: {
      if (is_whitespace(b) && grammar_->json) {
        out.push_back(std::move(stack));
        return;
      }
      const Kind k = node ? node->kind : Kind::Any;
      if (k == Kind::AnyOf) {
        for (int option : node->options) {
          Stack s = stack;
          s.back().node = option;
          advance(std::move(s), b, out);
        }
        return;
      }
      Frame v;
      v.node = f.node;
      if (k == Kind::DsmlCalls) {  // the block's frame, and its opening literal read from this byte
        f.kind = Frame::Kind::Dsml;
        f.state = 1;
        Frame open;
        open.kind = Frame::Kind::Literal;
        open.node = node->lit_open;
        open.hi = static_cast<int32_t>(grammar_->nodes[static_cast<size_t>(open.node)].literals.size());
        stack.push_back(open);
        advance(std::move(stack), b, out);
        return;
      }
      if ((k == Kind::Any || k == Kind::Object) && b == '{') {
        v.kind = Frame::Kind::Object;
      } else if ((k == Kind::Any || k == Kind::Array) && b == '[') {
        v.kind = Frame::Kind::Array;
      } else if ((k == Kind::Any || k == Kind::String) && b == '"') {
        v.kind = Frame::Kind::String;
      } else if ((k == Kind::Any || k == Kind::Number || k == Kind::Integer) && (b == '-' || is_digit(b))) {
        v.kind = Frame::Kind::Number;
      } else if (k == Kind::Any || k == Kind::Boolean || k == Kind::Null || k == Kind::Literals) {
        v.kind = Frame::Kind::Literal;
        if (k == Kind::Any) v.node = -1;
        v.hi = static_cast<int32_t>(literal_texts(v).size());
      } else {
        return;
      }
      if (k == Kind::Any) v.node = -1;  // any JSON, at every depth
      f = v;
      if (v.kind == Frame::Kind::Number || v.kind == Frame::Kind::Literal) {
        advance(std::move(stack), b, out);  // the byte is the value's first
      } else {
        out.push_back(std::move(stack));
      }
      return;
    }

    case Frame::Kind::Object: {
      const bool free_keys = !node || node->free_keys;
      const size_t properties = node ? node->property_nodes.size() : 0;
      const auto required_seen = [&] {
        for (size_t i = 0; i < properties; ++i) {
          if (node->required[i] && !(f.seen >> i & 1)) return false;
        }
        return true;
      };
      const auto unseen_left = [&] { return free_keys || f.seen != (properties == 64 ? ~uint64_t{0} : (uint64_t{1} << properties) - 1); };
      if (is_whitespace(b) && f.state != 1 && f.state != 3) {
        out.push_back(std::move(stack));
        return;
      }
      if ((f.state == 0 || f.state == 5) && b == '"') {
        if (!unseen_left()) return;
        f.state = 1;
        Frame key;
        key.key = true;
        key.node = f.node;
        if (free_keys) {
          key.kind = Frame::Kind::String;
        } else {
          key.kind = Frame::Kind::Literal;
          key.hi = static_cast<int32_t>(node->keys.size());
        }
        push(key);
        out.push_back(std::move(stack));
      } else if (f.state == 0 && b == '}') {
        if (!required_seen()) return;
        pop_value(stack);
        out.push_back(std::move(stack));
      } else if (f.state == 2 && b == ':') {
        f.state = 3;
        Frame value;
        value.node = f.count >= 0 ? node->property_nodes[static_cast<size_t>(f.count)] : -1;
        push(value);
        out.push_back(std::move(stack));
      } else if (f.state == 4 && b == ',') {
        if (!unseen_left()) return;
        f.state = 5;
        out.push_back(std::move(stack));
      } else if (f.state == 4 && b == '}') {
        if (!required_seen()) return;
        pop_value(stack);
        out.push_back(std::move(stack));
      }
      return;
    }

    case Frame::Kind::Array: {
      const int64_t min = node ? node->min_items : 0, max = node ? node->max_items : INT64_MAX;
      const int items = node ? node->items : -1;
      if (is_whitespace(b)) {
        out.push_back(std::move(stack));
        return;
      }
      if ((f.state == 0 || f.state == 2) && b == ']') {
        if (f.count < min) return;
        pop_value(stack);
        out.push_back(std::move(stack));
      } else if (f.state == 2 && b == ',') {
        if (f.count >= max) return;
        f.state = 3;
        out.push_back(std::move(stack));
      } else if (f.state == 0 || f.state == 3) {
        if (f.count >= max) return;
        f.state = 1;
        Frame item;
        item.node = items;
        push(item);
        advance(std::move(stack), b, out);  // the byte is the item's first
      }
      return;
    }

    case Frame::Kind::String: {
      if (f.hex_left > 0) {
        if (!is_hex(b)) return;
        --f.hex_left;
      } else if (f.state == 1) {
        if (b == 'u') {
          f.hex_left = 4;
        } else if (b != '"' && b != '\\' && b != '/' && b != 'b' && b != 'f' && b != 'n' && b != 'r' && b != 't') {
          return;
        }
        f.state = 0;
      } else {
        const Utf8Step u = utf8_step(f, b);
        if (u == Utf8Step::Refused || (u == Utf8Step::Ascii && b < 0x20)) return;
        if (u == Utf8Step::Ascii && b == '"') {
          pop_value(stack);
        } else if (u == Utf8Step::Ascii && b == '\\') {
          f.state = 1;
        }
      }
      out.push_back(std::move(stack));
      return;
    }

    case Frame::Kind::Raw: {  // state 0 text, 1 after '<', 2 after "</", 3 reading " parameter>" (count bytes)
      constexpr std::string_view kTail = " parameter>";
      if (f.state == 3) {
        if (b != static_cast<uint8_t>(kTail[static_cast<size_t>(f.count)])) return;
        if (++f.count == static_cast<int64_t>(kTail.size())) pop_value(stack);
        out.push_back(std::move(stack));
        return;
      }
      if (f.utf8_left == 0 && b == static_cast<uint8_t>(kDsmlMarkerByte)) {
        if (f.state != 2) return;  // the marker only in the closing tag
        f.state = 3;
        f.count = 0;
      } else {
        const Utf8Step u = utf8_step(f, b);
        if (u == Utf8Step::Refused || (u == Utf8Step::Ascii && b < 0x20 && b != '\n' && b != '\t')) return;
        f.state = u == Utf8Step::Ascii && b == '<' ? 1 : (u == Utf8Step::Ascii && f.state == 1 && b == '/') ? 2 : 0;
      }
      out.push_back(std::move(stack));
      return;
    }

    case Frame::Kind::Dsml:
      return;  // never on top: a piece of the block is always being read

    case Frame::Kind::Number: {
      const bool integer = node && node->kind == Kind::Integer;
      uint8_t next = 255;  // 255: the byte does not continue the number
      switch (f.state) {
        case 0: next = b == '-' ? 1 : b == '0' ? 2 : is_digit(b) ? 3 : 255; break;
        case 1: next = b == '0' ? 2 : is_digit(b) ? 3 : 255; break;
        case 2: next = !integer && b == '.' ? 4 : !integer && (b == 'e' || b == 'E') ? 6 : 255; break;
        case 3: next = is_digit(b) ? 3 : !integer && b == '.' ? 4 : !integer && (b == 'e' || b == 'E') ? 6 : 255; break;
        case 4: next = is_digit(b) ? 5 : 255; break;
        case 5: next = is_digit(b) ? 5 : (b == 'e' || b == 'E') ? 6 : 255; break;
        case 6: next = (b == '+' || b == '-') ? 7 : is_digit(b) ? 8 : 255; break;
        case 7: next = is_digit(b) ? 8 : 255; break;
        case 8: next = is_digit(b) ? 8 : 255; break;
        default: break;
      }
      if (next != 255) {
        if (++f.count > kMaxNumberBytes) return;
        f.state = next;
        out.push_back(std::move(stack));
      } else if (number_may_end(f.state)) {
        pop_value(stack);
        advance(std::move(stack), b, out);  // the byte belongs to what follows the number
      }
      return;
    }

    case Frame::Kind::Literal: {
      const std::vector<std::string>& texts = literal_texts(f);
      const size_t pos = static_cast<size_t>(f.count);
      int32_t lo = f.lo;
      if (texts[static_cast<size_t>(lo)].size() == pos) {
        // the shortest candidate ends here: the value is whole, and the byte is what follows it
        Stack ended = stack;
        pop_value(ended);
        advance(std::move(ended), b, out);
        ++lo;
      }
      const auto first = std::lower_bound(texts.begin() + lo, texts.begin() + f.hi, b,
                                          [pos](const std::string& t, uint8_t c) { return static_cast<uint8_t>(t[pos]) < c; });
      const auto last = std::upper_bound(first, texts.begin() + f.hi, b,
                                         [pos](uint8_t c, const std::string& t) { return c < static_cast<uint8_t>(t[pos]); });
      if (first == last) return;
      f.lo = static_cast<int32_t>(first - texts.begin());
      f.hi = static_cast<int32_t>(last - texts.begin());
      ++f.count;
      if (f.key) {  // a key already read cannot be read again
        const GrammarNode& object = grammar_->nodes[static_cast<size_t>(f.node)];
        const uint64_t seen = stack[stack.size() - 2].seen;
        bool open = false;
        for (int32_t i = f.lo; i < f.hi && !open; ++i) open = !(seen >> object.key_property[static_cast<size_t>(i)] & 1);
        if (!open) return;
        // a key is whole at its closing quote, and no other key starts with a whole one
        if (texts[static_cast<size_t>(f.lo)].size() == static_cast<size_t>(f.count)) {
          if (seen >> object.key_property[static_cast<size_t>(f.lo)] & 1) return;
          pop_value(stack);
        }
      } else if (f.hi - f.lo == 1 && texts[static_cast<size_t>(f.lo)].size() == static_cast<size_t>(f.count)) {
        pop_value(stack);  // the only candidate left is whole
      }
      out.push_back(std::move(stack));
      return;
    }
  }
}

bool GrammarMatcher::feed(uint8_t byte) {
  // Whitespace outside strings is bounded: a model must not pad a value forever.
  // (a literal's and a raw text's bytes are their own: only whitespace between JSON tokens counts)
  const bool structural = std::none_of(stacks_.begin(), stacks_.end(), [](const Stack& s) {
    return s.back().kind == Frame::Kind::String || s.back().kind == Frame::Kind::Raw || s.back().kind == Frame::Kind::Literal;
  });
  if (structural && is_whitespace(byte)) {
    size_t depth = 0;  // the containers open (the deepest stack's)
    for (const Stack& s : stacks_) {
      depth = std::max<size_t>(depth, std::count_if(s.begin(), s.end(), [](const Frame& f) {
        return f.kind == Frame::Kind::Object || f.kind == Frame::Kind::Array;
      }));
    }
    if (whitespace_run_ >= kIndentPerLevel * static_cast<int>(depth) + 2 || byte == '\r') return false;
    if (byte == '\n' && whitespace_newline_) return false;
    if (byte == '\t' && !whitespace_newline_) return false;  // tabs only indent a new line
  }
  scratch_.clear();
  for (const Stack& s : stacks_) advance(s, byte, scratch_);
  if (scratch_.empty()) return false;
  // forks that came to the same place are one
  std::sort(scratch_.begin(), scratch_.end(), [](const Stack& a, const Stack& b) {
    if (a.size() != b.size()) return a.size() < b.size();
    return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end(), [](const Frame& x, const Frame& y) {
      return std::tie(x.kind, x.state, x.node, x.lo, x.hi, x.count, x.seen, x.utf8_left, x.hex_left, x.key) <
             std::tie(y.kind, y.state, y.node, y.lo, y.hi, y.count, y.seen, y.utf8_left, y.hex_left, y.key);
    });
  });
  scratch_.erase(std::unique(scratch_.begin(), scratch_.end()), scratch_.end());
  if (scratch_.size() > kMaxStacks) return false;
  stacks_.swap(scratch_);
  const bool space = structural && is_whitespace(byte);
  whitespace_run_ = space ? whitespace_run_ + 1 : 0;
  whitespace_newline_ = space && (whitespace_newline_ || byte == '\n');
  return true;
}

bool GrammarMatcher::feed(const std::string& bytes) {
  for (const char c : bytes) {
    if (!feed(static_cast<uint8_t>(c))) return false;
  }
  return true;
}

bool GrammarMatcher::stack_complete(const Stack& s) const {
  const Frame& top = s.back();
  if (top.kind == Frame::Kind::End) return true;
  if (s.size() != 1) return false;
  if (top.kind == Frame::Kind::Number) return number_may_end(top.state);
  if (top.kind == Frame::Kind::Literal) return literal_texts(top)[static_cast<size_t>(top.lo)].size() == static_cast<size_t>(top.count);
  return false;
}

bool GrammarMatcher::complete() const {
  return std::any_of(stacks_.begin(), stacks_.end(), [this](const Stack& s) { return stack_complete(s); });
}

bool GrammarMatcher::finished() const {
  return std::all_of(stacks_.begin(), stacks_.end(), [](const Stack& s) { return s.back().kind == Frame::Kind::End; });
}

GrammarMatcher::FreeText GrammarMatcher::free_text() const {
  const auto free_in = [](const Stack& s) {
    const Frame& f = s.back();
    if (f.utf8_left != 0 || f.hex_left != 0 || f.state != 0) return FreeText::None;
    if (f.kind == Frame::Kind::String) return FreeText::JsonString;
    if (f.kind == Frame::Kind::Raw) return FreeText::Raw;
    return FreeText::None;
  };
  const FreeText first = free_in(stacks_.front());
  for (const Stack& s : stacks_) {
    if (free_in(s) != first) return FreeText::None;
  }
  return first;
}

}  // namespace dsv41
