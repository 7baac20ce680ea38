// Byte-level BPE training: the merges a tokenizer.json of DeepSeek's layout carries, learned from a
// text. Used for the built-in tiny tokenizer and by `dsv41 tokenizer train` for a corpus.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dsv41 {

// Splits text into the pieces merges are learned within: an optional leading space plus a run of
// letters (bytes >= 0x80 count as letters), a run of digits, or a run of other non-space characters;
// newlines on their own. (An approximation of DeepSeek's pre-tokenizer regex: a merge learned across
// a boundary the regex draws would never apply, one learned within is always valid.)
std::vector<std::string> bpe_training_pieces(std::string_view text);

// Repeatedly merges the most frequent adjacent pair of symbols (byte-level token text, e.g. "Ġ" for
// a space) until `max_merges` are learned or no pair is left. Ties go to the pair whose (left, right)
// texts compare smallest, so the result is the same on every machine. Pair counts are updated only
// for the pieces a merge touches, so a corpus of millions of words trains in seconds.
std::vector<std::pair<std::string, std::string>> learn_bpe_merges(std::string_view text, size_t max_merges);

}  // namespace dsv41
