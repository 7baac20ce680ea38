// Tests of the ops' scalar references (kernels/reference.h) against slow formulations written here from
// model-spec §3.1: dequantized weight tables, plain double sums, a two-pass attention over the same
// chunking, Sinkhorn in double, and top-k by a full stable sort; RoPE against the reference's fp32
// tables and rotations computed offline with NumPy (tests/rope_expected.h). Where the kernel's
// definition fixes the fp32 operation order the comparison is bit-exact; elsewhere it is within the
// stated rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cascade_sum.h"
#include "kernels/reference.h"
#include "numeric/formats.h"
#include "numeric/quant.h"
#include "numeric/row_codecs.h"
#include "rope_expected.h"

namespace {

using namespace dsv41;

constexpr float kInf = std::numeric_limits<float>::infinity();

// One rope row rotated at `pos` by the reference.
void rotate(const RopeTable& t, float* x, int64_t pos, bool inverse) {
  reference::rope(t, RotaryRows{x, 1, t.dim(), 1, pos, 0}, inverse);
}

uint32_t bits(float x) { return std::bit_cast<uint32_t>(x); }
bool same_bits(float a, float b) { return bits(a) == bits(b); }

// Collects mismatches and reports the first few, so one bug does not print thousands of lines.
struct Mismatches {
  int count = 0;
  void check(bool ok, const std::string& what) {
    if (ok) return;
    if (++count <= 8) ADD_FAILURE() << what;
  }
  ~Mismatches() { EXPECT_EQ(count, 0) << "mismatches in total"; }
};

// Distance in fp32 ulps between two finite floats of the same sign.
int64_t ulp_distance(float a, float b) {
  return std::abs(static_cast<int64_t>(bits(a)) - static_cast<int64_t>(bits(b)));
}

// One bf16 ulp at the magnitude of v (v normal).
double bf16_ulp(double v) {
  int e = 0;
  std::frexp(std::fabs(v), &e);  // |v| = m·2^e, m in [0.5, 1): the bf16 spacing is 2^(e-8)
  return std::ldexp(1.0, e - 8);
}

// bf16-representable normal values, scaled by `scale`.
std::vector<float> random_bf16(std::mt19937& rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = round_bf16(dist(rng));
  return v;
}

// ---- linear layers -----------------------------------------------------------------------------

// The activation of one row act_quant'ed and dequantized: e4m3(code)·scale is exact (power of two).
std::vector<float> dequantized_activation(const float* x, size_t k) {
  std::vector<uint8_t> codes(k);
  std::vector<float> scales(k / 32);
  act_quant_fp8(x, k, codes.data(), scales.data());
  std::vector<float> a(k);
  for (size_t j = 0; j < k; ++j) a[j] = e4m3_to_f32(codes[j]) * scales[j / 32];
  return a;
}

// Σ over K blocks of (Σ_j a_j·w_j), a and w already dequantized. Scaling by powers of two commutes
// with fp32 rounding while everything stays normal, so this equals the kernel's
// Σ (Σ_j a·w)·a_s·w_s bit for bit — a different formulation with the same exact result.
float block_sum(const float* a, const float* w, size_t k) {
  float acc = 0.0f;
  for (size_t b = 0; b < k; b += 32) {
    float part = 0.0f;
    for (size_t j = b; j < b + 32; ++j) part += a[j] * w[j];
    acc += part;
  }
  return acc;
}

uint8_t e4m3_code(float v) { return e4m3_from_f32(v); }

TEST(KernelsLinear, Fp8HandComputed) {
  // K = 64 (two blocks), N = 2 (one scale row). Block 0 of x alternates 1, -2 (amax 2: scale
  // 2^-7, codes ±128/256 exact); block 1 is all 0.25 (scale 2^-10, code 256).
  std::vector<float> x(2 * 64);
  for (int j = 0; j < 32; ++j) x[j] = (j % 2 == 0) ? 1.0f : -2.0f;
  for (int j = 32; j < 64; ++j) x[j] = 0.25f;
  for (int j = 0; j < 64; ++j) x[64 + j] = -x[j];  // row 1: the negation gives the negated output
  std::vector<uint8_t> w(2 * 64);
  for (int j = 0; j < 32; ++j) {
    w[j] = e4m3_code(1.5f);                                // row 0, block 0
    w[64 + j] = e4m3_code(j % 2 == 0 ? 2.0f : 0.0f);       // row 1, block 0
  }
  for (int j = 32; j < 64; ++j) {
    w[j] = e4m3_code(1.0f);         // row 0, block 1
    w[64 + j] = e4m3_code(0.5f);    // row 1, block 1
  }
  const uint8_t scale[2] = {126, 125};  // e8m0: 0.5 for K block 0, 0.25 for K block 1
  Fp8Matrix mat{w.data(), scale, 2, 64};
  float y[4];
  reference::linear_fp8(x.data(), 2, mat, y);
  // y0 = (16·1·1.5 + 16·(-2)·1.5)·0.5 + 32·0.25·1·0.25 = -12 + 2
  // y1 = (16·1·2)·0.5 + 32·0.25·0.5·0.25 = 16 + 1
  EXPECT_EQ(y[0], -10.0f);
  EXPECT_EQ(y[1], 17.0f);
  EXPECT_EQ(y[2], 10.0f);
  EXPECT_EQ(y[3], -17.0f);
}

TEST(KernelsLinear, Fp8MatchesDequantizedTables) {
  std::mt19937 rng(101);
  const int64_t m = 3, k = 128, n = 40;  // n not a multiple of 32: two scale rows, the last partial
  std::vector<float> x = random_bf16(rng, m * k);
  // Give each activation block its own magnitude so the per-block scales differ.
  std::uniform_int_distribution<int> shift(-6, 4);
  for (int64_t b = 0; b < m * k / 32; ++b) {
    const int s = shift(rng);
    for (int64_t j = 0; j < 32; ++j) x[b * 32 + j] = std::ldexp(x[b * 32 + j], s);
  }
  std::fill(x.begin() + 2 * k, x.end(), 0.0f);  // an all-zero row: amax floor, output 0
  std::uniform_int_distribution<int> code(0, 255), scode(117, 129);
  std::vector<uint8_t> w(n * k);
  for (auto& c : w) {
    do c = static_cast<uint8_t>(code(rng));
    while ((c & 0x7F) == 0x7F);  // no NaN codes in a checkpoint
  }
  const int64_t sn = (n + 31) / 32, sk = k / 32;
  std::vector<uint8_t> ws(sn * sk);
  for (auto& c : ws) c = static_cast<uint8_t>(scode(rng));
  std::vector<float> y(m * n);
  reference::linear_fp8(x.data(), m, Fp8Matrix{w.data(), ws.data(), n, k}, y.data());

  // Slow: weight table wd[n][k] = e4m3(code)·scale[n/32][k/32].
  std::vector<float> wd(n * k);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < k; ++j) wd[r * k + j] = e4m3_to_f32(w[r * k + j]) * e8m0_to_f32(ws[(r / 32) * sk + j / 32]);
  }
  Mismatches mm;
  for (int64_t i = 0; i < m; ++i) {
    const std::vector<float> a = dequantized_activation(x.data() + i * k, k);
    for (int64_t r = 0; r < n; ++r) {
      const float want = round_bf16(block_sum(a.data(), wd.data() + r * k, k));
      const float got = y[i * n + r];
      mm.check(same_bits(got, want), "y[" + std::to_string(i) + "," + std::to_string(r) + "] = " +
                                         std::to_string(got) + ", want " + std::to_string(want));
      if (i == 2) mm.check(got == 0.0f, "zero row must give 0");
    }
  }
}

