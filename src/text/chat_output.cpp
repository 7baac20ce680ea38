// A byte-level state machine over a growing buffer. Every decision is taken only once the bytes
// that decide it have arrived (or at finish()), so the result cannot depend on how the text was
// split into pieces.
#include "text/chat_output.h"

#include <algorithm>
#include <span>
#include <utility>

#include "text/chat_encoding.h"

namespace dsv41 {
namespace {

// A parameter value ends at the next closing DSML tag, as in the recipe parser; the rest of the
// tag is checked afterwards.
constexpr std::string_view kDsmlClosePrefix = "</｜DSML｜";
constexpr std::string_view kParamCloseRest = " parameter>";
constexpr size_t kMaxAttributeBytes = 256;  // a name longer than this is not a DSML attribute

enum class Match { Ok, More, Fail };

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

Match match_literal(std::string_view s, std::string_view literal) {
  const size_t n = std::min(s.size(), literal.size());
  if (s.substr(0, n) != literal.substr(0, n)) return Match::Fail;
  return n < literal.size() ? Match::More : Match::Ok;
}

// Matches a DSML tag piece by piece from the start of a text; the first piece that does not match
// (or needs more text) decides the status and the rest are skipped.
class TagMatcher {
 public:
  explicit TagMatcher(std::string_view s) : s_(s) {}

  TagMatcher& literal(std::string_view lit) {
    if (status_ != Match::Ok) return *this;
    status_ = match_literal(s_.substr(pos_), lit);
    if (status_ == Match::Ok) pos_ += lit.size();
    return *this;
  }
  TagMatcher& space(bool required) {
    if (status_ != Match::Ok) return *this;
    size_t n = 0;
    while (pos_ + n < s_.size() && is_space(s_[pos_ + n])) ++n;
    if (n == 0 && required) status_ = pos_ == s_.size() ? Match::More : Match::Fail;
    pos_ += n;
    return *this;
  }
  // A double-quoted attribute value (opening quote already matched) up to the closing quote.
  TagMatcher& quoted(std::string& out) {
    if (status_ != Match::Ok) return *this;
    for (size_t n = 0;; ++n) {
      if (n > kMaxAttributeBytes) return fail();
      if (pos_ + n == s_.size()) {
        status_ = Match::More;
        return *this;
      }
      const char c = s_[pos_ + n];
      if (c == '<' || c == '>' || c == '\n') return fail();
      if (c == '"') {
        out.assign(s_.substr(pos_, n));
        pos_ += n + 1;
        return *this;
      }
    }
  }
  // One of two literals; `second` tells which matched.
  TagMatcher& either(std::string_view a, std::string_view b, bool& second) {
    if (status_ != Match::Ok) return *this;
    const Match ma = match_literal(s_.substr(pos_), a);
    const Match mb = match_literal(s_.substr(pos_), b);
    second = ma != Match::Ok && mb == Match::Ok;
    if (ma == Match::Ok || mb == Match::Ok) {
      pos_ += second ? b.size() : a.size();
    } else {
      status_ = ma == Match::More || mb == Match::More ? Match::More : Match::Fail;
    }
    return *this;
  }

  Match status() const { return status_; }
  size_t length() const { return pos_; }

