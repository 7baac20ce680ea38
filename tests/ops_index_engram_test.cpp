// The fast indexer scores (whole history and candidate pools) and Engram row dequantization against
// their scalar references, bit for bit, at every kernel level this machine runs and several thread
// counts, on inputs aimed at their weak spots.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <bit>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/reference.h"
#include "numeric/formats.h"
#include "numeric/quant.h"
#include "numeric/row_codecs.h"
#include "ops_util.h"

namespace {

using namespace dsv41;
using namespace dsv41::test;

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

std::string describe(const Backend& b, const ScoreShape& s) {
  return label(b) + " nq=" + std::to_string(s.nq) + " nh=" + std::to_string(s.nh) +
         " K=" + std::to_string(s.K) + " keys=" + std::to_string(s.n_keys);
}

// Key counts not a multiple of 8 or 16 (and below one vector), odd head counts (a tail after the
// four-head steps), K from one 32-block to the released 128, several query groups (64 heads hold 8
// queries per group on AVX-512), and sizes past the parallel threshold.
const std::vector<ScoreShape> kScoreShapes = {
    {1, 1, 32, 1},   {2, 2, 32, 7},   {1, 2, 32, 17},   {3, 3, 64, 33},    {4, 4, 64, 16},  {5, 5, 96, 41},
    {1, 32, 128, 9}, {2, 7, 160, 24}, {6, 32, 128, 100}, {19, 64, 128, 37}, {1, 64, 128, 1000},
    {33, 8, 64, 513}};

// Every fast level's scores of `q` against `keys`, bit for bit the scalar reference's (`any_nan`: as
// first_difference).
void expect_fast_scores_match(const ScoreShape& s, const KeyRows& keys, const std::vector<float>& q,
                              const std::vector<float>& w, const std::vector<int64_t>& visible, bool any_nan,
                              const std::string& what = "") {
  std::vector<float> want(static_cast<size_t>(s.nq * s.n_keys));
  reference::index_scores(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(),
                          want.data());
  for (const Backend* be : fast_backends()) {
    std::vector<float> got(want.size(), 12345.0f);
    be->index_scores(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(), got.data());
    EXPECT_EQ(first_difference(got, want, any_nan), "") << describe(*be, s) << what;
  }
}

void expect_scores_match(std::mt19937& rng, int scale_lo, int scale_hi, bool fp4_queries, bool any_nan) {
  for (const ScoreShape& s : kScoreShapes) {
    const KeyRows keys = random_keys(rng, s.n_keys, s.K, scale_lo, scale_hi);
    const std::vector<float> q = random_queries(rng, s.nq * s.nh * s.K, fp4_queries);
    const std::vector<float> w = random_weights(rng, s.nq * s.nh);
    const std::vector<int64_t> visible = random_visible(rng, s.nq, s.n_keys);
    expect_fast_scores_match(s, keys, q, w, visible, any_nan);
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
  reference::index_scores(q.data(), w.data(), 1, 2, K, rows, 2, &visible, scores);
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

// Queries and keys as the model makes them, where an AVX-512 VNNI machine computes every block in
// integers: keys' scales a few binades apart, each head's queries at its own magnitude, and some
// 32-blocks of zeros (a zero block's scale plays no part). K = 160 has five blocks.
TEST(IndexScores, FastMatchesScalarOnTheModelsScales) {
  std::mt19937 rng(28);
  std::uniform_int_distribution<int> magnitude(-4, 4), zero_block(0, 7);
  for (const ScoreShape& s : {ScoreShape{7, 32, 128, 300}, ScoreShape{64, 2, 32, 200}, ScoreShape{3, 4, 160, 77},
                              ScoreShape{1, 64, 128, 1000}, ScoreShape{9, 1, 64, 16}}) {
    const KeyRows keys = random_keys(rng, s.n_keys, s.K, 119, 123);
    std::vector<float> q = random_queries(rng, s.nq * s.nh * s.K, false);
    for (int64_t row = 0; row < s.nq * s.nh; ++row) {
      const float scale = std::ldexp(1.0f, magnitude(rng));
      for (int64_t b = 0; b < s.K / 32; ++b) {
        float* block = q.data() + row * s.K + b * 32;
        const bool zero = zero_block(rng) == 0;
        for (int e = 0; e < 32; ++e) block[e] = zero ? 0.0f : block[e] * scale;
      }
    }
    fp4_qdq_e8m0(q.data(), q.size());
    const std::vector<float> w = random_weights(rng, s.nq * s.nh);
    const std::vector<int64_t> visible = random_visible(rng, s.nq, s.n_keys);
    expect_fast_scores_match(s, keys, q, w, visible, false);
  }
}

// Queries that are small integers times powers of two far from 1: subnormal ones (a block's integers
// then sit below fp32's normal range), tiny and huge ones, against keys of many scales; products
// that underflow or overflow in the reference's chain must come out as the chain has them.
TEST(IndexScores, FastMatchesScalarForQueriesAtExtremeMagnitudes) {
  std::mt19937 rng(30);
  std::uniform_int_distribution<int> integer(-3, 3);
  for (const int e : {-149, -140, -128, -100, 0, 4, 8, 60, 100, 124}) {
    // One 32-block (no scale range to turn the integers away) against keys near fp32's top, where
    // partial sums overflow; several blocks against keys of every scale.
    const bool top = e >= 0 && e <= 8;
    const ScoreShape s = top ? ScoreShape{5, 4, 32, 90} : ScoreShape{5, 4, 128, 90};
    const KeyRows keys = random_keys(rng, s.n_keys, s.K, top ? 236 : 0, top ? 252 : 254);
    std::vector<float> q(static_cast<size_t>(s.nq * s.nh * s.K));
    for (auto& v : q) v = std::ldexp(static_cast<float>(integer(rng)), e);
    const std::vector<float> w = random_weights(rng, s.nq * s.nh);
    const std::vector<int64_t> visible = random_visible(rng, s.nq, s.n_keys);
    expect_fast_scores_match(s, keys, q, w, visible, true, " queries at 2^" + std::to_string(e));
  }
}

// Two blocks whose scales move apart one binade per key. Block 0's dot is 128.5, a bf16 midpoint
// (ties to even: 128); block 1 adds 32 positive products of 2^(-1-t) for key t. While each is at
// least an fp32 ulp of 128.5 (2^-16) the chain keeps them and the score rounds up to 129; from t = 16
// on each is half an ulp or less, the chain rounds it away (to even) and stays at 128.5, scoring 128
// where the exact sum would still round to 129. A kernel that sums blocks in integers must take the
// chain there.
TEST(IndexScores, ScoresFollowTheChainWhereBlockScalesDriftApart) {
  const int64_t K = 64, n_keys = 41;
  KeyRows keys;
  keys.bytes.assign(static_cast<size_t>(n_keys * index_key_bytes(K)), 0);
  for (int64_t t = 0; t < n_keys; ++t) {
    uint8_t* row = keys.bytes.data() + t * index_key_bytes(K);
    row[0] = 7 | (6 << 4);  // block 0 (scale 1): 6, 4, 2, 0.5, then zeros
    row[1] = 4 | (1 << 4);
    for (int64_t b = 16; b < 32; ++b) row[b] = 1 | (1 << 4);  // block 1: 0.5 everywhere
    row[K / 2] = 127;
    row[K / 2 + 1] = static_cast<uint8_t>(127 - t);
    keys.rows.push_back(row);
  }
  std::vector<float> q(K, 0.0f);
  q[0] = 12;
  q[1] = 12;
  q[2] = 4;
  q[3] = 1;  // block 0: 72 + 48 + 8 + 0.5 = 128.5
  std::fill(q.begin() + 32, q.end(), 1.0f);
  const float w = 1.0f;
  const int64_t visible = n_keys;
  std::vector<float> want(static_cast<size_t>(n_keys));
  reference::index_scores(q.data(), &w, 1, 1, K, keys.rows.data(), n_keys, &visible, want.data());
  EXPECT_EQ(want[15], 129.0f);
  EXPECT_EQ(want[16], 128.0f);
  EXPECT_EQ(want[40], 128.0f);
  for (const Backend* be : fast_backends()) {
    std::vector<float> got(want.size(), 12345.0f);
    be->index_scores(q.data(), &w, 1, 1, K, keys.rows.data(), n_keys, &visible, got.data());
    EXPECT_EQ(first_difference(got, want), "") << label(*be);
  }
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
    reference::index_scores(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(),
                                want.data());
    EXPECT_EQ(first_difference(want, std::vector<float>(want.size(), 0.0f)), "") << "scalar";
    for (const Backend* be : fast_backends()) {
      std::vector<float> got(want.size(), 1.0f);
      be->index_scores(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(), got.data());
      EXPECT_EQ(first_difference(got, want), "") << describe(*be, s);
    }
  }
}

// Candidate pools: each query scores only its own blocks (of varying sizes, some past the keys it
// sees, some empty), every other key -inf; the same scores as the whole history inside the pool.
TEST(IndexScores, PoolsMatchScalarAndTheWholeHistory) {
  std::mt19937 rng(27);
  for (const ScoreShape& s : kScoreShapes) {
    for (const int64_t block : {int64_t{1}, int64_t{4}, int64_t{8}, int64_t{13}}) {
      const KeyRows keys = random_keys(rng, s.n_keys, s.K, 110, 135);
      const std::vector<float> q = random_queries(rng, s.nq * s.nh * s.K, true);
      const std::vector<float> w = random_weights(rng, s.nq * s.nh);
      const std::vector<int64_t> visible = random_visible(rng, s.nq, s.n_keys);
      const int64_t blocks = (s.n_keys + block - 1) / block;
      std::vector<std::vector<int32_t>> pools(static_cast<size_t>(s.nq));
      std::uniform_int_distribution<int64_t> count(0, std::min<int64_t>(blocks, 9));
      for (auto& pool : pools) {
        std::vector<int32_t> all(static_cast<size_t>(blocks));
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        pool.assign(all.begin(), all.begin() + count(rng));
        std::sort(pool.begin(), pool.end());
      }
      std::vector<float> want(static_cast<size_t>(s.nq * s.n_keys)), whole(want.size());
      reference::index_scores_in_pool(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(),
                                      pools.data(), block, want.data());
      reference::index_scores(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(),
                              whole.data());
      for (int64_t i = 0; i < s.nq; ++i) {
        std::vector<uint8_t> in(static_cast<size_t>(s.n_keys), 0);
        for (int32_t b : pools[i])
          for (int64_t t = b * block; t < std::min(s.n_keys, (b + 1) * block); ++t) in[t] = 1;
        for (int64_t t = 0; t < s.n_keys; ++t) {
          const float expect = in[t] ? whole[i * s.n_keys + t] : -std::numeric_limits<float>::infinity();
          ASSERT_EQ(std::bit_cast<uint32_t>(want[i * s.n_keys + t]), std::bit_cast<uint32_t>(expect))
              << "reference pool " << i << " key " << t;
        }
      }
      for (const Backend* be : fast_backends()) {
        std::vector<float> got(want.size(), 12345.0f);
        be->index_scores_in_pool(q.data(), w.data(), s.nq, s.nh, s.K, keys.rows.data(), s.n_keys, visible.data(),
                                 pools.data(), block, got.data());
        EXPECT_EQ(first_difference(got, want), "") << describe(*be, s) << " block " << block;
      }
    }
  }
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
  reference::engram_rows(codes.data(), scales.data(), blocks, 32, want.data());
  for (const Backend* be : fast_backends()) {
    std::vector<float> got(codes.size(), 12345.0f);
    be->engram_rows(codes.data(), scales.data(), blocks, 32, got.data());
    EXPECT_EQ(first_difference(got, want), "") << label(*be);
  }
}

TEST(EngramRows, ScalarIsTheBf16OfCodeTimesScale) {
  const uint8_t codes[32] = {0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0x7F, 0x80, 0xB8, 0xFE, 0xFF, 0x45};
  const uint8_t scale = 120;  // 2^-7
  float out[32];
  reference::engram_rows(codes, &scale, 1, 32, out);
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
  reference::engram_rows(codes.data(), scales.data(), rows, row_len, want.data());
  for (const auto& be : op_backends()) {
    for (const int64_t n : {int64_t{1}, int64_t{24}, rows}) {  // one row, a decode step's rows, a prefill's
      std::vector<float> got(static_cast<size_t>(n * row_len));
      be->engram_rows(codes.data(), scales.data(), n, row_len, got.data());
      EXPECT_EQ(first_difference(got, std::vector<float>(want.begin(), want.begin() + n * row_len)), "")
          << label(*be) << " rows=" << n;
    }
  }
}

}  // namespace
