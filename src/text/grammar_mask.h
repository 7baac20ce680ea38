// The tokens a grammar allows next (text/json_grammar.h), for the sampler to keep: a trie over the
// vocabulary's byte strings walked from the matcher's state, each branch ended at the first byte the
// grammar refuses, so the work follows the tokens that could still fit, not the vocabulary's size.
// Inside a free string (most of a JSON value's bytes) what is left of a token either cannot leave or
// break the string (no quote, backslash or control byte, whole UTF-8 characters: "safe") or must be
// walked: at the root a bitset allows the safe tokens at once and a second trie holds the others, and
// a branch that enters a string allows its tokens whose rest is safe from there without walking them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "text/json_grammar.h"
#include "text/tokenizer.h"

namespace dsv41 {

class GrammarVocabulary {
 public:
  // `vocab`: the logits' width (ids past the tokenizer's are never allowed). Special tokens are never
  // allowed by a grammar: the end comes as `end_token` (allowed()).
  GrammarVocabulary(const Tokenizer& tokenizer, int32_t vocab);

  int32_t vocab() const { return vocab_; }
  // Sets `allowed` (vocab bits, 64 per word) to the tokens `m` allows next; `end_token` is allowed
  // when what `m` read is a whole value.
  void allowed(const GrammarMatcher& m, int32_t end_token, std::vector<uint64_t>& allowed) const;
  // The bytes of a token (empty for special and unknown ids).
  const std::string& bytes(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }

 private:
  struct Trie {
    // node n's children are edges [first[n], first[n + 1]) of (byte, child), sorted by byte; the
    // tokens that end at a node are tokens[token_first[n] .. token_first[n + 1])
    std::vector<uint32_t> first;
    std::vector<uint8_t> edge_byte;
    std::vector<uint32_t> edge_child;
    std::vector<uint32_t> token_first;
    std::vector<int32_t> tokens;
    // node n's subtree is sorted positions [range_first[n], range_end[n]); sorted position i is the
    // token sorted_ids[i], whose bytes from safe_from[i] on are safe in a free string;
    // deepest_unsafe[n]: the largest safe_from under n (past it, nothing under n needs walking)
    std::vector<uint32_t> range_first, range_end, deepest_unsafe;
    std::vector<int32_t> sorted_ids;
    std::vector<uint32_t> safe_from;
    void build(const std::vector<std::pair<std::string, int32_t>>& sorted_tokens);
  };
  // `in_string`: the matcher before this node's bytes was inside a free string, so the tokens safe
  // from this depth on are already allowed.
  void walk(const Trie& trie, uint32_t node, size_t depth, bool in_string, std::vector<uint64_t>& allowed) const;

  int32_t vocab_ = 0;
  std::vector<std::string> bytes_;
  Trie all_, outside_free_strings_;  // every token; the tokens not in free_string_safe_
  std::vector<uint64_t> free_string_safe_;
  size_t longest_ = 0;  // bytes of the longest token
  // The matcher after each byte of the branch being walked: allowed() has one caller at a time (the
  // engine's scheduler thread).
  mutable std::vector<GrammarMatcher> levels_;
};

}  // namespace dsv41