TEST(KernelsLinear, Fp4MatchesDequantizedTables) {
  std::mt19937 rng(202);
  const int64_t m = 2, k = 96, n = 7;
  std::vector<float> x = random_bf16(rng, m * k, 3.0f);
  // E2M1 magnitudes by 3-bit code; bit 3 is the sign (model-spec §2.2).
  const float grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  std::uniform_int_distribution<int> nib(0, 15), scode(120, 132);
  std::vector<int> codes(n * k);
  for (auto& c : codes) c = nib(rng);
  std::vector<uint8_t> packed(n * k / 2);
  for (size_t i = 0; i < packed.size(); ++i) {
    packed[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));  // even k: low nibble
  }
  std::vector<uint8_t> ws(n * (k / 32));
  for (auto& c : ws) c = static_cast<uint8_t>(scode(rng));
  std::vector<float> y(m * n);
  reference::linear_fp4(x.data(), m, Fp4Matrix{packed.data(), ws.data(), n, k}, y.data());

  Mismatches mm;
  for (int64_t i = 0; i < m; ++i) {
    const std::vector<float> a = dequantized_activation(x.data() + i * k, k);
    for (int64_t r = 0; r < n; ++r) {
      std::vector<float> wd(k);
      for (int64_t j = 0; j < k; ++j) {
        const int c = codes[r * k + j];
        const float mag = grid[c & 7];
        wd[j] = ((c & 8) != 0 ? -mag : mag) * std::ldexp(1.0f, ws[r * (k / 32) + j / 32] - 127);
      }
      const float want = round_bf16(block_sum(a.data(), wd.data(), k));
      mm.check(same_bits(y[i * n + r], want),
               "y[" + std::to_string(i) + "," + std::to_string(r) + "] = " + std::to_string(y[i * n + r]) +
                   ", want " + std::to_string(want));
    }
  }
}

