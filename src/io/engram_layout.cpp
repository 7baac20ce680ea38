#include "io/engram_layout.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <unordered_set>
#include <utility>

#include "numeric/numpy_random.h"

namespace dsv41 {

namespace {

__extension__ typedef unsigned __int128 u128;  // exact 64x64-bit products for modular arithmetic

uint64_t mul_mod(uint64_t a, uint64_t b, uint64_t m) { return static_cast<uint64_t>(u128{a} * b % m); }

uint64_t pow_mod(uint64_t base, uint64_t exp, uint64_t m) {
  uint64_t result = 1;
  base %= m;
  for (; exp != 0; exp >>= 1) {
    if (exp & 1) result = mul_mod(result, base, m);
    base = mul_mod(base, base, m);
  }
  return result;
}

}  // namespace

bool is_prime_u64(uint64_t n) {
  // The first twelve primes as witnesses are known to decide primality for all n < 3.3e24, which
  // covers every 64-bit value; trial division by them also handles the small n directly.
  constexpr uint64_t kWitnesses[] = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37};
  if (n < 2) return false;
  for (uint64_t p : kWitnesses) {
    if (n % p == 0) return n == p;
  }
  uint64_t d = n - 1;
  int s = 0;
  while ((d & 1) == 0) {
    d >>= 1;
    ++s;
  }
  for (uint64_t a : kWitnesses) {
    uint64_t x = pow_mod(a, d, n);
    if (x == 1 || x == n - 1) continue;
    bool composite = true;
    for (int i = 1; i < s && composite; ++i) {
      x = mul_mod(x, x, n);
      composite = x != n - 1;
    }
    if (composite) return false;
  }
  return true;
}

std::vector<EngramLayerConstants> engram_layout(const std::vector<int>& layer_ids, int max_ngram,
                                                int64_t engram_vocab_size, int n_heads,
                                                int64_t compressed_vocab_size) {
  if (max_ngram < 2 || n_heads < 1 || engram_vocab_size < 1 || compressed_vocab_size < 1) {
    throw std::invalid_argument("engram_layout: need max_ngram >= 2 and positive heads and vocab sizes");
  }
  // Keeps every token_id * multiplier (token_id < compressed_vocab_size) inside int64.
  const int64_t bound =
      std::max<int64_t>(1, std::numeric_limits<int64_t>::max() / compressed_vocab_size / 2);

  std::unordered_set<int64_t> seen;  // primes are never reused, across layers too
  std::vector<EngramLayerConstants> layout;
  for (int layer : layer_ids) {
    if (layer < 0) throw std::invalid_argument("engram_layout: negative layer id");
    EngramLayerConstants c{layer, {}, {}, {}, 0};
    for (int order = 2; order <= max_ngram; ++order) {
      int64_t current = engram_vocab_size - 1;  // every n-gram order restarts the search here
      for (int head = 0; head < n_heads; ++head) {
        do {
          ++current;
        } while (!is_prime_u64(static_cast<uint64_t>(current)) || seen.count(current) != 0);
        seen.insert(current);
        c.offsets.push_back(c.rows);  // exclusive: the offset before this prime is added
        c.primes.push_back(current);
        c.rows += current;
      }
    }
    NumpyPcg64 rng(10007 * static_cast<uint64_t>(layer));
    for (int64_t v : numpy_integers(rng, 0, bound, static_cast<size_t>(max_ngram))) {
      c.multipliers.push_back(v * 2 + 1);
    }
    layout.push_back(std::move(c));
  }
  return layout;
}

}  // namespace dsv41
