// The Engram hash constants (model-spec §3.6): per Engram layer, the prime bucket sizes of every
// (n-gram order, head) pair, their row offsets in the layer's table, and the hash multipliers.
// Everything is derived from the config, exactly as the reference derives it, so no constant has
// to be shipped with the checkpoint.
#pragma once

#include <cstdint>
#include <vector>

namespace dsv41 {

struct EngramLayerConstants {
  int layer;                          // the backbone layer id the module runs before
  std::vector<int64_t> primes;        // [ngram2 h0..h(H-1), ngram3 h0.., ..., ngram_max ..]
  std::vector<int64_t> offsets;       // exclusive prefix sums of `primes`: offsets[0] = 0
  std::vector<int64_t> multipliers;   // max_ngram odd values, one per look-back shift 0..max_ngram-1
  int64_t rows;                       // sum of `primes`: the layer's table height
};

// Primes: one global set of used primes; for each layer in order and each n-gram order
// 2..max_ngram the search restarts at engram_vocab_size - 1 and each head takes the smallest unused
// prime above the previous one. Multipliers: numpy.random.default_rng(10007 * layer)
// .integers(0, B, size=max_ngram, dtype=int64) * 2 + 1 with B = max(1, (INT64_MAX // compressed)//2).
// Throws std::invalid_argument on a non-positive size or count, max_ngram < 2, or a negative layer.
std::vector<EngramLayerConstants> engram_layout(const std::vector<int>& layer_ids, int max_ngram,
                                                int64_t engram_vocab_size, int n_heads,
                                                int64_t compressed_vocab_size);

// Deterministic Miller-Rabin, exact for every 64-bit n.
bool is_prime_u64(uint64_t n);

}  // namespace dsv41
