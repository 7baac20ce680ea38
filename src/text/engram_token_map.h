// Engram's compressed token map (model-spec §3.6): every token id is decoded alone and normalised
// (NFKC, NFD, strip accents, lowercase, collapse whitespace, strip), and ids whose text normalises
// alike share one compressed id. The n-gram hashes run over these ids, and the map's size fixes every
// hash multiplier, so it must equal the config's engram_compressed_vocab_size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace dsv41 {

struct EngramTokenMap {
  std::vector<int64_t> compressed;  // token id -> compressed id
  int64_t size = 0;                 // number of distinct compressed ids
};

// The normalisation applied to a token's decoded text (exposed for tests).
std::string engram_normalize(const std::string& utf8_text);

// Builds the map for token ids 0..vocab_size-1 from a parsed tokenizer.json (byte-level BPE: the
// model vocab plus added tokens). An id missing from the tokenizer decodes to the empty string.
EngramTokenMap build_engram_token_map(const nlohmann::json& tokenizer, int64_t vocab_size);

}  // namespace dsv41
