// NumPy's default random generator, reproduced bit-exactly (model-spec §3.6).
// The Engram hash multipliers are defined as the output of
//   numpy.random.default_rng(seed).integers(low, high, size, dtype=numpy.int64)
// so the engine needs NumPy's exact stream, not just "a PCG64": SeedSequence's entropy mixing,
// PCG64's seeding from it, the buffered 32-bit draws, and the bounded-integer sampling (with its
// rejection step) must all match. Only what default_rng(int) and integers(..., endpoint=False)
// use is implemented: seeds are non-negative integers below 2^64, no spawn keys.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dsv41 {

// numpy.random.SeedSequence(seed) with the default pool size of 4 words.
class NumpySeedSequence {
 public:
  explicit NumpySeedSequence(uint64_t seed);

  // SeedSequence.generate_state(n, numpy.uint32).
  std::vector<uint32_t> generate_state_u32(size_t n) const;
  // SeedSequence.generate_state(n, numpy.uint64): 2n uint32 words, paired little-endian
  // (the even word is the low half), as NumPy views its uint32 array as uint64.
  std::vector<uint64_t> generate_state_u64(size_t n) const;

 private:
  std::array<uint32_t, 4> pool_{};
};

// numpy.random.PCG64(seed), i.e. the bit generator behind default_rng(seed):
// a 128-bit LCG with the XSL-RR 128->64 output function.
class NumpyPcg64 {
 public:
  explicit NumpyPcg64(uint64_t seed);

  // One raw 64-bit output (PCG64.random_raw()).
  uint64_t next_u64();
  // NumPy's 32-bit draw: the low half of a fresh 64-bit output, keeping the high half for the next
  // call. The kept half survives intervening next_u64() calls, exactly as in NumPy.
  uint32_t next_u32();

 private:
  // 128-bit arithmetic via the GCC/Clang extension; __extension__ keeps -Wpedantic quiet.
  __extension__ typedef unsigned __int128 u128;
  u128 state_ = 0;
  u128 inc_ = 0;
  bool has_u32_ = false;
  uint32_t u32_ = 0;
};

// Generator.integers(low, high, size, dtype=numpy.int64) with endpoint=False: `size` values in
// [low, high). Throws std::invalid_argument if low >= high (NumPy raises ValueError).
std::vector<int64_t> numpy_integers(NumpyPcg64& rng, int64_t low, int64_t high, size_t size);

}  // namespace dsv41