TEST(KernelsLinear, Bf16AndF32) {
  std::mt19937 rng(303);
  const int64_t m = 3, k = 200, n = 9;
  const std::vector<float> xb = random_bf16(rng, m * k);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> xf(m * k);
  for (auto& v : xf) v = dist(rng);  // fp32 activations for linear_f32
  std::vector<uint16_t> w(n * k);
  for (auto& b : w) b = bf16_from_f32(dist(rng) * 0.1f);
  const Bf16Matrix mat{w.data(), n, k};
  std::vector<float> yb(m * n), yf(m * n);
  reference::linear_bf16(xb.data(), m, mat, yb.data());
  reference::linear_f32(xf.data(), m, mat, yf.data());

  Mismatches mm;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t r = 0; r < n; ++r) {
      // Defined semantics: fp32 products summed in index order (bf16 result for linear_bf16).
      float sb = 0.0f, sf = 0.0f;
      double db = 0.0, df = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        const float wv = bf16_to_f32(w[r * k + j]);
        sb += xb[i * k + j] * wv;
        const float pf = xf[i * k + j] * wv;
        sf += pf;
        db += static_cast<double>(xb[i * k + j]) * wv;
        df += static_cast<double>(xf[i * k + j]) * wv;
      }
      const std::string at = "[" + std::to_string(i) + "," + std::to_string(r) + "]";
      mm.check(same_bits(yb[i * n + r], round_bf16(sb)), "bf16 y" + at);
      mm.check(same_bits(yf[i * n + r], sf), "f32 y" + at);
      // And both are the right function: close to the exact dot product.
      mm.check(std::fabs(yb[i * n + r] - db) <= bf16_ulp(db) + 1e-4, "bf16 vs double" + at);
      mm.check(std::fabs(yf[i * n + r] - df) <= 1e-4, "f32 vs double" + at);
    }
  }
}

// ---- RMSNorm ------------------------------------------------------------------------------------

TEST(KernelsNorm, RmsNorm) {
  std::mt19937 rng(404);
  const int64_t n = 512;
  const std::vector<float> x = random_bf16(rng, n, 2.5f);
  std::vector<uint16_t> w(n);
  std::normal_distribution<float> dist(1.0f, 0.2f);
  for (auto& b : w) b = bf16_from_f32(dist(rng));
  const float eps = 1e-20f;
  std::vector<float> y32(n), y16(n);
  reference::rms_norm(x.data(), 1, n, w.data(), eps, y32.data(), false);
  reference::rms_norm(x.data(), 1, n, w.data(), eps, y16.data(), true);

  // fp32 as defined: torch's sum of the fp32 squares (the cascade, checked against torch itself in
  // cascade_sum_test.cpp), / n, 1/sqrt, x·rstd, then weight·(x·rstd).
  const float ss = reference::cascade_sum_of_squares(x.data(), n);
  double dss = 0.0;
  for (int64_t i = 0; i < n; ++i) dss += static_cast<double>(x[i]) * x[i];
  const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  const double drstd = 1.0 / std::sqrt(dss / static_cast<double>(n));
  Mismatches mm;
  for (int64_t i = 0; i < n; ++i) {
    const float xn = x[i] * rstd;
    const float want = bf16_to_f32(w[i]) * xn;
    mm.check(same_bits(y32[i], want), "fp32 y[" + std::to_string(i) + "]");
    mm.check(same_bits(y16[i], round_bf16(want)), "bf16 y[" + std::to_string(i) + "]");
    const double exact = static_cast<double>(bf16_to_f32(w[i])) * x[i] * drstd;
    mm.check(std::fabs(y32[i] - exact) <= 1e-5 * (std::fabs(exact) + 1e-3), "vs double at " + std::to_string(i));
  }

  // An all-zero vector stays zero (eps keeps the rsqrt finite).
  std::vector<float> z(64, 0.0f), zy(64, 1.0f);
  reference::rms_norm(z.data(), 1, 64, w.data(), eps, zy.data(), true);
  for (float v : zy) EXPECT_EQ(v, 0.0f);
}

// ---- RoPE ---------------------------------------------------------------------------------------

// f_i in double: base^(-2i/dim), with YaRN's ramp when orig > 0, then rounded to float.
std::vector<float> double_freqs(int64_t dim, int64_t orig, double base, double factor, double bf, double bs) {
  std::vector<float> out(dim / 2);
  double low = 0, high = 0;
  if (orig > 0) {
    const auto corr = [&](double r) {
      return static_cast<double>(dim) * std::log(static_cast<double>(orig) / (r * 2 * std::numbers::pi)) /
             (2 * std::log(base));
    };
    low = std::max(std::floor(corr(bf)), 0.0);
    high = std::min(std::ceil(corr(bs)), static_cast<double>(dim - 1));
  }
  for (int64_t i = 0; i < dim / 2; ++i) {
    double f = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
    if (orig > 0) {
      const double ramp = std::clamp((static_cast<double>(i) - low) / std::max(high - low, 1e-3), 0.0, 1.0);
      f = f / factor * ramp + f * (1 - ramp);
    }
    out[i] = static_cast<float>(f);
  }
  return out;
}

TEST(KernelsRope, YarnRange) {
  // model-spec §3.1: the released compressed layers (base 160000, orig 65536, betas 32/1).
  const YarnRange r = yarn_range(64, 65536, 160000.0, 32, 1);
  EXPECT_EQ(r.low, 15);
  EXPECT_EQ(r.high, 25);
  // The golden tiny models: 16 rope lanes, orig 32 — corr(32) < 0 clamps to 0.
  const YarnRange t = yarn_range(16, 32, 160000.0, 32, 1);
  EXPECT_EQ(t.low, 0);
  EXPECT_EQ(t.high, 2);
}

