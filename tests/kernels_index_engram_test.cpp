// The fast indexer scores and the fast Engram row dequantization against their scalar references,
// bit for bit, at every ISA level this machine has.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu_features.h"
#include "kernels/engram_rows.h"
#include "kernels/index_score.h"
#include "kernels/thread_pool.h"
#include "numeric/formats.h"
#include "numeric/quant.h"
#include "numeric/row_codecs.h"

namespace {

using namespace dsv41;

using IndexScoreFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, const uint8_t* const*, int64_t,
                              const int64_t*, float*);
using DequantFn = void (*)(const uint8_t*, const uint8_t*, int64_t, float*);

struct Level {
  Isa isa;
  IndexScoreFn scores;
  DequantFn dequant;
};

// The fast levels this machine can run (none without AVX2: the comparisons then have nothing to do).
std::vector<Level> levels() {
  std::vector<Level> out;
  if (isa_supported(Isa::avx2)) {
    out.push_back({Isa::avx2, detail::index_scores_avx2, detail::dequantize_fp8_blocks_avx2});
  }
  if (isa_supported(Isa::avx512)) {
    out.push_back({Isa::avx512, detail::index_scores_avx512, detail::dequantize_fp8_blocks_avx512});
  }
  return out;
}

// Sets the global pool's size for one scope, then restores it.
class PoolThreads {
 public:
  explicit PoolThreads(int n) : saved_(ThreadPool::global().threads()) { ThreadPool::global().resize(n); }
  ~PoolThreads() { ThreadPool::global().resize(saved_); }
  PoolThreads(const PoolThreads&) = delete;
  PoolThreads& operator=(const PoolThreads&) = delete;

 private:
  int saved_;
};

// Index and values of the first bitwise difference, or "" when equal. With `any_nan`, two NaNs count
// as equal whatever their sign and payload (which NaN an add keeps depends on its operand order,
// which no version promises).
std::string first_difference(const std::vector<float>& got, const std::vector<float>& want, bool any_nan = false) {
  if (got.size() != want.size()) return "sizes differ";
  for (size_t i = 0; i < got.size(); ++i) {
    if (any_nan && std::isnan(got[i]) && std::isnan(want[i])) continue;
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i])) {
      return "first difference at " + std::to_string(i) + ": " + std::to_string(got[i]) + " vs " +
             std::to_string(want[i]);
    }
  }
  return "";
}

// ---- indexer scores --------------------------------------------------------------------------------

// Packed key rows scattered through one buffer in shuffled order with uneven gaps, so the kernel
// cannot rely on a stride; one row ends at the buffer's end, where a read past a row would show.
struct KeyRows {
  std::vector<uint8_t> bytes;
  std::vector<const uint8_t*> rows;
};

// Random nibble bytes (every code appears) and scales drawn from [scale_lo, scale_hi].
KeyRows random_keys(std::mt19937& rng, int64_t n, int64_t K, int scale_lo, int scale_hi) {
  const int64_t row_bytes = index_key_bytes(K);
  std::uniform_int_distribution<int> byte(0, 255), scale(scale_lo, scale_hi), gap(0, 9);
  std::vector<int64_t> offset(static_cast<size_t>(n));
  int64_t total = 0;
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  for (int64_t t : order) {
    total += gap(rng);
    offset[t] = total;
    total += row_bytes;
  }
  KeyRows k;
  k.bytes.resize(static_cast<size_t>(total));
  for (auto& b : k.bytes) b = static_cast<uint8_t>(byte(rng));
  for (int64_t t = 0; t < n; ++t) {
    uint8_t* row = k.bytes.data() + offset[t];
    for (int64_t b = 0; b < K / 32; ++b) row[K / 2 + b] = static_cast<uint8_t>(scale(rng));
    k.rows.push_back(row);
  }
  return k;
}

// Queries as the indexer makes them: Gaussian values FP4 quantize-dequantized per 32 (`fp4` false:
// plain fp32 values, whose products with the keys round).
std::vector<float> random_queries(std::mt19937& rng, int64_t n, bool fp4) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(n));
  for (auto& v : q) v = dist(rng);
  if (fp4) fp4_qdq_e8m0(q.data(), q.size());
  return q;
}

