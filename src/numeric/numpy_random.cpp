#include "numeric/numpy_random.h"

#include <limits>
#include <stdexcept>

namespace dsv41 {

namespace {

// SeedSequence's hashing constants (NumPy bit_generator.pyx). All arithmetic is on uint32 words and
// wraps modulo 2^32, which is what NumPy's uint32 arrays do.
constexpr uint32_t kInitA = 0x43b0d7e5;
constexpr uint32_t kMultA = 0x931e8875;
constexpr uint32_t kInitB = 0x8b51f9dd;
constexpr uint32_t kMultB = 0x58f38ded;
constexpr uint32_t kMixMultL = 0xca01f9dd;
constexpr uint32_t kMixMultR = 0x4973f715;
constexpr int kXShift = 16;  // half the bit width of a word

// Hashes one word; `hash_const` is a running multiplier shared by all calls of one mixing pass.
uint32_t hashmix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> kXShift;
  return value;
}

uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t result = kMixMultL * x - kMixMultR * y;
  result ^= result >> kXShift;
  return result;
}

}  // namespace

NumpySeedSequence::NumpySeedSequence(uint64_t seed) {
  // NumPy turns a Python int into little-endian uint32 words; zero is the single word [0].
  std::vector<uint32_t> entropy;
  do {
    entropy.push_back(static_cast<uint32_t>(seed));
    seed >>= 32;
  } while (seed != 0);

  const size_t n = pool_.size();
  uint32_t hash_const = kInitA;
  // Fill the pool (missing entropy words hash as zero), then let every pool word mix into every
  // other, then fold in any entropy beyond the pool size (impossible for a 64-bit seed, kept so the
  // routine reads like NumPy's general case).
  for (size_t i = 0; i < n; ++i) pool_[i] = hashmix(i < entropy.size() ? entropy[i] : 0, hash_const);
  for (size_t src = 0; src < n; ++src) {
    for (size_t dst = 0; dst < n; ++dst) {
      if (src != dst) pool_[dst] = mix(pool_[dst], hashmix(pool_[src], hash_const));
    }
  }
  for (size_t src = n; src < entropy.size(); ++src) {
    for (size_t dst = 0; dst < n; ++dst) pool_[dst] = mix(pool_[dst], hashmix(entropy[src], hash_const));
  }
}

std::vector<uint32_t> NumpySeedSequence::generate_state_u32(size_t n) const {
  std::vector<uint32_t> state(n);
  uint32_t hash_const = kInitB;
  for (size_t i = 0; i < n; ++i) {
    uint32_t value = pool_[i % pool_.size()];  // cycles through the pool
    value ^= hash_const;
    hash_const *= kMultB;
    value *= hash_const;
    value ^= value >> kXShift;
    state[i] = value;
  }
  return state;
}

std::vector<uint64_t> NumpySeedSequence::generate_state_u64(size_t n) const {
  const std::vector<uint32_t> words = generate_state_u32(2 * n);
  std::vector<uint64_t> state(n);
  for (size_t i = 0; i < n; ++i) state[i] = (uint64_t{words[2 * i + 1]} << 32) | words[2 * i];
  return state;
}

namespace {

// PCG's default 128-bit LCG multiplier, 0x2360ED051FC65DA4'4385DF649FCCF645.
__extension__ typedef unsigned __int128 u128;
constexpr u128 kPcgMultiplier = (u128{0x2360ED051FC65DA4ULL} << 64) | 0x4385DF649FCCF645ULL;

}  // namespace

NumpyPcg64::NumpyPcg64(uint64_t seed) {
  // PCG64 draws four uint64 words from SeedSequence: words 0,1 (high, low) are the initial state and
  // words 2,3 (high, low) select the stream. The increment must be odd, hence (stream << 1) | 1.
  // Standard PCG seeding: step once from zero, add the initial state, step again.
  const std::vector<uint64_t> words = NumpySeedSequence(seed).generate_state_u64(4);
  const u128 init_state = (u128{words[0]} << 64) | words[1];
  const u128 stream = (u128{words[2]} << 64) | words[3];
  inc_ = (stream << 1) | 1;
  state_ = 0;
  state_ = state_ * kPcgMultiplier + inc_;
  state_ += init_state;
  state_ = state_ * kPcgMultiplier + inc_;
}