TEST(KernelsRope, FreqsAgainstDouble) {
  // Within 1 ulp of the formula in double, except inside YaRN's ramp: there the ramp value itself
  // is an fp32 quotient (0.9 becomes 0.89999998) and 1 − smooth is evaluated in fp32, which moves
  // a lane by up to 2 ulps (lane 24 of the released table). Those lanes are checked bit for bit
  // against the fp32 chain below instead.
  struct Case {
    int64_t dim, orig;
    double base, factor;
  };
  const Case cases[] = {{64, 0, 10000.0, 1.0}, {64, 65536, 160000.0, 16.0}, {16, 32, 160000.0, 4.0},
                        {16, 0, 10000.0, 1.0}, {64, 0, 160000.0, 1.0}};
  for (const Case& c : cases) {
    const RopeTable t(c.dim, c.orig, c.base, c.factor, 32, 1);
    const std::vector<float> want = double_freqs(c.dim, c.orig, c.base, c.factor, 32, 1);
    const YarnRange r = c.orig > 0 ? yarn_range(c.dim, c.orig, c.base, 32, 1) : YarnRange{};
    ASSERT_EQ(t.dim(), c.dim);
    ASSERT_EQ(t.freqs().size(), want.size());
    Mismatches mm;
    for (size_t i = 0; i < want.size(); ++i) {
      const bool in_ramp = c.orig > 0 && static_cast<int64_t>(i) > r.low && static_cast<int64_t>(i) < r.high;
      mm.check(ulp_distance(t.freqs()[i], want[i]) <= (in_ramp ? 2 : 1),
               "dim " + std::to_string(c.dim) + " base " + std::to_string(c.base) + " lane " + std::to_string(i) +
                   ": " + std::to_string(t.freqs()[i]) + " vs " + std::to_string(want[i]));
    }
  }

  // YaRN leaves the lanes up to `low` (15 on the released table) at f and divides those from `high`
  // (25) on by the factor exactly.
  const RopeTable plain(64, 0, 160000.0, 16.0, 32, 1), yarn(64, 65536, 160000.0, 16.0, 32, 1);
  for (size_t i = 0; i < 32; ++i) {
    if (i <= 15) {
      EXPECT_TRUE(same_bits(yarn.freqs()[i], plain.freqs()[i])) << "below low, lane " << i;
    } else if (i >= 25) {
      EXPECT_TRUE(same_bits(yarn.freqs()[i], plain.freqs()[i] / 16.0f)) << "above high, lane " << i;
    } else {
      EXPECT_FALSE(same_bits(yarn.freqs()[i], plain.freqs()[i])) << "inside the ramp, lane " << i;
    }
  }
  EXPECT_EQ(plain.freqs()[0], 1.0f);
}

// The tables the reference builds, from NumPy float32 in the reference's operation order
// (tests/tools/rope_expected.py, pasted into tests/rope_expected.h): the released compressed layers
// (base 160000, YaRN 65536 × 16), the released ratio-0 layers (base 10000, no YaRN) and the golden
// checkpoints' compressed layers (16 lanes, YaRN 32 × 4, ramp over lanes 0-2).
struct RopeCase {
  const char* name;
  int64_t dim, orig;
  double base, factor;
  const uint32_t* freqs;
  const int64_t* positions;
  size_t n_positions;
  const uint16_t* forward;  // [n_positions][dim] bf16 bits
  const uint16_t* inverse;
};

std::vector<RopeCase> rope_cases() {
  namespace e = rope_expected;
  return {
      {"released compressed", 64, 65536, 160000.0, 16.0, e::kReleasedCompressedFreqs, e::kReleasedCompressedPositions,
       std::size(e::kReleasedCompressedPositions), &e::kReleasedCompressedForward[0][0],
       &e::kReleasedCompressedInverse[0][0]},
      {"released plain", 64, 0, 10000.0, 1.0, e::kReleasedPlainFreqs, e::kReleasedPlainPositions,
       std::size(e::kReleasedPlainPositions), &e::kReleasedPlainForward[0][0], &e::kReleasedPlainInverse[0][0]},
      {"golden compressed", 16, 32, 160000.0, 4.0, e::kTinyCompressedFreqs, e::kTinyCompressedPositions,
       std::size(e::kTinyCompressedPositions), &e::kTinyCompressedForward[0][0], &e::kTinyCompressedInverse[0][0]},
  };
}

// The input of the pasted rotations: x[j] = ((37·j) mod 29 − 14)·3/16, exact in bf16.
std::vector<float> rope_test_vector(int64_t dim) {
  std::vector<float> x(static_cast<size_t>(dim));
  for (int64_t j = 0; j < dim; ++j) x[j] = static_cast<float>((j * 37) % 29 - 14) * 0.1875f;
  return x;
}

TEST(KernelsRope, FreqsEqualTheReferenceFp32Table) {
  for (const RopeCase& c : rope_cases()) {
    const RopeTable t(c.dim, c.orig, c.base, c.factor, 32, 1);
    ASSERT_EQ(t.freqs().size(), static_cast<size_t>(c.dim / 2)) << c.name;
    Mismatches mm;
    for (size_t i = 0; i < t.freqs().size(); ++i) {
      mm.check(bits(t.freqs()[i]) == c.freqs[i], std::string(c.name) + " lane " + std::to_string(i) + ": " +
                                                      std::to_string(t.freqs()[i]) + " vs " +
                                                      std::to_string(std::bit_cast<float>(c.freqs[i])));
    }
  }
}