std::vector<float> random_weights(std::mt19937& rng, int64_t n) {
  std::normal_distribution<float> dist(0.0f, 0.3f);
  std::vector<float> w(static_cast<size_t>(n));
  for (auto& v : w) v = round_bf16(dist(rng));
  return w;
}

// Visible counts in [0, n_keys]: the first query sees nothing, the last everything, the rest random.
std::vector<int64_t> random_visible(std::mt19937& rng, int64_t nq, int64_t n_keys) {
  std::uniform_int_distribution<int64_t> pick(0, n_keys);
  std::vector<int64_t> v(static_cast<size_t>(nq));
  for (auto& x : v) x = pick(rng);
  v.front() = 0;
  v.back() = n_keys;
  return v;
}

struct ScoreShape {
  int64_t nq, nh, K, n_keys;
};

std::string describe(Isa isa, const ScoreShape& s) {
  return std::string(isa_name(isa)) + " nq=" + std::to_string(s.nq) + " nh=" + std::to_string(s.nh) +
         " K=" + std::to_string(s.K) + " keys=" + std::to_string(s.n_keys);
}

// Key counts not a multiple of 8 or 16 (and below one vector), odd head counts (a tail after the
// four-head steps), K from one 32-block to the released 128, several query groups (64 heads hold 8
// queries per group on AVX-512), and sizes past the parallel threshold.
const std::vector<ScoreShape> kScoreShapes = {
    {1, 1, 32, 1},   {2, 2, 32, 7},   {1, 2, 32, 17},   {3, 3, 64, 33},    {4, 4, 64, 16},  {5, 5, 96, 41},
    {1, 32, 128, 9}, {2, 7, 160, 24}, {6, 32, 128, 100}, {19, 64, 128, 37}, {1, 64, 128, 1000},
    {33, 8, 64, 513}};

void expect_scores_match(std::mt19937& rng, int scale_lo, int scale_hi, bool fp4_queries, bool any_nan) {
  for (const ScoreShape& s : kScoreShapes) {
    const KeyRows keys = random_keys(rng, s.n_keys, s.K, scale_lo, scale_hi);
    const std::vector<float> q = random_queries(rng, s.nq * s.nh * s.K, fp4_queries);
    const std::vector<float> w = random_weights(rng, s.nq * s.nh);
    const std::vector<int64_t> visible = random_visible(rng, s.nq, s.n_keys);
    std::vector<float> want(static_cast<size_t>(s.nq * s.n_keys));
    detail::index_scores_scalar(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(),
                                want.data());
    for (const Level& level : levels()) {
      std::vector<float> got(want.size(), 12345.0f);
      level.scores(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(), got.data());
      EXPECT_EQ(first_difference(got, want, any_nan), "") << describe(level.isa, s);
    }
  }
}

TEST(IndexScores, ScalarFollowsTheFormula) {
  // One 32-element key: element e = e2m1(code e % 16)·2^(130-127); two heads with q = 1 and q = -1,
  // weights 0.5 and 3. Dots: 8·Σ codes' values and its negative (relu'd to 0).
  const int64_t K = 32;
  std::vector<uint8_t> row(static_cast<size_t>(index_key_bytes(K)));
  for (int64_t e = 0; e < K; e += 2) row[e / 2] = static_cast<uint8_t>((e % 16) | (((e + 1) % 16) << 4));
  row[K / 2] = 130;
  float value_sum = 0;
  for (int64_t e = 0; e < K; ++e) value_sum += e2m1_to_f32(static_cast<uint8_t>(e % 16)) * 8.0f;
  std::vector<float> q(2 * K);
  std::fill(q.begin(), q.begin() + K, 1.0f);
  std::fill(q.begin() + K, q.end(), -1.0f);
  const std::vector<float> w = {0.5f, 3.0f};
  const uint8_t* rows[] = {row.data(), row.data()};
  const int64_t visible = 1;
  float scores[2] = {0, 0};
  detail::index_scores_scalar(q.data(), w.data(), 1, 2, K, rows, 2, &visible, scores);
  const float dot = std::max(round_bf16(value_sum), 0.0f), neg = std::max(round_bf16(-value_sum), 0.0f);
  EXPECT_EQ(scores[0], round_bf16(round_bf16(dot * 0.5f) + round_bf16(neg * 3.0f)));
  EXPECT_EQ(scores[1], -std::numeric_limits<float>::infinity());  // not visible yet
}

