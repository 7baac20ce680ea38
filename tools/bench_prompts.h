// Seeded random prompts for the bench scenarios: n token ids in [3, vocab), clear of the special ids
// every preset's vocabulary starts with.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace dsv41 {

inline std::vector<int32_t> random_prompt(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& t : v) t = static_cast<int32_t>(3 + rng() % static_cast<uint32_t>(vocab - 3));
  return v;
}

}  // namespace dsv41
