// The prompts the prompt cache's tests send: seeded token ids, and a prompt grown by more of them.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace dsv41::test {

// n token ids below 1000 from `seed`.
inline std::vector<int32_t> ids(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<int32_t>(rng() % 1000);
  return v;
}

inline std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace dsv41::test