TEST(IndexScores, FastMatchesScalar) {
  std::mt19937 rng(21);
  expect_scores_match(rng, 110, 135, true, false);
}

TEST(IndexScores, FastMatchesScalarWithRoundingProducts) {
  std::mt19937 rng(22);
  expect_scores_match(rng, 100, 140, false, false);
}

TEST(IndexScores, FastMatchesScalarAtExtremeScales) {
  // Scale 0 is the subnormal 2^-127, 254 overflows products to ±inf (and 0·inf is NaN), 255 is NaN.
  std::mt19937 rng(23);
  expect_scores_match(rng, 0, 255, true, true);
}

TEST(IndexScores, ProductsAreRoundedBeforeTheyAreAdded) {
  // Each key byte holds the same code twice, so elements 2j and 2j+1 are equal, and the queries pair
  // every x with -x: the rounded products cancel exactly and every dot is 0. A version that fused a
  // multiply into the add would keep the first product's rounding error instead (a nonzero score).
  std::mt19937 rng(26);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (const ScoreShape& s : {ScoreShape{3, 5, 64, 41}, ScoreShape{2, 8, 128, 100}}) {
    KeyRows keys = random_keys(rng, s.n_keys, s.K, 100, 140);
    for (const uint8_t* row : keys.rows) {
      uint8_t* bytes = const_cast<uint8_t*>(row);
      for (int64_t b = 0; b < s.K / 2; ++b) bytes[b] = static_cast<uint8_t>((bytes[b] & 0xF) * 0x11);
    }
    std::vector<float> q(static_cast<size_t>(s.nq * s.nh * s.K));
    for (size_t e = 0; e < q.size(); e += 2) {
      q[e] = dist(rng);
      q[e + 1] = -q[e];
    }
    const std::vector<float> w = random_weights(rng, s.nq * s.nh);
    const std::vector<int64_t> visible(static_cast<size_t>(s.nq), s.n_keys);
    std::vector<float> want(static_cast<size_t>(s.nq * s.n_keys), 1.0f);
    detail::index_scores_scalar(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(),
                                want.data());
    EXPECT_EQ(first_difference(want, std::vector<float>(want.size(), 0.0f)), "") << "scalar";
    for (const Level& level : levels()) {
      std::vector<float> got(want.size(), 1.0f);
      level.scores(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(), got.data());
      EXPECT_EQ(first_difference(got, want), "") << describe(level.isa, s);
    }
  }
}

TEST(IndexScores, ThreadCountDoesNotChangeScores) {
  std::mt19937 rng(24);
  const ScoreShape s{3, 32, 128, 700};
  const KeyRows keys = random_keys(rng, s.n_keys, s.K, 110, 135);
  const std::vector<float> q = random_queries(rng, s.nq * s.nh * s.K, true);
  const std::vector<float> w = random_weights(rng, s.nq * s.nh);
  const std::vector<int64_t> visible = {650, 680, 700};
  std::vector<float> want(static_cast<size_t>(s.nq * s.n_keys));
  detail::index_scores_scalar(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(),
                              want.data());
  for (const int threads : {1, 2, 3}) {
    PoolThreads pool(threads);
    for (const Level& level : levels()) {
      std::vector<float> got(want.size());
      level.scores(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(), got.data());
      EXPECT_EQ(first_difference(got, want), "") << describe(level.isa, s) << " threads=" << threads;
    }
  }
}

TEST(IndexScores, DispatchFollowsTheActiveLevel) {
  std::mt19937 rng(25);
  const ScoreShape s{4, 4, 64, 45};
  const KeyRows keys = random_keys(rng, s.n_keys, s.K, 110, 135);
  const std::vector<float> q = random_queries(rng, s.nq * s.nh * s.K, true);
  const std::vector<float> w = random_weights(rng, s.nq * s.nh);
  const std::vector<int64_t> visible = random_visible(rng, s.nq, s.n_keys);
  std::vector<float> want(static_cast<size_t>(s.nq * s.n_keys));
  detail::index_scores_scalar(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(),
                              want.data());
  const Isa saved = active_isa();
  for (const Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_supported(isa)) continue;
    set_active_isa(isa);
    std::vector<float> got(want.size());
    index_scores(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(), got.data());
    EXPECT_EQ(first_difference(got, want), "") << isa_name(isa);
  }
  set_active_isa(saved);
}

