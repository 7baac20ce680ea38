// NumPy's generator and the Engram constants, checked against real NumPy run as a subprocess.
// /usr/bin/python3 must have NumPy (Debian python3-numpy); without it these tests fail, not skip,
// because the Engram multipliers are only defined by NumPy's output.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <iostream>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "io/engram_layout.h"
#include "numeric/numpy_random.h"

namespace dsv41 {
namespace {

// Runs `code` (NumPy already imported as np) with /usr/bin/python3 and returns its output.
// Throws, failing the test with the interpreter's message, if the script does not succeed.
std::string run_python(const std::string& code) {
  const std::string command = "/usr/bin/python3 - 2>&1 <<'DSV41_PY_EOF'\nimport numpy as np\n" + code +
                              "\nDSV41_PY_EOF\n";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("cannot start /usr/bin/python3");
  std::string out;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) out.append(buffer, n);
  if (pclose(pipe) != 0) {
    throw std::runtime_error(
        "/usr/bin/python3 with NumPy is required for this test (Debian: apt install python3-numpy); "
        "the script failed with:\n" + out);
  }
  return out;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The space-separated integers of one output line, read as T (int64_t or uint64_t).
template <typename T>
std::vector<T> parse_ints(const std::string& line) {
  std::vector<T> values;
  std::istringstream in(line);
  for (T v; in >> v;) values.push_back(v);
  return values;
}

template <typename T>
std::string python_list(const std::vector<T>& values) {
  std::string s = "[";
  for (const auto& v : values) s += std::to_string(v) + ",";
  return s + "]";
}

const std::vector<uint64_t> kSeeds = {0,
                                      1,
                                      42,
                                      10007,
                                      140098,
                                      (uint64_t{1} << 32) - 1,
                                      uint64_t{1} << 32,
                                      (uint64_t{1} << 32) + 5,
                                      0xDEADBEEFCAFEBABEULL,
                                      12345678901234567890ULL,
                                      uint64_t{std::numeric_limits<int64_t>::max()},
                                      std::numeric_limits<uint64_t>::max()};

TEST(NumpyRandom, PythonHasNumpy) {
  EXPECT_EQ(run_python("print('ok')"), "ok\n");
}

TEST(NumpyRandom, SeedSequenceMatchesNumpy) {
  const auto lines = split_lines(run_python(
      "for s in " + python_list(kSeeds) + ":\n"
      "    ss = np.random.SeedSequence(s)\n"
      "    print(*ss.generate_state(8, np.uint32))\n"
      "    print(*ss.generate_state(4, np.uint64))\n"));
  ASSERT_EQ(lines.size(), 2 * kSeeds.size());
  for (size_t i = 0; i < kSeeds.size(); ++i) {
    const NumpySeedSequence ss(kSeeds[i]);
    const auto u32 = ss.generate_state_u32(8);
    EXPECT_EQ(std::vector<uint64_t>(u32.begin(), u32.end()), parse_ints<uint64_t>(lines[2 * i]))
        << "seed " << kSeeds[i];
    EXPECT_EQ(ss.generate_state_u64(4), parse_ints<uint64_t>(lines[2 * i + 1])) << "seed " << kSeeds[i];
  }
}

TEST(NumpyRandom, Pcg64RawOutputMatchesNumpy) {
  constexpr size_t kCount = 16;
  const auto lines = split_lines(run_python("for s in " + python_list(kSeeds) + ":\n" +
                                            "    print(*np.random.PCG64(s).random_raw(" +
                                            std::to_string(kCount) + "))\n"));
  ASSERT_EQ(lines.size(), kSeeds.size());
  for (size_t i = 0; i < kSeeds.size(); ++i) {
    NumpyPcg64 rng(kSeeds[i]);
    std::vector<uint64_t> ours;
    for (size_t k = 0; k < kCount; ++k) ours.push_back(rng.next_u64());
    EXPECT_EQ(ours, parse_ints<uint64_t>(lines[i])) << "seed " << kSeeds[i];
  }
}

TEST(NumpyRandom, Next32SplitsOne64BitOutputLowHalfFirst) {
  NumpyPcg64 a(7), b(7);
  for (int k = 0; k < 4; ++k) {
    const uint64_t raw = a.next_u64();
    EXPECT_EQ(b.next_u32(), static_cast<uint32_t>(raw));
    EXPECT_EQ(b.next_u32(), static_cast<uint32_t>(raw >> 32));
  }
}

TEST(NumpyRandom, IntegersMatchNumpy) {
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const int64_t two32 = int64_t{1} << 32;
  // Spans exercise every NumPy path: no draw (span 0), 32-bit Lemire (with a 1/4 rejection rate at
  // 3*2^30), the plain 32-bit draw (span exactly 2^32 - 1), and 64-bit Lemire just above 2^32, at
  // the Engram bound, with a 1/4 rejection rate at 3*2^61, and over the whole int64 range.
  const std::vector<std::tuple<int64_t, int64_t, size_t>> cases = {
      {0, 10, 7},          {-5, 5, 9},        {1000, 1001, 3},   {0, 3 * (int64_t{1} << 30), 20},
      {0, two32 - 1, 5},   {0, two32, 5},     {-7, two32 - 7, 5}, {0, two32 + 1, 5},
      {0, kMax / 99092 / 2, 4}, {0, 3 * (int64_t{1} << 61), 20}, {0, kMax, 5}, {kMin, kMax, 5},
      {kMin, kMin + 2, 6},
  };
  std::string script = "cases = [";
  for (const auto& [low, high, size] : cases) {
    script += "(" + std::to_string(low) + "," + std::to_string(high) + "," + std::to_string(size) + "),";
  }
  script += "]\nfor s in " + python_list(kSeeds) + ":\n"
            "    for lo, hi, n in cases:\n"
            "        print(*np.random.default_rng(s).integers(lo, hi, size=n, dtype=np.int64))\n";
  const auto lines = split_lines(run_python(script));
  ASSERT_EQ(lines.size(), kSeeds.size() * cases.size());
  size_t line = 0;
  for (uint64_t seed : kSeeds) {
    for (const auto& [low, high, size] : cases) {
      NumpyPcg64 rng(seed);
      EXPECT_EQ(numpy_integers(rng, low, high, size), parse_ints<int64_t>(lines[line++]))
          << "seed " << seed << " integers(" << low << ", " << high << ", " << size << ")";
    }
  }
}

TEST(NumpyRandom, BufferedWordCarriesAcrossCallsLikeNumpy) {
  // NumPy keeps the unused half of a 64-bit output inside the bit generator, so it survives between
  // integers() calls and across 64-bit draws; a fresh buffer per call would shift the stream.
  const std::string py =
      "g = np.random.default_rng(140098)\n"
      "print(*g.integers(0, 10, size=3, dtype=np.int64))\n"
      "print(*g.integers(0, 2**40, size=2, dtype=np.int64))\n"
      "print(*g.bit_generator.random_raw(2))\n"
      "print(*g.integers(0, 10, size=3, dtype=np.int64))\n"
      "print(*g.integers(0, 2**32, size=3, dtype=np.int64))\n";
  const auto lines = split_lines(run_python(py));
  ASSERT_EQ(lines.size(), 5u);
  NumpyPcg64 rng(140098);
  EXPECT_EQ(numpy_integers(rng, 0, 10, 3), parse_ints<int64_t>(lines[0]));
  EXPECT_EQ(numpy_integers(rng, 0, int64_t{1} << 40, 2), parse_ints<int64_t>(lines[1]));
  const uint64_t raw0 = rng.next_u64();
  const uint64_t raw1 = rng.next_u64();
  EXPECT_EQ((std::vector<uint64_t>{raw0, raw1}), parse_ints<uint64_t>(lines[2]));
  EXPECT_EQ(numpy_integers(rng, 0, 10, 3), parse_ints<int64_t>(lines[3]));
  EXPECT_EQ(numpy_integers(rng, 0, int64_t{1} << 32, 3), parse_ints<int64_t>(lines[4]));
}

TEST(NumpyRandom, EmptyRangeThrows) {
  NumpyPcg64 rng(0);
  EXPECT_THROW(numpy_integers(rng, 5, 5, 1), std::invalid_argument);
  EXPECT_THROW(numpy_integers(rng, 6, 5, 1), std::invalid_argument);
  EXPECT_TRUE(numpy_integers(rng, 0, 5, 0).empty());
}

// The reference's formula, verbatim in NumPy, for the given layers and compressed vocab.
std::vector<std::vector<int64_t>> numpy_multipliers(const std::vector<int>& layers, int max_ngram,
                                                    int64_t compressed) {
  const auto lines = split_lines(run_python(
      "B = max(1, (np.iinfo(np.int64).max // " + std::to_string(compressed) + ") // 2)\n"
      "for layer in " + python_list(layers) + ":\n"
      "    rng = np.random.default_rng(10007 * layer)\n"
      "    print(*(rng.integers(0, B, size=" + std::to_string(max_ngram) + ", dtype=np.int64) * 2 + 1))\n"));
  std::vector<std::vector<int64_t>> rows;
  for (const auto& line : lines) rows.push_back(parse_ints<int64_t>(line));
  return rows;
}

TEST(EngramLayout, MultipliersMatchNumpyFormula) {
  const std::vector<int> released = {1, 14};
  const auto layout = engram_layout(released, 4, 16000000, 8, 99092);
  const auto expected = numpy_multipliers(released, 4, 99092);
  ASSERT_EQ(layout.size(), 2u);
  ASSERT_EQ(expected.size(), 2u);
  for (size_t i = 0; i < layout.size(); ++i) {
    EXPECT_EQ(layout[i].multipliers, expected[i]) << "layer " << released[i];
    std::cout << "released multipliers, layer " << layout[i].layer << ":";
    for (int64_t m : layout[i].multipliers) std::cout << " " << m;
    std::cout << "\n";
  }

  const std::vector<int> tiny = {0, 1};
  const auto tiny_layout = engram_layout(tiny, 4, 100, 2, 256);
  const auto tiny_expected = numpy_multipliers(tiny, 4, 256);
  ASSERT_EQ(tiny_expected.size(), 2u);
  for (size_t i = 0; i < tiny_layout.size(); ++i) {
    EXPECT_EQ(tiny_layout[i].multipliers, tiny_expected[i]) << "tiny layer " << tiny[i];
  }
}

void expect_exclusive_offsets(const EngramLayerConstants& c) {
  ASSERT_EQ(c.offsets.size(), c.primes.size());
  int64_t sum = 0;
  for (size_t k = 0; k < c.primes.size(); ++k) {
    EXPECT_EQ(c.offsets[k], sum) << "layer " << c.layer << " column " << k;
    sum += c.primes[k];
  }
  EXPECT_EQ(c.rows, sum);
}

TEST(EngramLayout, ReleasedConfigRowsAndPrimes) {
  const auto layout = engram_layout({1, 14}, 4, 16000000, 8, 99092);
  ASSERT_EQ(layout.size(), 2u);
  EXPECT_EQ(layout[0].layer, 1);
  EXPECT_EQ(layout[1].layer, 14);
  EXPECT_EQ(layout[0].rows, 384006168);
  EXPECT_EQ(layout[1].rows, 384016682);
  std::set<int64_t> all;
  for (const auto& c : layout) {
    ASSERT_EQ(c.primes.size(), 24u);
    EXPECT_EQ(c.multipliers.size(), 4u);
    for (int64_t m : c.multipliers) EXPECT_EQ(m % 2, 1) << "multipliers are odd";
    for (int64_t p : c.primes) {
      EXPECT_GT(p, 16000000);
      EXPECT_TRUE(is_prime_u64(static_cast<uint64_t>(p)));
      all.insert(p);
    }
    expect_exclusive_offsets(c);
  }
  EXPECT_EQ(all.size(), 48u) << "primes are unique across layers";
}

TEST(EngramLayout, TinyGoldenConfig) {
  const auto layout = engram_layout({0, 1}, 4, 100, 2, 256);
  ASSERT_EQ(layout.size(), 2u);
  EXPECT_EQ(layout[0].primes, (std::vector<int64_t>{101, 103, 107, 109, 113, 127}));
  EXPECT_EQ(layout[0].offsets, (std::vector<int64_t>{0, 101, 204, 311, 420, 533}));
  EXPECT_EQ(layout[0].rows, 660);
  EXPECT_EQ(layout[1].primes, (std::vector<int64_t>{131, 137, 139, 149, 151, 157}));
  EXPECT_EQ(layout[1].rows, 864);
  for (const auto& c : layout) expect_exclusive_offsets(c);
}

TEST(EngramLayout, RejectsBadArguments) {
  EXPECT_THROW(engram_layout({1}, 1, 100, 2, 256), std::invalid_argument);
  EXPECT_THROW(engram_layout({1}, 4, 100, 0, 256), std::invalid_argument);
  EXPECT_THROW(engram_layout({1}, 4, 100, 2, 0), std::invalid_argument);
  EXPECT_THROW(engram_layout({-1}, 4, 100, 2, 256), std::invalid_argument);
  EXPECT_TRUE(engram_layout({}, 4, 100, 2, 256).empty());
}

TEST(EngramLayout, IsPrimeMatchesSieveAndKnownValues) {
  constexpr size_t kLimit = 1000000;
  std::vector<bool> prime(kLimit + 1, true);
  prime[0] = prime[1] = false;
  for (size_t i = 2; i * i <= kLimit; ++i) {
    if (prime[i]) {
      for (size_t j = i * i; j <= kLimit; j += i) prime[j] = false;
    }
  }
  for (size_t n = 0; n <= kLimit; ++n) ASSERT_EQ(is_prime_u64(n), prime[n]) << n;

  for (uint64_t p : {1000000007ULL, 4294967291ULL, 4294967311ULL, 999999999989ULL,
                     2305843009213693951ULL /* 2^61 - 1 */, 18446744073709551557ULL /* largest 64-bit */}) {
    EXPECT_TRUE(is_prime_u64(p)) << p;
  }
  // Strong pseudoprimes to several small bases, a Carmichael number, a prime square and 2^64 - 1.
  for (uint64_t c : {3215031751ULL, 4759123141ULL, 1122004669633ULL, 3825123056546413051ULL, 561ULL,
                     18446744030759878681ULL /* 4294967291^2 */, 18446744073709551615ULL}) {
    EXPECT_FALSE(is_prime_u64(c)) << c;
  }
}

}  // namespace
}  // namespace dsv41
