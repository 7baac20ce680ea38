#include "text/tokenizer.h"

#include <array>
#include <mutex>
#include <queue>
#include <unordered_map>

#include <nlohmann/json.hpp>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "text/byte_level.h"
#include "util/error.h"
#include "util/regular_file.h"

namespace dsv41 {

using nlohmann::json;

namespace {

// Ids are array indices here; a bound keeps a corrupt file from asking for gigabytes.
constexpr int64_t kMaxVocab = int64_t{1} << 24;

// Words longer than this are rare enough that caching them only costs memory (the bound the
// `tokenizers` library uses too), and the cache stops growing once it holds kCacheCapacity words.
constexpr size_t kMaxCachedWordBytes = 256;
constexpr size_t kCacheCapacity = 10000;

// The pre-tokenizer regex of GPT-2, which ByteLevel applies itself when use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

constexpr const char* kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// Appends `bytes` to `out` as valid UTF-8, replacing each maximal invalid subsequence by U+FFFD (the
// Unicode "maximal subpart" rule, which Rust's from_utf8_lossy and so the `tokenizers` decoder use).
// Unless `final`, an incomplete but so far valid character at the end is left unconsumed because
// its remaining bytes may still arrive. Returns the number of bytes consumed.
size_t append_utf8_lossy(std::string& out, std::string_view bytes, bool final) {
  const size_t n = bytes.size();
  size_t i = 0;
  while (i < n) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    // Continuation bytes needed, and the range allowed for the first of them (which excludes
    // overlong forms, surrogates and code points above U+10FFFF).
    size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      need = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      need = 2;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      need = 3;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      out += kReplacementChar;
      ++i;
      continue;
    }
    size_t k = 1;
    for (; k <= need && i + k < n; ++k) {
      const auto cc = static_cast<unsigned char>(bytes[i + k]);
      if (k == 1 ? (cc < lo || cc > hi) : (cc < 0x80 || cc > 0xBF)) break;
    }
    if (k > need) {
      out.append(bytes.substr(i, need + 1));
      i += need + 1;
    } else if (i + k == n && !final) {
      return i;
    } else {
      out += kReplacementChar;
      i += k;
    }
  }
  return n;
}

// Unicode's White_Space set as the inside of a PCRE2 character class.
constexpr const char* kWhiteSpaceSet =
    R"(\x{9}-\x{D}\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

// PCRE2 (10.42) lets \s match U+180E as well, which stopped being a space in Unicode 6.3; the
// `tokenizers` library (Oniguruma) and JavaScript both leave it out. Writing \s and \S out as the
// White_Space set makes PCRE2 agree. A \S inside a [...] class cannot be written out and stays.
std::string spell_out_whitespace(const std::string& pattern) {
  const std::string set = kWhiteSpaceSet;
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      if (e == 's') {
        out += in_class ? set : "[" + set + "]";
      } else if (e == 'S' && !in_class) {
        out += "[^" + set + "]";
      } else if (e == 'Q') {  // \Q...\E is quoted text: copy it as it is
        const size_t end = pattern.find("\\E", i + 1);
        const size_t stop = end == std::string::npos ? pattern.size() : end + 2;
        out += "\\Q";
        out.append(pattern, i + 1, stop - (i + 1));
        i = stop - 1;
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    out += c;
    if (!in_class && c == '[') {
      in_class = true;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
    } else if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      const size_t end = pattern.find(":]", i + 2);  // a POSIX class such as [:alpha:]
      if (end != std::string::npos) {
        out.append(pattern, i + 1, end + 2 - (i + 1));
        i = end + 1;
      }
    } else if (in_class && c == ']') {
      in_class = false;
    }
  }
  return out;
}

// Length of the UTF-8 character starting with byte c (1 for a byte that cannot start one), used to
// step past an empty regex match.
size_t utf8_step(unsigned char c) { return c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1; }