TEST(KernelsRope, RotationsEqualTheReferenceFp32Rotation) {
  for (const RopeCase& c : rope_cases()) {
    const RopeTable t(c.dim, c.orig, c.base, c.factor, 32, 1);
    const std::vector<float> x = rope_test_vector(c.dim);
    Mismatches mm;
    for (size_t p = 0; p < c.n_positions; ++p) {
      for (const bool inverse : {false, true}) {
        std::vector<float> got = x;
        rotate(t, got.data(), c.positions[p], inverse);
        const uint16_t* want = (inverse ? c.inverse : c.forward) + p * static_cast<size_t>(c.dim);
        for (int64_t i = 0; i < c.dim; ++i) {
          mm.check(bf16_from_f32(got[i]) == want[i] && got[i] == round_bf16(got[i]),
                   std::string(c.name) + (inverse ? " inverse" : " forward") + " pos " +
                       std::to_string(c.positions[p]) + " lane " + std::to_string(i) + ": " + std::to_string(got[i]) +
                       " vs " + std::to_string(bf16_to_f32(want[i])));
        }
      }
    }
  }
}

// The pasted values tell the reference's rules from plausible wrong ones: at position 1000003 an angle
// taken as the double product pos·f (not its fp32 rounding), and pairs taken as the two halves of the
// vector (not adjacent lanes), each give other bf16 values.
TEST(KernelsRope, ReferenceValuesRejectADoubleAngleAndHalfSplitPairs) {
  const RopeCase c = rope_cases()[1];  // released plain, positions 5 and 1000003
  ASSERT_EQ(c.positions[1], 1000003);
  const RopeTable t(c.dim, c.orig, c.base, c.factor, 32, 1);
  const std::vector<float> x = rope_test_vector(c.dim);
  const uint16_t* want = c.forward + static_cast<size_t>(c.dim);
  const auto rotate = [&](bool double_angle, bool half_split) {
    std::vector<float> y = x;
    const size_t half = static_cast<size_t>(c.dim / 2);
    for (size_t i = 0; i < half; ++i) {
      const size_t re = half_split ? i : 2 * i, im = half_split ? i + half : 2 * i + 1;
      const double angle = double_angle ? 1000003.0 * static_cast<double>(t.freqs()[i])
                                        : static_cast<double>(1000003.0f * t.freqs()[i]);
      const float co = static_cast<float>(std::cos(angle)), si = static_cast<float>(std::sin(angle));
      y[re] = round_bf16(x[re] * co - x[im] * si);
      y[im] = round_bf16(x[re] * si + x[im] * co);
    }
    int differ = 0;
    for (int64_t i = 0; i < c.dim; ++i) differ += bf16_from_f32(y[i]) != want[i];
    return differ;
  };
  EXPECT_EQ(rotate(false, false), 0);   // the rules themselves reproduce the pasted values
  EXPECT_GE(rotate(true, false), 10);   // 14 of the 64 lanes differ
  EXPECT_GE(rotate(false, true), 48);   // all 64 differ
}

// inverse∘forward is the identity up to the two bf16 roundings (each at most half a bf16 ulp of the
// pair's magnitude, which a rotation keeps), and position 0 is the identity.
TEST(KernelsRope, InverseUndoesForwardAndPositionZeroIsTheIdentity) {
  std::mt19937 rng(505);
  const RopeTable t(64, 65536, 160000.0, 16.0, 32, 1);
  const int64_t positions[] = {0, 1, 2, 17, 127, 4095, 65535, 65536, 1000003};
  Mismatches mm;
  for (const int64_t pos : positions) {
    for (int rep = 0; rep < 4; ++rep) {
      const std::vector<float> x = random_bf16(rng, 64, 3.0f);
      std::vector<float> y = x;
      rotate(t, y.data(), pos, false);
      if (pos == 0) {
        for (size_t i = 0; i < 64; ++i) mm.check(same_bits(y[i], x[i]), "position 0 is the identity");
      }
      rotate(t, y.data(), pos, true);
      for (size_t i = 0; i < 32; ++i) {
        const double r = std::hypot(static_cast<double>(x[2 * i]), static_cast<double>(x[2 * i + 1]));
        const double tol = 2.0 * std::ldexp(r, -8) + 1e-30;
        for (size_t k = 0; k < 2; ++k) {
          mm.check(std::fabs(y[2 * i + k] - x[2 * i + k]) <= tol,
                   "round trip, pos " + std::to_string(pos) + " lane " + std::to_string(2 * i + k));
        }
      }
    }
  }
}

// ---- sparse attention ---------------------------------------------------------------------------

// The op reads packed rows; the slow formulation below reads their values. A pool of rows is kept
// in both packed formats, each with its decoded values; a list names decoded rows (c.rows), and
// packed() gives the op the same rows packed — the first `window` entries of a list in the window
// format, the rest as compressed rows, as the model lays a query's list out.
struct AttnCase {
  int64_t heads = 4, d = 64;
  std::vector<float> q, sink;
  std::vector<float> window_values, compressed_values;          // [pool rows, d] each
  std::vector<uint8_t> window_packed, compressed_packed;        // the same rows packed
  std::vector<const float*> rows;
  size_t window = 0;  // entries of `rows` in the window format
  float scale = 0.125f;
};