 private:
  TagMatcher& fail() {
    status_ = Match::Fail;
    return *this;
  }
  std::string_view s_;
  size_t pos_ = 0;
  Match status_ = Match::Ok;
};

// Length of the longest tail of `s` that is a proper prefix of one of `markers`. Every marker has
// exactly one '<', at its start, so only the last '<' can begin such a tail.
size_t partial_marker_length(std::string_view s, std::span<const std::string_view> markers) {
  const size_t lt = s.rfind('<');
  if (lt == std::string_view::npos) return 0;
  const std::string_view tail = s.substr(lt);
  for (const std::string_view m : markers) {
    if (tail.size() < m.size() && m.substr(0, tail.size()) == tail) return tail.size();
  }
  return 0;
}

bool all_space(std::string_view s) { return std::all_of(s.begin(), s.end(), is_space); }

// Markers that end a run of text in each mode, with and without tools to call; each starts with its
// only '<'.
constexpr std::string_view kReasoningMarkers[] = {kThinkClose, kThinkOpen, kDsmlCallsOpen, kEosToken};
constexpr std::string_view kContentMarkers[] = {kThinkClose, kDsmlCallsOpen, kEosToken};
constexpr std::string_view kReasoningMarkersNoCalls[] = {kThinkClose, kThinkOpen, kEosToken};
constexpr std::string_view kContentMarkersNoCalls[] = {kThinkClose, kEosToken};
constexpr std::string_view kValueMarkers[] = {kDsmlClosePrefix, kEosToken};

}  // namespace

ChatOutputParser::ChatOutputParser(ChatOutputOptions options)
    : options_(std::move(options)),
      rng_(std::random_device{}()),
      mode_(options_.thinking ? Mode::Reasoning : Mode::Content) {}

ChatDelta ChatOutputParser::feed(std::string_view text) {
  if (finished_) return {};
  buf_.append(text);
  return run(false);
}

ChatDelta ChatOutputParser::finish() {
  if (finished_) return {};
  ChatDelta d = run(true);
  finished_ = true;
  mode_ = Mode::Done;
  return d;
}

ChatDelta ChatOutputParser::run(bool final) {
  for (bool progress = true; progress;) {
    switch (mode_) {
      case Mode::Reasoning:
      case Mode::Content: progress = step_text(final); break;
      case Mode::Block: progress = step_block(final); break;
      case Mode::AfterBlock: progress = step_after_block(final); break;
      case Mode::Done: pos_ = buf_.size(); progress = false; break;
    }
  }
  // Drop consumed text, keeping (inside a block) what may still have to go out as text.
  const size_t keep_from = mode_ == Mode::Block ? std::min(commit_, pos_) : pos_;
  buf_.erase(0, keep_from);
  pos_ -= keep_from;
  commit_ -= std::min(commit_, keep_from);
  return std::exchange(delta_, ChatDelta{});
}

bool ChatOutputParser::offers(std::string_view name) const {
  return std::find(options_.tools.begin(), options_.tools.end(), name) != options_.tools.end();
}

// Reasoning or content: text up to the next marker, holding back a possible partial marker and (when
// a call may come) up to two newlines that may turn out to be a tool block's separator.
bool ChatOutputParser::step_text(bool final) {
  const std::string_view rest = std::string_view(buf_).substr(pos_);
  const bool reasoning = mode_ == Mode::Reasoning;
  const bool calls = !options_.tools.empty();
  using Markers = std::span<const std::string_view>;
  const Markers markers = reasoning ? (calls ? Markers(kReasoningMarkers) : Markers(kReasoningMarkersNoCalls))
                                    : (calls ? Markers(kContentMarkers) : Markers(kContentMarkersNoCalls));
  size_t at = std::string_view::npos;
  std::string_view found;
  for (const std::string_view m : markers) {
    const size_t p = rest.find(m);
    if (p < at) {
      at = p;
      found = m;
    }
  }

  if (at != std::string_view::npos) {
    const std::string_view before = rest.substr(0, at);
    if (found == kDsmlCallsOpen) {
      size_t newlines = 0;
      while (newlines < 2 && newlines < before.size() && before[before.size() - 1 - newlines] == '\n') ++newlines;
      emit_text(mode_, before.substr(0, before.size() - newlines));
      commit_ = pos_ + before.size() - newlines;  // the separator belongs to the block's raw text
      pos_ += at + found.size();
      block_return_ = mode_;
      mode_ = Mode::Block;
      place_ = Place::Between;
      block_has_call_ = false;
      return true;
    }
    emit_text(mode_, before);
    pos_ += at + found.size();
    if (found == kEosToken) {
      mode_ = Mode::Done;
    } else if (found == kThinkClose && reasoning) {
      mode_ = Mode::Content;
    }
    // Otherwise a stray <think> in reasoning or </think> in content: dropped (docs §3.3, §4).
    return true;
  }

  if (final) {
    emit_text(mode_, rest);
    pos_ = buf_.size();
    return false;
  }
  size_t cut = rest.size() - partial_marker_length(rest, markers);
  for (int i = 0; calls && i < 2 && cut > 0 && rest[cut - 1] == '\n'; ++i) --cut;
  emit_text(mode_, rest.substr(0, cut));
  pos_ += cut;
  return false;
}

bool ChatOutputParser::step_block(bool final) {
  if (place_ == Place::StringValue || place_ == Place::RawValue) return step_value(final);
  const std::string_view rest = std::string_view(buf_).substr(pos_);

  TagMatcher eos(rest);
  eos.space(false).literal(kEosToken);
  if (eos.status() == Match::Ok) {  // the model stopped inside the block
    end_block_early(pos_, true);
    pos_ += eos.length();
    mode_ = Mode::Done;
    return true;
  }

  std::string name;
  bool is_string = false;
  bool is_false = false;
  TagMatcher open(rest);
  TagMatcher close(rest);
  if (place_ == Place::Between) {
    open.space(false).literal(kDsmlInvokeOpen).space(true).literal("name=\"").quoted(name).space(false).literal(">");
    close.space(false).literal(kDsmlCallsClose);
  } else {
    open.space(false).literal(kDsmlParamOpen).space(true).literal("name=\"").quoted(name).space(true);
    open.literal("string=\"").either("true\"", "false\"", is_false).space(false).literal(">");
    is_string = !is_false;
    close.space(false).literal(kDsmlInvokeClose);
  }

  if (open.status() == Match::Ok) {
    if (place_ == Place::Between && !offers(name)) {  // a tool the request did not offer: text
      end_block_early(pos_, false);
      return true;
    }
    pos_ += open.length();
    if (place_ == Place::Between) {
      open_call(name);
      commit_ = pos_;
      place_ = Place::Body;
    } else if (is_string) {
      std::string head = first_param_ ? "" : ", ";
      append_python_json_string(head, name);
      head += ": \"";
      append_arguments(head);
      first_param_ = false;
      commit_ = pos_;
      place_ = Place::StringValue;
    } else {
      // A JSON value is emitted whole once closed and checked; until then the tag stays raw text.
      param_key_ = name;
      raw_value_.clear();
      place_ = Place::RawValue;
    }
    return true;
  }
  if (close.status() == Match::Ok) {
    pos_ += close.length();
    commit_ = pos_;
    if (place_ == Place::Body) {
      append_arguments("}");
      out_.tool_calls.back().complete = true;
      call_open_ = false;
      place_ = Place::Between;
    } else {
      mode_ = Mode::AfterBlock;
    }
    return true;
  }
  const bool more = open.status() == Match::More || close.status() == Match::More || eos.status() == Match::More;
  if (more && !final) return false;
  end_block_early(more ? buf_.size() : pos_, more);
  return true;
}

// Inside a parameter value: everything up to the next closing DSML tag (or EOS).
bool ChatOutputParser::step_value(bool final) {
  const std::string_view rest = std::string_view(buf_).substr(pos_);
  const bool is_string = place_ == Place::StringValue;
  auto take = [&](std::string_view piece) {
    pos_ += piece.size();
    if (is_string) {
      std::string escaped;
      append_python_json_escaped(escaped, piece);
      append_arguments(escaped);
      commit_ = pos_;
    } else {
      raw_value_.append(piece);
    }
  };

  const size_t close = rest.find(kDsmlClosePrefix);
  const size_t eos = rest.find(kEosToken);
  if (eos < close) {
    take(rest.substr(0, eos));
    end_block_early(pos_, true);
    pos_ += kEosToken.size();
    mode_ = Mode::Done;
    return true;
  }
  if (close != std::string_view::npos) {
    const Match tail = match_literal(rest.substr(close + kDsmlClosePrefix.size()), kParamCloseRest);
    if (tail == Match::Ok || !final) take(rest.substr(0, close));
    if (tail == Match::More && !final) return false;
    if (tail == Match::Fail) {
      end_block_early(pos_, false);
      return true;
    }
    if (tail == Match::Ok) {
      pos_ += kDsmlClosePrefix.size() + kParamCloseRest.size();
      if (is_string) {
        append_arguments("\"");
      } else {
        // string="false" values are passed through when they are JSON, else sent as a string.
        std::string head = first_param_ ? "" : ", ";
        append_python_json_string(head, param_key_);
        head += ": ";
        if (nlohmann::json::accept(raw_value_)) {
          head += raw_value_;
        } else {
          append_python_json_string(head, raw_value_);
        }
        append_arguments(head);
        first_param_ = false;
      }
      commit_ = pos_;
      place_ = Place::Body;
      return true;
    }
  }
  if (final) {  // cut off inside the value
    take(rest);
    end_block_early(pos_, true);
    return true;
  }
  take(rest.substr(0, rest.size() - partial_marker_length(rest, kValueMarkers)));
  return false;
}

// After </｜DSML｜ calls>: whitespace up to EOS or the end is formatting; anything else is content.
bool ChatOutputParser::step_after_block(bool final) {
  const std::string_view rest = std::string_view(buf_).substr(pos_);
  size_t n = 0;
  while (n < rest.size() && is_space(rest[n])) ++n;
  if (n == rest.size()) {
    if (final) pos_ = buf_.size();
    return false;
  }
  const Match eos = match_literal(rest.substr(n), kEosToken);
  if (eos == Match::Ok) {
    pos_ += n + kEosToken.size();
    mode_ = Mode::Done;
    return true;
  }
  if (eos == Match::More && !final) return false;
  mode_ = Mode::Content;
  return true;
}

// The block stops before its end, malformed at `at` or cut off there. An open call is closed so its
// arguments stay a JSON object; the text since the last emitted piece goes out as text (to where
// the block started if it produced no call, else to content) and parsing resumes at `at` as text.
void ChatOutputParser::end_block_early(size_t at, bool cut_off) {
  if (call_open_) {
    if (place_ == Place::StringValue) append_arguments("\"");
    append_arguments("}");
    out_.tool_calls.back().complete = false;
    call_open_ = false;
  }
  const Mode channel = block_has_call_ ? Mode::Content : block_return_;
  const std::string_view raw = std::string_view(buf_).substr(commit_, at - commit_);
  if (!(cut_off && all_space(raw))) emit_text(channel, raw);
  mode_ = channel;
  pos_ = at;
  commit_ = at;
}

void ChatOutputParser::emit_text(Mode channel, std::string_view text) {
  if (text.empty()) return;
  if (channel == Mode::Reasoning) {
    out_.reasoning_content.append(text);
    delta_.reasoning_content.append(text);
  } else {
    out_.content.append(text);
    delta_.content.append(text);
  }
}

void ChatOutputParser::open_call(const std::string& name) {
  ToolCall call;
  call.id = next_call_id();
  call.name = name;
  call.arguments = "{";
  call.complete = false;
  delta_.tool_calls.push_back(ToolCallDelta{out_.tool_calls.size(), call.id, name, "{"});
  out_.tool_calls.push_back(std::move(call));
  block_has_call_ = true;
  call_open_ = true;
  first_param_ = true;
}

void ChatOutputParser::append_arguments(std::string_view text) {
  const size_t index = out_.tool_calls.size() - 1;
  out_.tool_calls.back().arguments.append(text);
  if (delta_.tool_calls.empty() || delta_.tool_calls.back().index != index) {
    delta_.tool_calls.push_back(ToolCallDelta{index, "", "", ""});
  }
  delta_.tool_calls.back().arguments.append(text);
}

std::string ChatOutputParser::next_call_id() {
  const size_t index = out_.tool_calls.size();
  if (options_.make_call_id) return options_.make_call_id(index);
  static constexpr std::string_view kAlphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kAlphabet[rng_() % kAlphabet.size()];
  return id;
}

bool is_dsml_name(std::string_view name) {
  return !name.empty() && name.size() <= kMaxAttributeBytes && name.find_first_of("\"<>\n") == std::string_view::npos;
}

ChatOutput parse_chat_output(std::string_view text, const ChatOutputOptions& options) {
  ChatOutputParser parser(options);
  parser.feed(text);
  parser.finish();
  return parser.output();
}

nlohmann::json tool_call_json(const ToolCall& call) {
  return {{"id", call.id}, {"type", "function"}, {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
}

nlohmann::json tool_call_delta_json(const ToolCallDelta& delta) {
  nlohmann::json j = {{"index", delta.index}};
  nlohmann::json function = nlohmann::json::object();
  if (!delta.id.empty()) {
    j["id"] = delta.id;
    j["type"] = "function";
    function["name"] = delta.name;
  }
  function["arguments"] = delta.arguments;
  j["function"] = std::move(function);
  return j;
}

nlohmann::json chat_output_message_json(const ChatOutput& output) {
  nlohmann::json j = {{"role", "assistant"}};
  if (output.content.empty() && !output.tool_calls.empty()) {
    j["content"] = nullptr;
  } else {
    j["content"] = output.content;
  }
  if (!output.reasoning_content.empty()) j["reasoning_content"] = output.reasoning_content;
  if (!output.tool_calls.empty()) {
    nlohmann::json calls = nlohmann::json::array();
    for (const ToolCall& c : output.tool_calls) calls.push_back(tool_call_json(c));
    j["tool_calls"] = std::move(calls);
  }
  return j;
}

}  // namespace dsv41