uint64_t NumpyPcg64::next_u64() {
  // Advance first, then output from the new state: XOR the two halves, rotate right by the top 6 bits.
  state_ = state_ * kPcgMultiplier + inc_;
  const uint64_t xored = static_cast<uint64_t>(state_ >> 64) ^ static_cast<uint64_t>(state_);
  const unsigned rot = static_cast<unsigned>(state_ >> 122);
  return (xored >> rot) | (xored << ((64 - rot) & 63));
}

uint32_t NumpyPcg64::next_u32() {
  if (has_u32_) {
    has_u32_ = false;
    return u32_;
  }
  const uint64_t next = next_u64();
  has_u32_ = true;
  u32_ = static_cast<uint32_t>(next >> 32);
  return static_cast<uint32_t>(next);
}

namespace {

// A uniform value in [0, rng] for rng < 2^32 - 1, by Lemire's multiply-shift with rejection of the
// biased low products. The rejection threshold is only computed when a rejection is possible.
uint32_t bounded_lemire_u32(NumpyPcg64& gen, uint32_t rng) {
  const uint32_t rng_excl = rng + 1;
  uint64_t m = uint64_t{gen.next_u32()} * rng_excl;
  uint32_t leftover = static_cast<uint32_t>(m);
  if (leftover < rng_excl) {
    const uint32_t threshold = (std::numeric_limits<uint32_t>::max() - rng) % rng_excl;
    while (leftover < threshold) {
      m = uint64_t{gen.next_u32()} * rng_excl;
      leftover = static_cast<uint32_t>(m);
    }
  }
  return static_cast<uint32_t>(m >> 32);
}

// The same for 64-bit ranges, rng < 2^64 - 1, with a 128-bit product.
uint64_t bounded_lemire_u64(NumpyPcg64& gen, uint64_t rng) {
  const uint64_t rng_excl = rng + 1;
  u128 m = u128{gen.next_u64()} * rng_excl;
  uint64_t leftover = static_cast<uint64_t>(m);
  if (leftover < rng_excl) {
    const uint64_t threshold = (std::numeric_limits<uint64_t>::max() - rng) % rng_excl;
    while (leftover < threshold) {
      m = u128{gen.next_u64()} * rng_excl;
      leftover = static_cast<uint64_t>(m);
    }
  }
  return static_cast<uint64_t>(m >> 64);
}

}  // namespace

std::vector<int64_t> numpy_integers(NumpyPcg64& rng, int64_t low, int64_t high, size_t size) {
  if (low >= high) throw std::invalid_argument("numpy_integers: low >= high");
  // NumPy samples an offset in [0, span] with span = (high - 1) - low, computed in uint64 so that
  // the full int64 range does not overflow; the result wraps back into int64.
  const uint64_t off = static_cast<uint64_t>(low);
  const uint64_t span = static_cast<uint64_t>(high) - 1 - off;
  std::vector<int64_t> out(size);
  for (auto& value : out) {
    uint64_t draw;
    // NumPy picks the narrowest method that covers the span, and each consumes the bit stream
    // differently, so the choice is part of the result. span == 2^64 - 1 (a raw draw) cannot occur
    // with an exclusive int64 upper bound.
    if (span == 0) {
      draw = 0;  // no draw at all
    } else if (span == std::numeric_limits<uint32_t>::max()) {
      draw = rng.next_u32();  // the full 32-bit range: a plain buffered 32-bit draw
    } else if (span < std::numeric_limits<uint32_t>::max()) {
      draw = bounded_lemire_u32(rng, static_cast<uint32_t>(span));
    } else {
      draw = bounded_lemire_u64(rng, span);
    }
    value = static_cast<int64_t>(off + draw);
  }
  return out;
}

}  // namespace dsv41