// The packed list of `rows` (values from c's pools): entries before `window` window rows, the rest
// compressed rows; `storage` holds the pointers.
KvRows packed(const AttnCase& c, const std::vector<const float*>& rows, size_t window,
              std::vector<const uint8_t*>& storage) {
  storage.clear();
  for (size_t j = 0; j < rows.size(); ++j) {
    if (rows[j] == nullptr) {
      storage.push_back(nullptr);
      continue;
    }
    const bool w = j < window;
    const float* base = w ? c.window_values.data() : c.compressed_values.data();
    const int64_t r = (rows[j] - base) / c.d;
    storage.push_back(w ? &c.window_packed[static_cast<size_t>(r * window_row_bytes(c.d))]
                        : &c.compressed_packed[static_cast<size_t>(r * main_kv_bytes(c.d))]);
  }
  const int64_t nw = static_cast<int64_t>(std::min(window, rows.size()));
  return {storage.data(), nw, storage.data() + nw, static_cast<int64_t>(rows.size()) - nw};
}

// Rows of growing magnitude so the running max rises from chunk to chunk (exercising the rescale
// and the bf16 rounding of P relative to a running max that is not the final one). The first
// `window` entries come from the window-format pool, the rest from the compressed one.
AttnCase make_attn_case(std::mt19937& rng, size_t list_len, double null_fraction, size_t window) {
  AttnCase c;
  c.q = random_bf16(rng, c.heads * c.d);
  const size_t pool_rows = 97;
  c.window_values.resize(pool_rows * c.d);
  c.compressed_values.resize(pool_rows * c.d);
  c.window_packed.resize(pool_rows * static_cast<size_t>(window_row_bytes(c.d)));
  c.compressed_packed.resize(pool_rows * static_cast<size_t>(main_kv_bytes(c.d)));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> row(static_cast<size_t>(c.d));
  for (size_t r = 0; r < pool_rows; ++r) {
    const float mag = 0.5f + 1.5f * static_cast<float>(r) / static_cast<float>(pool_rows);
    for (auto& v : row) v = round_bf16(dist(rng) * mag);
    uint8_t* w = &c.window_packed[r * static_cast<size_t>(window_row_bytes(c.d))];
    uint8_t* m = &c.compressed_packed[r * static_cast<size_t>(main_kv_bytes(c.d))];
    pack_window_row(row.data(), c.d, w);
    unpack_window_row(w, c.d, &c.window_values[r * c.d]);
    pack_main_kv_row(row.data(), c.d, m);
    unpack_main_kv_row(m, c.d, &c.compressed_values[r * c.d]);
  }
  c.sink = random_bf16(rng, c.heads);
  c.window = window;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::uniform_int_distribution<int> jitter(-10, 10);
  for (size_t j = 0; j < list_len; ++j) {
    if (u(rng) < null_fraction) {
      c.rows.push_back(nullptr);
      continue;
    }
    const long r = std::clamp<long>(static_cast<long>(j * pool_rows / list_len) + jitter(rng), 0, pool_rows - 1);
    c.rows.push_back((j < window ? c.window_values.data() : c.compressed_values.data()) + r * c.d);
  }
  return c;
}

std::vector<float> run_attn(const AttnCase& c, const std::vector<const float*>& rows, size_t window) {
  std::vector<float> out(c.heads * c.d, -7.0f);
  std::vector<const uint8_t*> storage;
  reference::sparse_attention(c.q.data(), c.heads, c.d, packed(c, rows, window, storage), c.sink.data(), c.scale,
                              out.data());
  return out;
}
std::vector<float> run_attn(const AttnCase& c) { return run_attn(c, c.rows, c.window); }

// Two passes over the same 64-entry chunks: first the logits and the running max after each chunk,
// then numerator and denominator in double relative to the final max. P·V uses each entry's
// probability rounded to bf16 relative to its chunk's running max, as the kernel defines.
std::vector<double> two_pass_attn(const AttnCase& c) {
  std::vector<double> out(c.heads * c.d);
  const size_t n = c.rows.size();
  for (int64_t h = 0; h < c.heads; ++h) {
    std::vector<float> s(n, -kInf);
    std::vector<float> run_max(n);  // the running max in effect for entry j's chunk
    float m = -1e30f;
    for (size_t t = 0; t < n; t += 64) {
      const size_t end = std::min(n, t + 64);
      for (size_t j = t; j < end; ++j) {
        if (c.rows[j] == nullptr) continue;
        float dot = 0.0f;
        for (int64_t i = 0; i < c.d; ++i) dot += c.q[h * c.d + i] * c.rows[j][i];
        s[j] = dot * c.scale;
        m = std::max(m, s[j]);
      }
      for (size_t j = t; j < end; ++j) run_max[j] = m;
    }
    double den = std::exp(static_cast<double>(c.sink[h]) - m);
    std::vector<double> num(c.d, 0.0);
    for (size_t j = 0; j < n; ++j) {
      if (c.rows[j] == nullptr) continue;
      den += std::exp(static_cast<double>(s[j]) - m);
      // bf16(p relative to the running max), carried to the final max by exp(run_max - m).
      const double p = round_bf16(std::exp(s[j] - run_max[j])) * std::exp(static_cast<double>(run_max[j]) - m);
      for (int64_t i = 0; i < c.d; ++i) num[i] += p * c.rows[j][i];
    }
    for (int64_t i = 0; i < c.d; ++i) out[h * c.d + i] = num[i] / den;
  }
  return out;
}

