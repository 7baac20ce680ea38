// Engram (model-spec §3.6): n-gram hashes of the compressed token ids select FP8 table rows, which
// `wkv` turns into one key per stream copy and a shared value, written into the residual stream
// through a per-copy signed-sqrt sigmoid gate before the Engram layer's block.
#pragma once

#include <cstdint>
#include <vector>

#include "io/config.h"
#include "io/engram_layout.h"
#include "kernels/backend.h"
#include "model/weights.h"
#include "text/engram_token_map.h"

namespace dsv41 {

// The compressed id of an image-span position (vision-spec §6.4): every n-gram that would reach it
// takes the pad id from there on, as one that reaches before the sequence's start does.
constexpr int64_t kEngramDead = -1;

// Error naming tokenizer.json when `map` is not the one the config's Engram tables were hashed with
// (its compressed vocabulary's size fixes every hash multiplier).
void check_engram_token_map(const ModelConfig& config, const EngramTokenMap& map);

class EngramHasher {
 public:
  EngramHasher(const ModelConfig& config, EngramTokenMap map);
  // Compressed ids of `tokens`; throws Error for an id outside the vocabulary.
  std::vector<int64_t> compress(const std::vector<int32_t>& tokens) const;
  // Row ids for each token of a call, for Engram layer `slot`: [count, hash columns]. `recent` holds
  // the compressed ids of the max_ngram-1 tokens before the call (fewer at the start of a sequence).
  std::vector<int64_t> row_ids(int slot, const std::vector<int64_t>& recent,
                               const std::vector<int64_t>& compressed) const;
  int columns() const { return columns_; }
  int64_t pad() const { return pad_; }
  const std::vector<EngramLayerConstants>& layout() const { return layout_; }

 private:
  int max_ngram_ = 0, heads_ = 0, columns_ = 0;
  int64_t pad_ = 0;
  EngramTokenMap map_;
  std::vector<EngramLayerConstants> layout_;
};

// X: [count, hc, dim] residual stream (bf16 values), updated in place. `codes` and `scales` are the
// gathered table rows (count × hash columns of them) as EngramStore::gather returns them. span:
// [count], 1 at an image-span position, whose gate is 0 (null: none).
void engram_forward(const Backend& be, const ModelConfig& config, const EngramWeights& w, const uint8_t* codes,
                    const uint8_t* scales, int64_t count, const uint8_t* span, float* X);

}  // namespace dsv41
