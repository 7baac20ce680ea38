// The tokenizer.json of a generated checkpoint: the layout of DeepSeek's tokenizer (special tokens at
// the ids the config names, the V3 pre-tokenizer regex sequence, byte-level BPE with "a b" merges),
// with merges learned from a small built-in English text so that real prompts tokenize sensibly, or
// from a corpus.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace dsv41 {

// Special tokens written after the learned vocabulary, in this order.
const std::vector<std::string>& tiny_special_tokens();

// Builds tokenizer.json for exactly `vocab_size` ids: 0..2 are BOS, EOS and pad, then the 256 byte
// tokens, then learned merges, then reserved fillers if the text runs out of pairs, then the chat
// specials. Throws Error if vocab_size cannot hold the fixed tokens.
nlohmann::json build_tiny_tokenizer(int64_t vocab_size);

// The same layout with merges learned from `training_text` (`dsv41 tokenizer train`). The ids of the
// fixed tokens depend only on vocab_size, so tiny_special_id() holds for these tokenizers too.
nlohmann::json build_bpe_tokenizer(int64_t vocab_size, std::string_view training_text);

// build_tiny_tokenizer's layout whose Engram compressed vocabulary (text/engram_token_map.h) has
// exactly `engram_compressed_size` ids: the last reserved fillers are renamed to upper-case forms of
// earlier ones, which normalise alike. For a checkpoint with a config's Engram geometry but not its
// tokenizer (make-tiny --preset released-sparse). Error when the fillers cannot reach that size.
nlohmann::json build_tiny_tokenizer_for_engram(int64_t vocab_size, int64_t engram_compressed_size);

// The id of a special token in a tokenizer built by build_tiny_tokenizer.
int64_t tiny_special_id(int64_t vocab_size, const std::string& token);

}  // namespace dsv41