TEST(KernelsAttention, MatchesTwoPass) {
  std::mt19937 rng(606);
  for (const size_t len : {1u, 63u, 64u, 65u, 150u, 300u}) {
    const AttnCase c = make_attn_case(rng, len, len == 1 ? 0.0 : 0.15, len / 3);
    const std::vector<float> got = run_attn(c);
    const std::vector<double> want = two_pass_attn(c);
    Mismatches mm;
    for (size_t i = 0; i < got.size(); ++i) {
      // The output's bf16 rounding (≤ 1 ulp here: fp32 vs double can sit across a rounding
      // boundary) plus fp32 accumulation error on values of magnitude ≤ ~10.
      const double tol = bf16_ulp(want[i]) + 1e-5;
      mm.check(std::isfinite(got[i]) && std::fabs(got[i] - want[i]) <= tol,
               "len " + std::to_string(len) + " out[" + std::to_string(i) + "] = " + std::to_string(got[i]) +
                   ", want " + std::to_string(want[i]));
      mm.check(got[i] == round_bf16(got[i]), "output not bf16");
    }
  }
}

TEST(KernelsAttention, EmptyListsGiveZeros) {
  std::mt19937 rng(707);
  AttnCase c = make_attn_case(rng, 0, 0.0, 0);
  c.sink = {0.0f, 30.0f, -30.0f, 1e4f};
  for (const size_t len : {0u, 1u, 64u, 130u}) {
    const std::vector<const float*> rows(len, nullptr);
    for (float v : run_attn(c, rows, len / 2)) EXPECT_TRUE(same_bits(v, 0.0f)) << len;
  }
}

TEST(KernelsAttention, NullChunksContributeNothing) {
  std::mt19937 rng(808);
  const AttnCase c = make_attn_case(rng, 100, 0.1, 100);  // all window rows: the lists below shift them
  const std::vector<float> base = run_attn(c);
  // A whole chunk of empty slots before the list (as at decode steps p <= 63), and empty slots
  // appended after it: the state is untouched bit for bit, because the max floor is finite.
  std::vector<const float*> prefixed(64, nullptr);
  prefixed.insert(prefixed.end(), c.rows.begin(), c.rows.end());
  std::vector<const float*> suffixed = c.rows;
  suffixed.insert(suffixed.end(), 100, nullptr);
  std::vector<const float*> both(128, nullptr);
  both.insert(both.end(), suffixed.begin(), suffixed.end());
  for (const auto* list : {&prefixed, &suffixed, &both}) {
    const std::vector<float> got = run_attn(c, *list, list->size());
    Mismatches mm;
    for (size_t i = 0; i < got.size(); ++i) mm.check(same_bits(got[i], base[i]), "out[" + std::to_string(i) + "]");
  }
}

TEST(KernelsAttention, SingleRowAndChunkOrder) {
  // One valid row with a sink far below its logit: the output is that row (p = 1 exactly).
  std::mt19937 rng(909);
  AttnCase c = make_attn_case(rng, 1, 0.0, 1);
  c.sink.assign(c.heads, -1000.0f);
  const std::vector<float> out = run_attn(c);
  for (int64_t h = 0; h < c.heads; ++h) {
    for (int64_t i = 0; i < c.d; ++i) EXPECT_TRUE(same_bits(out[h * c.d + i], c.rows[0][i]));
  }
  // Two identical rows: the mean of one row with itself is the row again.
  const std::vector<const float*> twice = {c.rows[0], nullptr, c.rows[0]};
  const std::vector<float> out2 = run_attn(c, twice, twice.size());
  for (size_t i = 0; i < out2.size(); ++i) EXPECT_NEAR(out2[i], out[i], bf16_ulp(out[i]) + 1e-30);
}

// ---- hyper-connections --------------------------------------------------------------------------

