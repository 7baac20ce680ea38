// The tokens a grammar allows next (text/json_grammar.h), for the sampler to keep: a trie over the
// vocabulary's byte strings walked from the matcher's state, each branch ended at the first byte the
// grammar refuses, so the work follows the tokens that could still fit, not the vocabulary's size.
// Inside free text (a JSON string, a DSML parameter's raw text: most of an output's bytes) what is
// left of a token either cannot leave or break the text ("safe": for a JSON string no quote,
// backslash or control byte; for raw text no '<' and no control but newline and tab; whole UTF-8
// characters) or must be walked: at the root a bitset allows the safe tokens at once and a second
// trie holds the others, and a branch that enters free text allows the tokens whose rest is safe
// from there without walking them.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "text/json_grammar.h"
#include "text/tokenizer.h"

namespace dsv41 {

class GrammarVocabulary {
 public:
  // `vocab`: the logits' width (ids past the tokenizer's are never allowed). Special tokens are never
  // allowed by a grammar, except those in `special_bytes`, read as the bytes given (the DSML marker
  // as kDsmlMarkerByte; ordinary tokens holding that byte, which no UTF-8 text has, never are); the
  // end comes as `end_token` (allowed()).
  GrammarVocabulary(const Tokenizer& tokenizer, int32_t vocab,
                    const std::vector<std::pair<int32_t, std::string>>& special_bytes = {});

  int32_t vocab() const { return vocab_; }
  // The matchers a walk keeps, one per byte of a branch: each caller of allowed() at a time brings
  // its own, and reuses it.
  using Scratch = std::vector<GrammarMatcher>;
  // Sets `allowed` (vocab bits, 64 per word) to the tokens `m` allows next; `end_token` is allowed
  // when what `m` read is a whole value. Safe from several threads, each with its scratch.
  void allowed(const GrammarMatcher& m, int32_t end_token, std::vector<uint64_t>& allowed, Scratch& scratch) const;
  void allowed(const GrammarMatcher& m, int32_t end_token, std::vector<uint64_t>& allowed) const {
    Scratch scratch;
    this->allowed(m, end_token, allowed, scratch);
  }
  // The bytes a token stands for here (empty for special and unknown ids).
  const std::string& bytes(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }

 private:
  static constexpr int kTexts = 2;  // the free texts: 0 a JSON string, 1 raw text
  struct Trie {
    // node n's children are edges [first[n], first[n + 1]) of (byte, child), sorted by byte; the
    // tokens that end at a node are tokens[token_first[n] .. token_first[n + 1]); its subtree is
    // sorted positions [range_first[n], range_end[n]), position i being the token sorted_ids[i],
    // whose bytes from safe_from[t][i] on are safe in free text t; deepest_unsafe[t][n] is the
    // largest of those under n (from there on nothing under n needs walking)
    std::vector<uint32_t> first;
    std::vector<uint8_t> edge_byte;
    std::vector<uint32_t> edge_child;
    std::vector<uint32_t> token_first;
    std::vector<int32_t> tokens;
    std::vector<uint32_t> range_first, range_end;
    std::vector<int32_t> sorted_ids;
    std::vector<uint32_t> safe_from[kTexts], deepest_unsafe[kTexts];
    void build(const std::vector<std::pair<std::string, int32_t>>& sorted_tokens);
  };
  // `text`: the free text the matcher was in before this node's bytes (-1: none), whose safe tokens
  // from this depth on are already allowed.
  void walk(const Trie& trie, uint32_t node, size_t depth, int text, std::vector<uint64_t>& allowed, Scratch& levels) const;

  int32_t vocab_ = 0;
  std::vector<std::string> bytes_;
  Trie all_;
  Trie outside_[kTexts];                // the tokens not safe in each free text
  std::vector<uint64_t> safe_[kTexts];  // the tokens safe in it
  size_t longest_ = 0;                  // bytes of the longest token
};

}  // namespace dsv41
