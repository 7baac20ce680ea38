#include "text/grammar_mask.h"

#include <algorithm>

namespace dsv41 {
namespace {

// Whether `s`, inside free text `text` (0 a JSON string, 1 raw text), keeps it free: whole UTF-8
// characters and none of the text's own bytes.
bool safe_in(int text, const std::string& s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<uint8_t>(s[i]);
    size_t len = 1;
    if (text == 0 && (b < 0x20 || b == '"' || b == '\\')) return false;
    if (text == 1 && ((b < 0x20 && b != '\n' && b != '\t') || b == '<')) return false;
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

int text_index(GrammarMatcher::FreeText t) {
  return t == GrammarMatcher::FreeText::JsonString ? 0 : t == GrammarMatcher::FreeText::Raw ? 1 : -1;
}

}  // namespace

void GrammarVocabulary::Trie::build(const std::vector<std::pair<std::string, int32_t>>& sorted) {
  // Nodes are made breadth-first so each node's edges are contiguous: the distinct prefixes of every
  // length, in sorted order (a sorted list's tokens with a common prefix are adjacent).
  struct Span {
    size_t begin, end;  // tokens of `sorted` under this node
    size_t depth;
  };
  *this = Trie{};
  for (const auto& [bytes, id] : sorted) {
    sorted_ids.push_back(id);
    for (int t = 0; t < kTexts; ++t) {
      // the smallest start whose rest is safe (the empty rest is): a safe rest may start again past
      // a character cut in two, so every start is tried
      uint32_t from = static_cast<uint32_t>(bytes.size());
      for (uint32_t d = from; d > 0; --d) {
        if (safe_in(t, bytes.substr(d - 1))) from = d - 1;
      }
      safe_from[t].push_back(from);
    }
  }
  std::vector<Span> nodes = {{0, sorted.size(), 0}};
  for (size_t n = 0; n < nodes.size(); ++n) {
    const Span span = nodes[n];
    first.push_back(static_cast<uint32_t>(edge_byte.size()));
    token_first.push_back(static_cast<uint32_t>(tokens.size()));
    range_first.push_back(static_cast<uint32_t>(span.begin));
    range_end.push_back(static_cast<uint32_t>(span.end));
    for (int t = 0; t < kTexts; ++t) {
      deepest_unsafe[t].push_back(span.begin == span.end
                                      ? 0
                                      : *std::max_element(safe_from[t].begin() + static_cast<long>(span.begin),
                                                          safe_from[t].begin() + static_cast<long>(span.end)));
    }
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

GrammarVocabulary::GrammarVocabulary(const Tokenizer& tokenizer, int32_t vocab,
                                     const std::vector<std::pair<int32_t, std::string>>& special_bytes)
    : vocab_(vocab), bytes_(static_cast<size_t>(vocab)) {
  const int32_t known = std::min(vocab, tokenizer.vocab_size());
  for (int32_t id = 0; id < known; ++id) {
    if (tokenizer.is_special(id)) continue;
    std::string b = tokenizer.token_bytes(id);
    // the marker's byte is never text (UTF-8 has no 0xFF): a byte token holding it must not pass for it
    if (b.find(kDsmlMarkerByte) == std::string::npos) bytes_[static_cast<size_t>(id)] = std::move(b);
  }
  for (const auto& [id, b] : special_bytes) {
    if (id >= 0 && id < vocab) bytes_[static_cast<size_t>(id)] = b;
  }
  std::vector<std::pair<std::string, int32_t>> all, outside[kTexts];
  for (int t = 0; t < kTexts; ++t) safe_[t].assign((static_cast<size_t>(vocab) + 63) / 64, 0);
  for (int32_t id = 0; id < vocab; ++id) {
    const std::string& b = bytes_[static_cast<size_t>(id)];
    if (b.empty()) continue;
    longest_ = std::max(longest_, b.size());
    all.emplace_back(b, id);
    for (int t = 0; t < kTexts; ++t) {
      if (safe_in(t, b)) {
        set_bit(safe_[t], id);
      } else {
        outside[t].emplace_back(b, id);
      }
    }
  }
  std::sort(all.begin(), all.end());
  all_.build(all);
  for (int t = 0; t < kTexts; ++t) {
    std::sort(outside[t].begin(), outside[t].end());
    outside_[t].build(outside[t]);
  }
}

void GrammarVocabulary::walk(const Trie& trie, uint32_t node, size_t depth, int text, std::vector<uint64_t>& allowed,
                             Scratch& levels) const {
  for (uint32_t e = trie.first[node]; e < trie.first[node + 1]; ++e) {
    GrammarMatcher& next = levels[depth + 1];
    next = levels[depth];
    if (!next.feed(trie.edge_byte[e])) continue;
    const uint32_t child = trie.edge_child[e];
    for (uint32_t t = trie.token_first[child]; t < trie.token_first[child + 1]; ++t) set_bit(allowed, trie.tokens[t]);
    const int now = text_index(next.free_text());
    const auto here = static_cast<uint32_t>(depth + 1);
    if (now >= 0) {
      // entering free text: what is safe from here on stays in it; still in it: only the tokens
      // safe from exactly here are new
      const std::vector<uint32_t>& from = trie.safe_from[now];
      for (uint32_t i = trie.range_first[child]; i < trie.range_end[child]; ++i) {
        if (now != text ? from[i] <= here : from[i] == here) set_bit(allowed, trie.sorted_ids[i]);
      }
    }
    if (trie.first[child] < trie.first[child + 1] && (now < 0 || trie.deepest_unsafe[now][child] > here)) {
      walk(trie, child, depth + 1, now, allowed, levels);
    }
  }
}

void GrammarVocabulary::allowed(const GrammarMatcher& m, int32_t end_token, std::vector<uint64_t>& allowed,
                                Scratch& levels) const {
  allowed.assign((static_cast<size_t>(vocab_) + 63) / 64, 0);
  if (levels.size() < longest_ + 1) levels.assign(longest_ + 1, m);  // one per byte of the longest token
  levels[0] = m;
  const int text = text_index(m.free_text());
  if (text >= 0) {
    allowed = safe_[text];
    walk(outside_[text], 0, 0, text, allowed, levels);
  } else if (!m.finished()) {
    walk(all_, 0, 0, -1, allowed, levels);
  }
  if (m.complete() && end_token >= 0 && end_token < vocab_) set_bit(allowed, end_token);
}

}  // namespace dsv41