TEST(KernelsHc, SinkhornMatchesDouble) {
  std::mt19937 rng(1010);
  const int hc = 4;
  const float eps = 1e-6f;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int rep = 0; rep < 20; ++rep) {
    std::vector<float> mixes((2 + hc) * hc), base((2 + hc) * hc);
    for (auto& v : mixes) v = dist(rng) * 2.0f;
    for (auto& v : base) v = dist(rng);
    const float scale3[3] = {0.5f + 0.1f * static_cast<float>(rep), 1.0f, 2.0f};
    for (const int iters : {1, 2, 20}) {
      float pre[hc], post[hc], comb[hc * hc];
      reference::hc_split_sinkhorn(mixes.data(), scale3, base.data(), hc, iters, eps, pre, post, comb);

      // Slow: the same steps in double.
      const auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
      double cm[hc][hc];
      for (int j = 0; j < hc; ++j) {
        double mx = -1e300, s = 0.0;
        for (int k = 0; k < hc; ++k) {
          cm[j][k] = static_cast<double>(mixes[2 * hc + j * hc + k]) * scale3[2] + base[2 * hc + j * hc + k];
          mx = std::max(mx, cm[j][k]);
        }
        for (int k = 0; k < hc; ++k) s += (cm[j][k] = std::exp(cm[j][k] - mx));
        for (int k = 0; k < hc; ++k) cm[j][k] = cm[j][k] / s + eps;
      }
      const auto cols = [&] {
        for (int k = 0; k < hc; ++k) {
          double s = eps;
          for (int j = 0; j < hc; ++j) s += cm[j][k];
          for (int j = 0; j < hc; ++j) cm[j][k] /= s;
        }
      };
      cols();
      for (int it = 1; it < iters; ++it) {
        for (int j = 0; j < hc; ++j) {
          double s = eps;
          for (int k = 0; k < hc; ++k) s += cm[j][k];
          for (int k = 0; k < hc; ++k) cm[j][k] /= s;
        }
        cols();
      }
      Mismatches mm;
      for (int c = 0; c < hc; ++c) {
        const double p = sig(static_cast<double>(mixes[c]) * scale3[0] + base[c]) + eps;
        const double q = 2.0 * sig(static_cast<double>(mixes[hc + c]) * scale3[1] + base[hc + c]);
        mm.check(std::fabs(pre[c] - p) <= 1e-6 * p, "pre");
        mm.check(std::fabs(post[c] - q) <= 1e-6 * q, "post");
      }
      for (int j = 0; j < hc; ++j) {
        for (int k = 0; k < hc; ++k) {
          mm.check(std::fabs(comb[j * hc + k] - cm[j][k]) <= 1e-5 * cm[j][k] + 1e-9,
                   "comb[" + std::to_string(j) + "][" + std::to_string(k) + "] iters " + std::to_string(iters));
        }
      }
    }
  }
}

TEST(KernelsHc, SinkhornIsDoublyStochastic) {
  std::mt19937 rng(1111);
  const int hc = 4;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int rep = 0; rep < 50; ++rep) {
    std::vector<float> mixes((2 + hc) * hc), base((2 + hc) * hc);
    for (auto& v : mixes) v = dist(rng);
    for (auto& v : base) v = dist(rng);
    const float scale3[3] = {1.0f, 1.0f, 1.0f};
    float pre[hc], post[hc], comb[hc * hc];
    reference::hc_split_sinkhorn(mixes.data(), scale3, base.data(), hc, 20, 1e-6f, pre, post, comb);
    for (int c = 0; c < hc; ++c) {
      EXPECT_GT(pre[c], 0.0f);
      EXPECT_LT(pre[c], 1.0f + 2e-6f);
      EXPECT_GT(post[c], 0.0f);
      EXPECT_LT(post[c], 2.0f);
    }
    for (int i = 0; i < hc; ++i) {
      double row = 0.0, col = 0.0;
      for (int o = 0; o < hc; ++o) {
        row += comb[i * hc + o];
        col += comb[o * hc + i];
        EXPECT_GT(comb[i * hc + o], 0.0f);
      }
      EXPECT_NEAR(col, 1.0, 1e-5) << "column " << i;  // the last step normalised the columns
      EXPECT_NEAR(row, 1.0, 1e-3) << "row " << i;     // converged after 20 rounds
    }
  }
}

// ---- selection ----------------------------------------------------------------------------------

// Slow top-k: a stable sort by descending score keeps equal scores in index order.
std::vector<int32_t> slow_topk(const std::vector<float>& s, int64_t k) {
  std::vector<int32_t> idx(s.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return s[a] > s[b]; });
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

TEST(KernelsSelect, TopkTiesAndEdges) {
  const std::vector<float> hand = {1.0f, 3.0f, 3.0f, 2.0f, 3.0f};
  EXPECT_EQ(reference::topk_ascending(hand.data(), 5, 2), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(reference::topk_ascending(hand.data(), 5, 4), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_TRUE(reference::topk_ascending(hand.data(), 5, 0).empty());
  EXPECT_EQ(reference::topk_ascending(hand.data(), 5, 5), (std::vector<int32_t>{0, 1, 2, 3, 4}));
  // Fewer finite scores than k: the lowest-index -inf entries fill up.
  const std::vector<float> sparse = {-kInf, 0.5f, -kInf, -kInf, 2.0f, -kInf};
  EXPECT_EQ(reference::topk_ascending(sparse.data(), 6, 4), (std::vector<int32_t>{0, 1, 2, 4}));

  std::mt19937 rng(1212);
  std::uniform_int_distribution<int> small(0, 5);
  for (const int64_t n : {1, 7, 200, 1000}) {
    std::vector<float> s(n);
    for (auto& v : s) v = static_cast<float>(small(rng)) * 0.25f;  // many ties
    for (const int64_t k : {int64_t{0}, int64_t{1}, n / 3, n - 1, n}) {
      if (k < 0) continue;
      EXPECT_EQ(reference::topk_ascending(s.data(), n, k), slow_topk(s, k)) << "n " << n << " k " << k;
    }
  }
}

}  // namespace
