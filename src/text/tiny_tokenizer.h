// The tokenizer.json of a generated checkpoint: the layout of DeepSeek's tokenizer (special tokens at
// the ids the config names, the V3 pre-tokenizer regex sequence, byte-level BPE with "a b" merges),
// with merges learned from a small built-in English text so that real prompts tokenize sensibly.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace dsv41 {

// Special tokens written after the learned vocabulary, in this order.
const std::vector<std::string>& tiny_special_tokens();

// Builds tokenizer.json for exactly `vocab_size` ids: 0..2 are BOS, EOS and pad, then the 256 byte
// tokens, then learned merges, then reserved fillers if the text runs out of pairs, then the chat
// specials. Throws Error if vocab_size cannot hold the fixed tokens.
nlohmann::json build_tiny_tokenizer(int64_t vocab_size);

// The id of a special token in a tokenizer built by build_tiny_tokenizer.
int64_t tiny_special_id(int64_t vocab_size, const std::string& token);

}  // namespace dsv41