// ---- Engram rows -----------------------------------------------------------------------------------

TEST(EngramRows, FastMatchesScalarOnEveryCodeAndScale) {
  // Each of the 256 codes (NaN codes included) in every lane position, under scales from the
  // subnormal 2^-127 through ones that overflow to inf, and the NaN scale.
  const std::vector<int> scale_codes = {0,   1,   2,   60,  100, 119, 120, 126, 127,
                                        128, 135, 150, 200, 246, 247, 250, 254, 255};
  std::vector<uint8_t> codes, scales;
  for (const int sc : scale_codes) {
    for (int64_t shift = 0; shift < 32; ++shift) {  // block b holds codes 32b.. rotated by `shift`
      for (int64_t b = 0; b < 8; ++b) {
        for (int64_t i = 0; i < 32; ++i) codes.push_back(static_cast<uint8_t>(b * 32 + (i + shift) % 32));
        scales.push_back(static_cast<uint8_t>(sc));
      }
    }
  }
  const int64_t blocks = static_cast<int64_t>(scales.size());
  std::vector<float> want(codes.size());
  detail::dequantize_fp8_blocks_scalar(codes.data(), scales.data(), blocks, want.data());
  for (const Level& level : levels()) {
    std::vector<float> got(codes.size(), 12345.0f);
    level.dequant(codes.data(), scales.data(), blocks, got.data());
    EXPECT_EQ(first_difference(got, want), "") << isa_name(level.isa);
  }
}

TEST(EngramRows, ScalarIsTheBf16OfCodeTimesScale) {
  const uint8_t codes[32] = {0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0x7F, 0x80, 0xB8, 0xFE, 0xFF, 0x45};
  const uint8_t scale = 120;  // 2^-7
  float out[32];
  detail::dequantize_fp8_blocks_scalar(codes, &scale, 1, out);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], std::ldexp(1.0f, -9 - 7));  // the smallest subnormal code
  EXPECT_EQ(out[4], std::ldexp(1.0f, -7));      // 0x38 = 1.0
  EXPECT_EQ(out[5], 448.0f / 128.0f);
  EXPECT_TRUE(std::isnan(out[6]));
  EXPECT_TRUE(std::signbit(out[7]) && out[7] == 0.0f);
  EXPECT_EQ(out[8], -std::ldexp(1.0f, -7));
  EXPECT_TRUE(std::isnan(out[10]));
}

TEST(EngramRows, RowsMatchScalarAtEveryLevelAndThreadCount) {
  // Random rows of the released width (256 channels, 8 scales), enough of them for the parallel split.
  std::mt19937 rng(31);
  std::uniform_int_distribution<int> byte(0, 255), scale(100, 150);
  const int64_t rows = 1100, row_len = 256;
  std::vector<uint8_t> codes(static_cast<size_t>(rows * row_len)), scales(static_cast<size_t>(rows * row_len / 32));
  for (auto& c : codes) c = static_cast<uint8_t>(byte(rng));
  for (auto& s : scales) s = static_cast<uint8_t>(scale(rng));
  std::vector<float> want(codes.size());
  detail::dequantize_fp8_blocks_scalar(codes.data(), scales.data(), rows * row_len / 32, want.data());
  const Isa saved = active_isa();
  for (const int threads : {1, 2}) {
    PoolThreads pool(threads);
    for (const Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
      if (!isa_supported(isa)) continue;
      set_active_isa(isa);
      for (const int64_t n : {int64_t{1}, int64_t{24}, rows}) {  // one row, a decode step's rows, a prefill's
        std::vector<float> got(static_cast<size_t>(n * row_len));
        dequantize_engram_rows(codes.data(), scales.data(), n, row_len, got.data());
        EXPECT_EQ(first_difference(got, std::vector<float>(want.begin(), want.begin() + n * row_len)), "")
            << isa_name(isa) << " rows=" << n << " threads=" << threads;
      }
    }
  }
  set_active_isa(saved);
}

}  // namespace