// A compiled PCRE2 pattern. MATCH_INVALID_UTF makes matching well defined on invalid UTF-8 (bad
// bytes never match and fall into the gaps between matches), so arbitrary bytes can be encoded.
// \p{..} classes come from PCRE2's Unicode tables (Unicode 14 in 10.42): a character assigned
// later counts as unassigned, where an engine with newer tables may split around it differently.
class Regex {
 public:
  Regex(const std::string& text, bool literal, const std::string& where) {
    const std::string pattern = literal ? text : spell_out_whitespace(text);
    int error = 0;
    PCRE2_SIZE offset = 0;
    // PCRE2 refuses UCP together with LITERAL; a literal has no character classes to affect anyway.
    uint32_t options = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options,
                                     &error, &offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof message);
      fail(where, "pre_tokenizer pattern " + json(text).dump() + " does not compile (at offset " +
                      std::to_string(offset) + " of its PCRE2 form " + json(pattern).dump() +
                      "): " + reinterpret_cast<const char*>(message));
    }
    code_.reset(code);
    // JIT makes matching several times faster; where it is unavailable the interpreter still works.
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  }

  pcre2_code* code() const { return code_.get(); }

  // Calls fn(begin, end) for each successive non-overlapping match in `subject`.
  template <typename Fn>
  void for_each_match(std::string_view subject, pcre2_match_data* md, Fn&& fn) const {
    size_t pos = 0;
    while (pos <= subject.size()) {
      const int rc = pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), pos, 0,
                                 md, nullptr);
      // No match ends the loop; so does a resource limit, leaving the rest as one gap rather than
      // failing the whole encode.
      if (rc < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      const size_t begin = ov[0], end = ov[1];
      fn(begin, end);
      if (end > begin) {
        pos = end;
      } else if (end < subject.size()) {
        pos = end + utf8_step(static_cast<unsigned char>(subject[end]));
      } else {
        break;
      }
    }
  }

 private:
  struct Free {
    void operator()(pcre2_code* c) const { pcre2_code_free(c); }
  };
  std::unique_ptr<pcre2_code, Free> code_;
};

struct MatchDataFree {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};
using MatchData = std::unique_ptr<pcre2_match_data, MatchDataFree>;

enum class SplitBehavior { kIsolated, kRemoved };

struct SplitStep {
  Regex regex;
  SplitBehavior behavior;
};

std::string type_of(const json& j) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) return "(no type)";
  return j["type"].get<std::string>();
}

}  // namespace

struct Tokenizer::Impl {
  std::string where;

  // Per id: the string in tokenizer.json, the bytes it decodes to, and what kind of token it is.
  enum Kind : uint8_t { kUnknown, kVocab, kAdded, kAddedSpecial };
  std::vector<std::string> id_text;
  std::vector<std::string> id_bytes;
  std::vector<Kind> id_kind;
  std::unordered_map<std::string, int32_t> vocab;        // model vocab string -> id
  std::unordered_map<std::string, int32_t> added_by_text;  // added token content -> id

  std::array<int32_t, 256> byte_id{};  // the vocab id of each single-byte token (-1 if missing)
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  std::unordered_map<uint64_t, Merge> merges;  // (left id, right id) -> rank and merged id
  bool ignore_merges = false;

  std::vector<SplitStep> splits;

  // Added tokens as a byte trie, so the longest one starting at a position is found in one walk.
  std::vector<int32_t> trie{-1};  // per node: id of the added token ending there, or -1
  std::unordered_map<uint64_t, int32_t> trie_edges;  // (node << 8 | byte) -> child node
  std::array<bool, 256> trie_first{};               // bytes that can start an added token

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  static uint64_t pair_key(int32_t a, int32_t b) {
    return (uint64_t{static_cast<uint32_t>(a)} << 32) | static_cast<uint32_t>(b);
  }

  // --- loading ---

  void set_id(int64_t id, const std::string& text, Kind kind) {
    if (id < 0 || id >= kMaxVocab) fail(where, "token id " + std::to_string(id) + " of " + json(text).dump() + " is out of range");
    const auto i = static_cast<size_t>(id);
    if (i >= id_text.size()) {
      id_text.resize(i + 1);
      id_bytes.resize(i + 1);
      id_kind.resize(i + 1, kUnknown);
    }
    id_text[i] = text;
    if (kind == kVocab) {
      // A vocab string outside the byte alphabet is passed through as its own UTF-8, as the
      // `tokenizers` ByteLevel decoder does.
      auto bytes = token_text_to_bytes(text);
      id_bytes[i] = bytes ? *bytes : text;
    } else {
      id_bytes[i] = text;  // added tokens decode to their content
    }
    id_kind[i] = kind;
  }

