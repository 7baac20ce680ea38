#include "text/grammar_mask.h"

#include <algorithm>

namespace dsv41 {
namespace {

// A token that, inside a free string, stays inside it whatever came before: printable bytes, no
// quote or backslash, and whole UTF-8 characters.
bool safe_in_free_string(const std::string& s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<uint8_t>(s[i]);
    size_t len = 1;
    if (b < 0x20 || b == '"' || b == '\\') return false;
    if (b >= 0x80) {
      const Utf8Lead lead = utf8_lead(b);
      if (lead.continuations == 0) return false;
      len = 1 + lead.continuations;
      if (i + len > s.size()) return false;
      for (size_t k = 1; k < len; ++k) {
        const auto c = static_cast<uint8_t>(s[i + k]);
        if (c < (k == 1 ? lead.lo : 0x80) || c > (k == 1 ? lead.hi : 0xBF)) return false;
      }
    }
    i += len;
  }
  return true;
}

void set_bit(std::vector<uint64_t>& bits, int32_t id) { bits[static_cast<size_t>(id) >> 6] |= uint64_t{1} << (id & 63); }

}  // namespace

void GrammarVocabulary::Trie::build(const std::vector<std::pair<std::string, int32_t>>& sorted) {
  // Nodes are made breadth-first so each node's edges are contiguous: first the distinct prefixes of
  // every length, in sorted order (a sorted list's tokens with a common prefix are adjacent).
  struct Span {
    size_t begin, end;  // tokens of `sorted` under this node
    size_t depth;
  };
  std::vector<Span> nodes = {{0, sorted.size(), 0}};
  first.clear();
  edge_byte.clear();
  edge_child.clear();
  token_first.clear();
  tokens.clear();
  range_first.clear();
  range_end.clear();
  deepest_unsafe.clear();
  sorted_ids.clear();
  safe_from.clear();
  for (const auto& [bytes, id] : sorted) {
    sorted_ids.push_back(id);
    // the smallest start whose rest is safe (the empty rest is): a safe rest may start again past a
    // character cut in two, so every start is tried
    uint32_t from = static_cast<uint32_t>(bytes.size());
    for (uint32_t d = from; d > 0; --d) {
      if (safe_in_free_string(bytes.substr(d - 1))) from = d - 1;
    }
    safe_from.push_back(from);
  }
  for (size_t n = 0; n < nodes.size(); ++n) {
    const Span span = nodes[n];
    first.push_back(static_cast<uint32_t>(edge_byte.size()));
    token_first.push_back(static_cast<uint32_t>(tokens.size()));
    range_first.push_back(static_cast<uint32_t>(span.begin));
    range_end.push_back(static_cast<uint32_t>(span.end));
    deepest_unsafe.push_back(span.begin == span.end ? 0 : *std::max_element(safe_from.begin() + static_cast<long>(span.begin),
                                                                            safe_from.begin() + static_cast<long>(span.end)));
    size_t i = span.begin;
    while (i < span.end && sorted[i].first.size() == span.depth) tokens.push_back(sorted[i++].second);
    while (i < span.end) {
      const char b = sorted[i].first[span.depth];
      size_t j = i;
      while (j < span.end && sorted[j].first[span.depth] == b) ++j;
      edge_byte.push_back(static_cast<uint8_t>(b));
      edge_child.push_back(static_cast<uint32_t>(nodes.size()));
      nodes.push_back({i, j, span.depth + 1});
      i = j;
    }
  }
  first.push_back(static_cast<uint32_t>(edge_byte.size()));
  token_first.push_back(static_cast<uint32_t>(tokens.size()));
}

GrammarVocabulary::GrammarVocabulary(const Tokenizer& tokenizer, int32_t vocab)
    : vocab_(vocab), bytes_(static_cast<size_t>(vocab)), free_string_safe_((static_cast<size_t>(vocab) + 63) / 64, 0) {
  std::vector<std::pair<std::string, int32_t>> all, outside;
  const int32_t known = std::min(vocab, tokenizer.vocab_size());
  for (int32_t id = 0; id < known; ++id) {
    if (tokenizer.is_special(id)) continue;
    std::string b = tokenizer.token_bytes(id);
    if (b.empty()) continue;
    if (safe_in_free_string(b)) {
      set_bit(free_string_safe_, id);
    } else {
      outside.emplace_back(b, id);
    }
    longest_ = std::max(longest_, b.size());
    all.emplace_back(b, id);
    bytes_[static_cast<size_t>(id)] = std::move(b);
  }
  std::sort(all.begin(), all.end());
  std::sort(outside.begin(), outside.end());
  all_.build(all);
  outside_free_strings_.build(outside);
}

void GrammarVocabulary::walk(const Trie& trie, uint32_t node, size_t depth, bool in_string,
                             std::vector<uint64_t>& allowed) const {
  for (uint32_t e = trie.first[node]; e < trie.first[node + 1]; ++e) {
    GrammarMatcher& next = levels_[depth + 1];
    next = levels_[depth];
    if (!next.feed(trie.edge_byte[e])) continue;
    const uint32_t child = trie.edge_child[e];
    for (uint32_t t = trie.token_first[child]; t < trie.token_first[child + 1]; ++t) set_bit(allowed, trie.tokens[t]);
    const bool free = next.in_free_string();
    const auto here = static_cast<uint32_t>(depth + 1);
    if (free && !in_string) {  // the branch enters a string: what is safe from here on stays in it
      for (uint32_t i = trie.range_first[child]; i < trie.range_end[child]; ++i) {
        if (trie.safe_from[i] <= here) set_bit(allowed, trie.sorted_ids[i]);
      }
    } else if (free) {  // still in it: only the tokens safe from exactly here are new
      for (uint32_t i = trie.range_first[child]; i < trie.range_end[child]; ++i) {
        if (trie.safe_from[i] == here) set_bit(allowed, trie.sorted_ids[i]);
      }
    }
    if (trie.first[child] < trie.first[child + 1] && (!free || trie.deepest_unsafe[child] > here)) {
      walk(trie, child, depth + 1, free, allowed);
    }
  }
}

void GrammarVocabulary::allowed(const GrammarMatcher& m, int32_t end_token, std::vector<uint64_t>& allowed) const {
  allowed.assign(free_string_safe_.size(), 0);
  if (levels_.size() < longest_ + 1) levels_.assign(longest_ + 1, m);  // one per byte of the longest token
  levels_[0] = m;
  if (m.in_free_string()) {
    allowed = free_string_safe_;
    walk(outside_free_strings_, 0, 0, true, allowed);
  } else if (!m.finished()) {
    walk(all_, 0, 0, false, allowed);
  }
  if (m.complete() && end_token >= 0 && end_token < vocab_) set_bit(allowed, end_token);
}

}  // namespace dsv41