  void load_model(const json& model) {
    if (!model.is_object()) fail(where, "tokenizer.json has no \"model\" object");
    if (type_of(model) != "BPE") fail(where, "model type " + type_of(model) + " is not supported (only BPE)");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (model.contains(key) && !model[key].is_null()) fail(where, std::string("BPE ") + key + " is not supported");
    }
    if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0) {
      fail(where, "BPE dropout is not supported");
    }
    ignore_merges = model.value("ignore_merges", false);
    if (!model.contains("vocab") || !model["vocab"].is_object()) fail(where, "model has no \"vocab\" object");
    if (!model.contains("merges") || !model["merges"].is_array()) fail(where, "model has no \"merges\" array");

    for (const auto& [text, id] : model["vocab"].items()) {
      if (!id.is_number_integer()) fail(where, "vocab entry " + json(text).dump() + " has a non-integer id");
      const auto value = id.get<int64_t>();
      set_id(value, text, kVocab);
      vocab[text] = static_cast<int32_t>(value);
    }
    for (int b = 0; b < 256; ++b) {
      auto it = vocab.find(bytes_to_token_text(std::string(1, static_cast<char>(b))));
      byte_id[static_cast<size_t>(b)] = it == vocab.end() ? -1 : it->second;
    }

    const json& list = model["merges"];
    for (size_t rank = 0; rank < list.size(); ++rank) {
      const json& m = list[rank];
      std::string left, right;
      if (m.is_string()) {
        // Byte-level tokens never contain a space (it is written "Ġ"), so the one space separates.
        const auto& s = m.get_ref<const std::string&>();
        const size_t space = s.find(' ');
        if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
          fail(where, "merge " + std::to_string(rank) + " " + m.dump() + " is not two tokens separated by a space");
        }
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        left = m[0].get<std::string>();
        right = m[1].get<std::string>();
      } else {
        fail(where, "merge " + std::to_string(rank) + " " + m.dump() + " is neither \"a b\" nor [\"a\", \"b\"]");
      }
      auto id_of = [&](const std::string& t) {
        auto it = vocab.find(t);
        if (it == vocab.end()) fail(where, "merge " + std::to_string(rank) + " uses " + json(t).dump() + ", which is not in the vocab");
        return it->second;
      };
      const int32_t a = id_of(left), b = id_of(right), merged = id_of(left + right);
      // A repeated merge keeps its first (best) rank.
      merges.emplace(pair_key(a, b), Merge{static_cast<int32_t>(rank), merged});
    }
  }

  void load_added_tokens(const json& added) {
    if (added.is_null()) return;
    if (!added.is_array()) fail(where, "\"added_tokens\" is not an array");
    for (const json& t : added) {
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
          !t["content"].is_string()) {
        fail(where, "added token " + t.dump() + " needs an integer \"id\" and a string \"content\"");
      }
      const auto id = t["id"].get<int64_t>();
      const auto& content = t["content"].get_ref<const std::string&>();
      const bool special = t.value("special", false);
      if (content.empty()) continue;  // could never match
      set_id(id, content, special ? kAddedSpecial : kAdded);
      added_by_text[content] = static_cast<int32_t>(id);

      size_t node = 0;
      for (char c : content) {
        const uint64_t key = (uint64_t{node} << 8) | static_cast<unsigned char>(c);
        auto it = trie_edges.find(key);
        if (it == trie_edges.end()) {
          it = trie_edges.emplace(key, static_cast<int32_t>(trie.size())).first;
          trie.push_back(-1);
        }
        node = static_cast<size_t>(it->second);
      }
      trie[node] = static_cast<int32_t>(id);
      trie_first[static_cast<unsigned char>(content[0])] = true;
    }
  }

  void load_normalizer(const json& n) {
    // DeepSeek ships an empty Sequence: the text is used as given.
    if (n.is_null()) return;
    if (type_of(n) == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array()) {
      for (const json& inner : n["normalizers"]) load_normalizer(inner);
      return;
    }
    fail(where, "normalizer " + type_of(n) + " is not supported (only none or an empty Sequence)");
  }

  // Appends the steps of one pre-tokenizer; returns whether it ended with ByteLevel.
  bool load_pre_tokenizer(const json& p) {
    const std::string type = type_of(p);
    if (type == "Sequence") {
      if (!p.contains("pretokenizers") || !p["pretokenizers"].is_array()) fail(where, "pre_tokenizer Sequence has no \"pretokenizers\" array");
      bool byte_level_last = false;
      for (const json& inner : p["pretokenizers"]) {
        if (byte_level_last) fail(where, "ByteLevel must be the last pre_tokenizer");
        byte_level_last = load_pre_tokenizer(inner);
      }
      return byte_level_last;
    }
    if (type == "Split") {
      if (p.value("invert", false)) fail(where, "Split with invert is not supported");
      const std::string behavior = p.value("behavior", std::string("(none)"));
      SplitBehavior b;
      if (behavior == "Isolated") {
        b = SplitBehavior::kIsolated;
      } else if (behavior == "Removed") {
        b = SplitBehavior::kRemoved;
      } else {
        fail(where, "Split behavior " + behavior + " is not supported (only Isolated and Removed)");
      }
      const json pattern = p.value("pattern", json());
      if (pattern.contains("Regex") && pattern["Regex"].is_string()) {
        splits.push_back(SplitStep{Regex(pattern["Regex"].get<std::string>(), false, where), b});
      } else if (pattern.contains("String") && pattern["String"].is_string()) {
        splits.push_back(SplitStep{Regex(pattern["String"].get<std::string>(), true, where), b});
      } else {
        fail(where, "Split pattern " + pattern.dump() + " has neither \"Regex\" nor \"String\"");
      }
      return false;
    }
    if (type == "ByteLevel") {
      // The library's default for add_prefix_space is true, so only an explicit false is accepted.
      if (p.value("add_prefix_space", true)) fail(where, "ByteLevel add_prefix_space is not supported");
      if (p.value("use_regex", true)) splits.push_back(SplitStep{Regex(kGpt2Pattern, false, where), SplitBehavior::kIsolated});
      return true;
    }
    fail(where, "pre_tokenizer " + type + " is not supported (only Sequence, Split and ByteLevel)");
  }

  void load(const json& j) {
    if (!j.is_object()) fail(where, "tokenizer.json is not a JSON object");
    if (!j.contains("model")) fail(where, "tokenizer.json has no \"model\"");
    load_model(j["model"]);
    load_added_tokens(j.value("added_tokens", json()));
    load_normalizer(j.value("normalizer", json()));
    const json pre = j.value("pre_tokenizer", json());
    if (pre.is_null() || !load_pre_tokenizer(pre)) {
      fail(where, "pre_tokenizer must end with ByteLevel (only byte-level BPE is supported)");
    }
    const json decoder = j.value("decoder", json());
    if (!decoder.is_null() && type_of(decoder) != "ByteLevel") {
      fail(where, "decoder " + type_of(decoder) + " is not supported (only ByteLevel)");
    }
  }

  // --- encoding ---

  // Byte-pair merging of one pre-tokenized piece: always merge the adjacent pair with the lowest
  // rank, the leftmost one on ties, until no pair has a merge. A heap of candidate pairs keeps this
  // O(n log n), which matters for long runs of letters with no space in them.
  void bpe(std::string_view piece, std::vector<int32_t>& out) const {
    struct Symbol {
      int32_t id;
      int32_t prev;
      int32_t next;
      bool alive;
    };
    std::vector<Symbol> symbols;
    symbols.reserve(piece.size());
    for (char c : piece) {
      // A byte missing from the vocab is dropped, as the library does when there is no unk token.
      const int32_t id = byte_id[static_cast<unsigned char>(c)];
      if (id < 0) continue;
      const auto index = static_cast<int32_t>(symbols.size());
      symbols.push_back(Symbol{id, index - 1, index + 1, true});
    }
    if (symbols.empty()) return;
    symbols.back().next = -1;

    struct Candidate {
      int32_t rank;
      int32_t left;
      int32_t right;
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
    auto consider = [&](int32_t left, int32_t right) {
      if (left < 0 || right < 0) return;
      auto it = merges.find(pair_key(symbols[left].id, symbols[right].id));
      if (it != merges.end()) queue.push(Candidate{it->second.rank, left, right});
    };
    for (size_t i = 0; i + 1 < symbols.size(); ++i) consider(static_cast<int32_t>(i), static_cast<int32_t>(i + 1));

    while (!queue.empty()) {
      const Candidate c = queue.top();
      queue.pop();
      Symbol& left = symbols[c.left];
      // Stale candidates: a side was merged away or changed since the pair was queued (a rank names
      // one merge, so an unchanged rank means an unchanged pair).
      if (!left.alive || left.next != c.right || !symbols[c.right].alive) continue;
      auto it = merges.find(pair_key(left.id, symbols[c.right].id));
      if (it == merges.end() || it->second.rank != c.rank) continue;
      left.id = it->second.id;
      symbols[c.right].alive = false;
      left.next = symbols[c.right].next;
      if (left.next >= 0) symbols[left.next].prev = c.left;
      consider(left.prev, c.left);
      consider(c.left, left.next);
    }
    for (int32_t i = 0; i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
  }

  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
    if (piece.size() == 1) {
      const int32_t id = byte_id[static_cast<unsigned char>(piece[0])];
      if (id >= 0) out.push_back(id);
      return;
    }
    if (ignore_merges) {
      auto it = vocab.find(bytes_to_token_text(piece));
      if (it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    const bool cacheable = piece.size() < kMaxCachedWordBytes;
    std::string key;
    if (cacheable) {
      key.assign(piece);
      std::lock_guard<std::mutex> lock(cache_mutex);
      auto it = cache.find(key);
      if (it != cache.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const size_t first = out.size();
    bpe(piece, out);
    if (cacheable) {
      std::lock_guard<std::mutex> lock(cache_mutex);
      if (cache.size() < kCacheCapacity) cache.emplace(std::move(key), std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(first), out.end()));
    }
  }

  // Text between added tokens: each Split turns every current piece into its matches and the gaps
  // between them; the regexes see one piece at a time, so a lookahead stops at the piece's end.
  void encode_text(std::string_view text, std::vector<MatchData>& match_data, std::vector<int32_t>& out) const {
    if (text.empty()) return;
    std::vector<std::string_view> pieces{text}, next;
    for (size_t s = 0; s < splits.size(); ++s) {
      const SplitStep& step = splits[s];
      if (!match_data[s]) match_data[s].reset(pcre2_match_data_create_from_pattern(step.regex.code(), nullptr));
      next.clear();
      for (std::string_view piece : pieces) {
        size_t gap = 0;
        step.regex.for_each_match(piece, match_data[s].get(), [&](size_t begin, size_t end) {
          if (begin > gap) next.push_back(piece.substr(gap, begin - gap));
          if (end > begin && step.behavior == SplitBehavior::kIsolated) next.push_back(piece.substr(begin, end - begin));
          gap = end;
        });
        if (gap < piece.size()) next.push_back(piece.substr(gap));
      }
      pieces.swap(next);
    }
    for (std::string_view piece : pieces) encode_piece(piece, out);
  }

  // The longest added token starting at text[pos] and ending by text[limit]: its id and length.
  std::optional<std::pair<int32_t, size_t>> match_added(std::string_view text, size_t pos, size_t limit) const {
    std::optional<std::pair<int32_t, size_t>> best;
    size_t node = 0;
    for (size_t i = pos; i < limit; ++i) {
      auto it = trie_edges.find((uint64_t{node} << 8) | static_cast<unsigned char>(text[i]));
      if (it == trie_edges.end()) break;
      node = static_cast<size_t>(it->second);
      if (trie[node] >= 0) best = std::make_pair(trie[node], i + 1 - pos);
    }
    return best;
  }

  // Added tokens are looked for when parse_special, and then only outside the `plain` spans: the
  // search skips each span and a match may not run into the next one.
  std::vector<int32_t> encode(std::string_view text, bool parse_special, std::span<const TextSpan> plain) const {
    std::vector<int32_t> out;
    std::vector<MatchData> match_data(splits.size());
    size_t start = 0;
    if (parse_special && !added_by_text.empty()) {
      size_t next_plain = 0;  // the first span that does not end at or before i
      for (size_t i = 0; i < text.size();) {
        while (next_plain < plain.size() && plain[next_plain].end <= i) ++next_plain;
        size_t limit = text.size();
        if (next_plain < plain.size()) {
          if (plain[next_plain].begin <= i) {
            i = plain[next_plain].end;
            continue;
          }
          limit = plain[next_plain].begin;
        }
        std::optional<std::pair<int32_t, size_t>> hit;
        if (trie_first[static_cast<unsigned char>(text[i])]) hit = match_added(text, i, limit);
        if (!hit) {
          ++i;
          continue;
        }
        encode_text(text.substr(start, i - start), match_data, out);
        out.push_back(hit->first);
        i += hit->second;
        start = i;
      }
    }
    encode_text(text.substr(start), match_data, out);
    return out;
  }

  bool known(int32_t id) const { return id >= 0 && static_cast<size_t>(id) < id_kind.size() && id_kind[id] != kUnknown; }
};

Tokenizer Tokenizer::from_file(const std::string& path) {
  json j;
  try {
    j = json::parse(read_regular_file(path));
  } catch (const json::exception& e) {
    fail(path, std::string("not valid JSON: ") + e.what());
  }
  return from_json(j, path);
}

Tokenizer Tokenizer::from_json(const json& j, const std::string& where) {
  auto impl = std::make_shared<Impl>();
  impl->where = where;
  try {
    impl->load(j);
  } catch (const json::exception& e) {
    // A value of the wrong JSON type somewhere the checks above do not look.
    fail(where, std::string("malformed tokenizer.json: ") + e.what());
  }
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  return impl_->encode(text, parse_special, {});
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, std::span<const TextSpan> plain) const {
  size_t previous_end = 0;
  for (const TextSpan& s : plain) {
    if (s.begin < previous_end || s.end < s.begin || s.end > text.size()) {
      fail("tokenizer", "plain spans must be in order, disjoint and inside the text; got [" + std::to_string(s.begin) +
                            ", " + std::to_string(s.end) + ") in a text of " + std::to_string(text.size()) + " bytes");
    }
    previous_end = s.end;
  }
  return impl_->encode(text, /*parse_special=*/true, plain);
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (!impl_->known(id)) continue;
    if (skip_special && impl_->id_kind[id] == Impl::kAddedSpecial) continue;
    bytes += impl_->id_bytes[id];
  }
  std::string out;
  append_utf8_lossy(out, bytes, true);
  return out;
}

std::string Tokenizer::token_bytes(int32_t id) const { return impl_->known(id) ? impl_->id_bytes[id] : std::string(); }

std::string Tokenizer::token_text(int32_t id) const { return impl_->known(id) ? impl_->id_text[id] : std::string(); }

std::optional<int32_t> Tokenizer::token_id(std::string_view token) const {
  const std::string key(token);
  if (auto it = impl_->added_by_text.find(key); it != impl_->added_by_text.end()) return it->second;
  if (auto it = impl_->vocab.find(key); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_kind.size()); }

bool Tokenizer::is_special(int32_t id) const { return impl_->known(id) && impl_->id_kind[id] == Impl::kAddedSpecial; }

std::string StreamDecoder::push(int32_t id) {
  pending_ += tokenizer_.token_bytes(id);
  std::string out;
  pending_.erase(0, append_utf8_lossy(out, pending_, false));
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  append_utf8_lossy(out, pending_, true);
  pending_.clear();
  return out;
}

}  // namespace dsv41
