// Bit-exact tests of src/numeric against slow, independent formulations written here: format values
// from sign/exponent/mantissa arithmetic, rounding by searching for the nearest representable value,
// and the quantizers re-derived step by step from model-spec §3.1 using only these slow helpers.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "numeric/formats.h"
#include "numeric/quant.h"

namespace {

using namespace dsv41;

static_assert(std::numeric_limits<float>::is_iec559, "the formats assume IEEE-754 binary32");
static_assert(std::numeric_limits<double>::is_iec559, "the slow references assume IEEE-754 binary64");
static_assert(kFp8Block == 32 && kFp4E8m0Block == 32 && kFp4E4m3Block == 16, "model-spec §3.1 block sizes");

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

uint32_t bits(float x) { return std::bit_cast<uint32_t>(x); }
float from_bits(uint32_t b) { return std::bit_cast<float>(b); }

std::string hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08X", v);
  return buf;
}
std::string desc(float x) { return std::to_string(x) + " (" + hex(bits(x)) + ")"; }

// Collects mismatches and reports the first few, so one bug does not print thousands of lines.
struct Mismatches {
  int count = 0;
  void check(bool ok, const std::string& what) {
    if (ok) return;
    if (++count <= 8) ADD_FAILURE() << what;
  }
  ~Mismatches() { EXPECT_EQ(count, 0) << "mismatches in total"; }
};

// ---- slow reference formulations --------------------------------------------------------------

// e4m3fn: S.EEEE.MMM, bias 7; exponent 0 is subnormal (m/8 * 2^-6); S.1111.111 is NaN.
double slow_e4m3_value(int code) {
  const int s = (code >> 7) & 1, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return kNaN;
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s != 0 ? -mag : mag;
}

// Nearest e4m3 to x after clamping to ±448, ties to the even mantissa (= even code).
uint8_t slow_e4m3_encode(float x) {
  if (std::isnan(x)) return 0x7F;
  const double a = std::min(std::fabs(static_cast<double>(x)), 448.0);
  int best = 0;
  double best_d = kInf;
  for (int c = 0; c <= 0x7E; ++c) {
    const double d = std::fabs(slow_e4m3_value(c) - a);
    if (d < best_d || (d == best_d && c % 2 == 0)) best = c, best_d = d;
  }
  return static_cast<uint8_t>((std::signbit(x) ? 0x80 : 0) | best);
}

constexpr double kE2m1[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

// Nearest e2m1 magnitude, ties to the even code; the sign bit comes from the sign of x.
uint8_t slow_e2m1_encode(float x) {
  const double a = std::fabs(static_cast<double>(x));
  int best = 0;
  double best_d = kInf;
  for (int c = 0; c < 8; ++c) {
    const double d = std::fabs(kE2m1[c] - a);
    if (d < best_d || (d == best_d && c % 2 == 0)) best = c, best_d = d;
  }
  return static_cast<uint8_t>((std::signbit(x) ? 8 : 0) | best);
}
double slow_e2m1_value(int code) { return (code & 8) != 0 ? -kE2m1[code & 7] : kE2m1[code & 7]; }

// bf16 S.EEEEEEEE.MMMMMMM, bias 127. With `unbounded` the all-ones exponent is read as an ordinary
// binade (2^128 for mantissa 0), which is where round-to-nearest places the overflow threshold.
double slow_bf16_value(uint16_t h, bool unbounded = false) {
  const int s = h >> 15, e = (h >> 7) & 0xFF, m = h & 0x7F;
  double mag;
  if (e == 0xFF && !unbounded) mag = m == 0 ? kInf : kNaN;
  else if (e == 0) mag = std::ldexp(m / 128.0, -126);
  else mag = std::ldexp(1.0 + m / 128.0, e - 127);
  return s != 0 ? -mag : mag;
}

// Nearest bf16 by comparing the two candidates around x, ties to even.
uint16_t slow_bf16_encode(float x) {
  const uint16_t lo = static_cast<uint16_t>(bits(x) >> 16);  // truncation toward zero
  if (std::isinf(x) || slow_bf16_value(lo) == static_cast<double>(x)) return lo;
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  const double dlo = std::fabs(static_cast<double>(x) - slow_bf16_value(lo, true));
  const double dhi = std::fabs(slow_bf16_value(hi, true) - static_cast<double>(x));
  if (dlo != dhi) return dlo < dhi ? lo : hi;
  return lo % 2 == 0 ? lo : hi;
}
float slow_round_bf16(float x) { return static_cast<float>(slow_bf16_value(slow_bf16_encode(x))); }

// ceil(log2(p)) for a positive normal float, by searching powers of two.
int slow_ceil_log2(float p) {
  for (int k = -149; k <= 128; ++k) {
    if (std::ldexp(1.0, k) >= static_cast<double>(p)) return k;
  }
  return 129;
}

float slow_block_amax(const float* x, size_t n) {
  double amax = 0.0;
  for (size_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
  return static_cast<float>(amax);
}

float slow_clamp6(float v) { return v < -6.0f ? -6.0f : (v > 6.0f ? 6.0f : v); }

struct SlowBlock {
  std::vector<uint8_t> codes;
  float scale = 0;         // fp32 scale value
  uint8_t scale_code = 0;  // e8m0 or e4m3 code of the scale (fp4 variants)
  std::vector<float> qdq;
};

SlowBlock slow_fp8_block(const float* x) {
  SlowBlock r;
  const float amax = std::max(slow_block_amax(x, 32), 1e-4f);
  const float inv448 = 1.0f / 448.0f;
  const float p = amax * inv448;
  EXPECT_GE(p, std::numeric_limits<float>::min());
  r.scale = static_cast<float>(std::ldexp(1.0, slow_ceil_log2(p)));
  for (size_t i = 0; i < 32; ++i) {
    const uint8_t q = slow_e4m3_encode(x[i] / r.scale);
    r.codes.push_back(q);
    r.qdq.push_back(slow_round_bf16(static_cast<float>(slow_e4m3_value(q)) * r.scale));
  }
  return r;
}

SlowBlock slow_fp4_e8m0_block(const float* x) {
  SlowBlock r;
  const float amax = std::max(slow_block_amax(x, 32), 6.0f * 0x1p-126f);
  const float inv6 = 1.0f / 6.0f;
  const float p = amax * inv6;
  EXPECT_GE(p, std::numeric_limits<float>::min());
  const int k = slow_ceil_log2(p);
  r.scale = static_cast<float>(std::ldexp(1.0, k));
  r.scale_code = static_cast<uint8_t>(k + 127);
  for (size_t i = 0; i < 32; ++i) {
    const uint8_t c = slow_e2m1_encode(slow_clamp6(x[i] / r.scale));
    r.codes.push_back(c);
    r.qdq.push_back(slow_round_bf16(static_cast<float>(slow_e2m1_value(c)) * r.scale));
  }
  return r;
}

SlowBlock slow_fp4_e4m3_block(const float* x) {
  SlowBlock r;
  const float amax = std::max(slow_block_amax(x, 16), 6.0f * 0x1p-9f);
  r.scale_code = slow_e4m3_encode(amax / 6.0f);
  r.scale = static_cast<float>(slow_e4m3_value(r.scale_code));
  for (size_t i = 0; i < 16; ++i) {
    const uint8_t c = slow_e2m1_encode(slow_clamp6(x[i] / r.scale));
    r.codes.push_back(c);
    r.qdq.push_back(slow_round_bf16(static_cast<float>(slow_e2m1_value(c)) * r.scale));
  }
  return r;
}

// ---- random inputs ----------------------------------------------------------------------------

int uniform_int(std::mt19937& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

// A random bf16-representable float with unbiased exponent in [elo, ehi] (the field is clamped to
// 0..254, so very small ranges give bf16 subnormals and zeros) and a random sign and mantissa.
float rand_bf16(std::mt19937& rng, int elo, int ehi) {
  const int field = std::clamp(uniform_int(rng, elo + 127, ehi + 127), 0, 254);
  const uint32_t sign = rng() & 1u, man = rng() & 0x7Fu;
  return from_bits((sign << 31) | (static_cast<uint32_t>(field) << 23) | (man << 16));
}

// Blocks of many kinds, in rotation: ordinary, all +0, mixed ±0, tiny/subnormal, huge (near the
// bf16 maximum), wide dynamic range, one outlier, amax near the quantizer's floor ([floor_lo,
// floor_hi] exponents), and a "grid" block whose amax is `top` and whose other elements come from
// `grid` (chosen so that x/s lands exactly on rounding ties).
std::vector<float> random_blocks(std::mt19937& rng, size_t block, size_t nblocks, int floor_lo, int floor_hi,
                                 float top, float (*grid)(std::mt19937&)) {
  std::vector<float> x(block * nblocks);
  for (size_t b = 0; b < nblocks; ++b) {
    float* xb = x.data() + b * block;
    const size_t kind = b % 9;
    for (size_t i = 0; i < block; ++i) {
      float v = 0.0f;
      switch (kind) {
        case 0: v = (rng() % 8 == 0) ? ((rng() & 1) ? -0.0f : 0.0f) : rand_bf16(rng, -12, 8); break;
        case 1: v = 0.0f; break;
        case 2: v = (rng() & 1) ? -0.0f : 0.0f; break;
        case 3: v = rand_bf16(rng, -140, -118); break;
        case 4: v = rand_bf16(rng, 100, 127); break;
        case 5: v = rand_bf16(rng, -40, 40); break;
        case 6: v = rand_bf16(rng, -10, 0); break;
        case 7: v = rand_bf16(rng, floor_lo, floor_hi); break;
        default: v = grid(rng); break;
      }
      xb[i] = v;
    }
    if (kind == 6) xb[rng() % block] = rand_bf16(rng, 10, 20);
    if (kind == 8) xb[rng() % block] = (rng() & 1) ? -top : top;
  }
  return x;
}

// e4m3 values and midpoints between neighbouring codes, below 448 (exact in bf16: 5 significant bits).
float grid_e4m3(std::mt19937& rng) {
  const int c = uniform_int(rng, 0, 0x7D);
  const double v = (rng() & 1) ? slow_e4m3_value(c) : (slow_e4m3_value(c) + slow_e4m3_value(c + 1)) / 2;
  return static_cast<float>((rng() & 1) ? -v : v);
}
// Multiples of 1/4 in [-6, 6]: every e2m1 value and every e2m1 midpoint.
float grid_quarter(std::mt19937& rng) { return static_cast<float>(uniform_int(rng, -24, 24)) / 4.0f; }

// ---- bf16 -------------------------------------------------------------------------------------

TEST(NumericBf16, RoundsToNearestEven) {
  EXPECT_EQ(bf16_from_f32(from_bits(0x3F808000u)), 0x3F80);  // tie, even stays
  EXPECT_EQ(bf16_from_f32(from_bits(0x3F818000u)), 0x3F82);  // tie, odd goes up
  EXPECT_EQ(bf16_from_f32(from_bits(0x3F808001u)), 0x3F81);  // just above the tie
  EXPECT_EQ(bf16_from_f32(from_bits(0x3F817FFFu)), 0x3F81);  // just below the tie
  EXPECT_EQ(bf16_from_f32(from_bits(0xBF818000u)), 0xBF82);  // negative tie
  EXPECT_EQ(bf16_from_f32(-0.0f), 0x8000);
  EXPECT_EQ(bf16_from_f32(from_bits(0x7F7FFFFFu)), 0x7F80);  // rounds past the maximum to inf
  EXPECT_EQ(bf16_from_f32(from_bits(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(bf16_from_f32(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(bf16_from_f32(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(bf16_from_f32(from_bits(0x00008000u)), 0x0000);  // subnormal tie to even zero
  EXPECT_EQ(bf16_from_f32(from_bits(0x00018000u)), 0x0002);
  EXPECT_FLOAT_EQ(bf16_to_f32(0x3F80), 1.0f);
  EXPECT_EQ(bits(round_bf16(from_bits(0x3F818000u))), 0x3F820000u);
}

TEST(NumericBf16, NaNStaysQuietNaN) {
  for (uint32_t b : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0x7F80FFFFu, 0xFF800001u, 0x7FFFFFFFu}) {
    const uint16_t h = bf16_from_f32(from_bits(b));
    EXPECT_EQ(h & 0x7F80, 0x7F80) << hex(b);
    EXPECT_NE(h & 0x0040, 0) << "quiet bit, " << hex(b);
    EXPECT_EQ(h >> 15, b >> 31) << "sign, " << hex(b);
    EXPECT_TRUE(std::isnan(round_bf16(from_bits(b)))) << hex(b);
  }
}

TEST(NumericBf16, RandomMatchesSlowNearest) {
  std::mt19937 rng(11);
  Mismatches mm;
  for (int i = 0; i < 400000; ++i) {
    uint32_t b = static_cast<uint32_t>(rng());
    if (i % 4 == 1) b = (b & 0xFFFF0000u) | 0x8000u;                            // exact ties
    if (i % 4 == 2) b = (b & 0xFFFF0000u) | ((rng() & 1) ? 0x8001u : 0x7FFFu);  // next to a tie
    if (i % 4 == 3) b &= 0xFFFF0000u;                                           // already bf16
    const float x = from_bits(b);
    if (std::isnan(x)) continue;
    const uint16_t want = slow_bf16_encode(x);
    mm.check(bf16_from_f32(x) == want, "bf16 of " + desc(x) + " want " + hex(want));
    mm.check(bits(round_bf16(x)) == bits(static_cast<float>(slow_bf16_value(want))),
             "round_bf16 of " + desc(x));
  }
  for (uint32_t h = 0; h < 0x10000u; ++h) {  // every bf16 decodes to its value
    const double want = slow_bf16_value(static_cast<uint16_t>(h));
    const float got = bf16_to_f32(static_cast<uint16_t>(h));
    mm.check(std::isnan(want) ? std::isnan(got) : static_cast<double>(got) == want, "bf16_to_f32 " + hex(h));
  }
}

// ---- e4m3 -------------------------------------------------------------------------------------

TEST(NumericE4m3, DecodesAllCodesAndReencodes) {
  Mismatches mm;
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const double want = slow_e4m3_value(c);
    const float got = e4m3_to_f32(code);
    if (std::isnan(want)) {
      mm.check(std::isnan(got), "code " + hex(code) + " should be NaN");
      mm.check(e4m3_from_f32(got) == 0x7F, "NaN encodes to 0x7F");
      continue;
    }
    mm.check(static_cast<double>(got) == want && std::signbit(got) == std::signbit(want),
             "decode " + hex(code) + " got " + desc(got));
    mm.check(e4m3_from_f32(got) == code, "re-encode " + hex(code));
  }
  // Spot values of the format itself.
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0xFE), -448.0f);
  EXPECT_EQ(e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), 0x1p-9f);
  EXPECT_EQ(e4m3_to_f32(0x08), 0x1p-6f);
  EXPECT_EQ(bits(e4m3_to_f32(0x80)), 0x80000000u);
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0xFF)));
}

TEST(NumericE4m3, SaturatesAndSpecialInputs) {
  EXPECT_EQ(e4m3_from_f32(448.0f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(449.0f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(464.0f), 0x7E);  // the 448/480 midpoint: clamped before rounding
  EXPECT_EQ(e4m3_from_f32(480.0f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(1e9f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(std::numeric_limits<float>::max()), 0x7E);
  EXPECT_EQ(e4m3_from_f32(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(e4m3_from_f32(-500.0f), 0xFE);
  EXPECT_EQ(e4m3_from_f32(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(e4m3_from_f32(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(e4m3_from_f32(0.0f), 0x00);
  EXPECT_EQ(e4m3_from_f32(-0.0f), 0x80);
  EXPECT_EQ(e4m3_from_f32(0x1p-10f), 0x00);        // half the smallest subnormal: tie to even zero
  EXPECT_EQ(e4m3_from_f32(-0x1p-10f), 0x80);
  EXPECT_EQ(e4m3_from_f32(0x1.000002p-10f), 0x01);  // just above that tie
  EXPECT_EQ(e4m3_from_f32(3 * 0x1p-10f), 0x02);     // subnormal tie 1.5 -> 2
  EXPECT_EQ(e4m3_from_f32(1.0625f), 0x38);          // 1 / 1.125 tie -> even 1.0
  EXPECT_EQ(e4m3_from_f32(1.1875f), 0x3A);          // 1.125 / 1.25 tie -> even 1.25
  EXPECT_EQ(e4m3_from_f32(15.5f), 0x58);            // 15 / 16 tie carries into the next binade
  EXPECT_EQ(e4m3_from_f32(std::numeric_limits<float>::denorm_min()), 0x00);
}

TEST(NumericE4m3, EncodesNearestEvenAtMidpointsAndRandom) {
  Mismatches mm;
  auto check = [&](float x) {
    const uint8_t want = slow_e4m3_encode(x);
    mm.check(e4m3_from_f32(x) == want, "e4m3 of " + desc(x) + " want " + hex(want));
  };
  for (int c = 0; c < 0x7E; ++c) {  // every midpoint between consecutive positive codes, and its neighbours
    const float mid = static_cast<float>((slow_e4m3_value(c) + slow_e4m3_value(c + 1)) / 2);
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      check(v);
      check(-v);
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 300000; ++i) {
    if (i % 2 == 0) {
      check(from_bits(static_cast<uint32_t>(rng())));  // any fp32, incl. subnormals, huge, inf
    } else {
      // Concentrated on the e4m3 range (2^-12 .. 2^10) with full fp32 mantissas.
      const uint32_t field = static_cast<uint32_t>(uniform_int(rng, 127 - 12, 127 + 10));
      check(from_bits((static_cast<uint32_t>(rng()) & 0x807FFFFFu) | (field << 23)));
    }
  }
}

// ---- e2m1 -------------------------------------------------------------------------------------

TEST(NumericE2m1, AllCodesRoundTrip) {
  for (int c = 0; c < 16; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float v = e2m1_to_f32(code);
    EXPECT_EQ(static_cast<double>(v), slow_e2m1_value(c)) << c;
    EXPECT_EQ(std::signbit(v), c >= 8) << c;
    EXPECT_EQ(e2m1_from_f32(v), code) << c;
  }
}

TEST(NumericE2m1, TiesAndSigns) {
  const struct { float x; uint8_t code; } cases[] = {
      {0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4}, {3.5f, 6}, {5.0f, 6},
      {0.2f, 0},  {0.3f, 1},  {5.01f, 7}, {4.99f, 6}, {6.0f, 7}, {0.0f, 0},
  };
  for (const auto& t : cases) {
    EXPECT_EQ(e2m1_from_f32(t.x), t.code) << t.x;
    EXPECT_EQ(e2m1_from_f32(-t.x), t.code | 8) << -t.x;
  }
  EXPECT_EQ(e2m1_from_f32(-0.0f), 8);
  EXPECT_EQ(e2m1_from_f32(-0.1f), 8);  // rounds to zero but keeps the sign
}

TEST(NumericE2m1, RandomMatchesSlowNearestEven) {
  Mismatches mm;
  auto check = [&](float x) {
    const uint8_t want = slow_e2m1_encode(x);
    mm.check(e2m1_from_f32(x) == want, "e2m1 of " + desc(x) + " want " + std::to_string(want));
  };
  for (int k = -48; k <= 48; ++k) {  // the 1/8 grid holds every value and midpoint
    const float v = static_cast<float>(k) / 8.0f;
    check(v);
    if (k != 48) check(std::nextafter(v, 7.0f));
    if (k != -48) check(std::nextafter(v, -7.0f));
  }
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-6.0f, 6.0f);
  for (int i = 0; i < 200000; ++i) check(dist(rng));
}

TEST(NumericE2m1, PackLowNibbleIsEvenElement) {
  const uint8_t codes[6] = {0x1, 0xA, 0xF, 0x0, 0x7, 0x8};
  uint8_t packed[3] = {};
  pack_e2m1(codes, 6, packed);
  EXPECT_EQ(packed[0], 0xA1);
  EXPECT_EQ(packed[1], 0x0F);
  EXPECT_EQ(packed[2], 0x87);
  uint8_t back[6] = {};
  unpack_e2m1(packed, 6, back);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(back[i], codes[i]) << i;
  const uint8_t one[1] = {0x3C};
  unpack_e2m1(one, 2, back);
  EXPECT_EQ(back[0], 0xC);
  EXPECT_EQ(back[1], 0x3);
}

// ---- ue8m0 ------------------------------------------------------------------------------------

TEST(NumericE8m0, AllFiniteCodesRoundTrip) {
  for (int c = 0; c < 255; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float v = e8m0_to_f32(code);
    EXPECT_EQ(static_cast<double>(v), std::ldexp(1.0, c - 127)) << c;
    EXPECT_EQ(e8m0_from_pow2(v), code) << c;
  }
  EXPECT_TRUE(std::isnan(e8m0_to_f32(0xFF)));
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
}

// ---- pow2_ceil_scale --------------------------------------------------------------------------

TEST(NumericPow2Ceil, PowersStayOthersGoUp) {
  for (int k = -126; k <= 127; ++k) {
    const float p = std::ldexp(1.0f, k);
    EXPECT_EQ(pow2_ceil_scale(p, 1.0f), p) << k;
    if (k < 127) {
      EXPECT_EQ(pow2_ceil_scale(std::nextafter(p, 1e38f), 1.0f), 2 * p) << k;
    }
    if (k > -126) {
      EXPECT_EQ(pow2_ceil_scale(std::nextafter(p, 0.0f), 1.0f), p) << k;
    }
  }
  EXPECT_EQ(pow2_ceil_scale(448.0f, 1.0f / 448.0f), 1.0f);  // fp32 448 * fp32(1/448) rounds to 1
  EXPECT_EQ(pow2_ceil_scale(449.0f, 1.0f / 448.0f), 2.0f);
  EXPECT_EQ(pow2_ceil_scale(6.0f, 1.0f / 6.0f), 1.0f);
  EXPECT_EQ(pow2_ceil_scale(1e-4f, 1.0f / 448.0f), 0x1p-22f);  // act_quant's floor
  // The kernel's bit rule on a subnormal product (exponent field 0) gives 2^-126.
  EXPECT_EQ(pow2_ceil_scale(0x1p-140f, 1.0f), 0x1p-126f);
}

TEST(NumericPow2Ceil, RandomMatchesSlowCeilLog2) {
  std::mt19937 rng(3);
  Mismatches mm;
  const float invs[] = {1.0f / 448.0f, 1.0f / 6.0f, 1.0f};
  for (int i = 0; i < 300000; ++i) {
    const float amax = from_bits(static_cast<uint32_t>(rng()) & 0x7FFFFFFFu);
    const float inv = invs[i % 3];
    const float p = amax * inv;
    if (!(p >= std::numeric_limits<float>::min() && p <= 0x1p127f)) continue;  // normal, result finite
    const float want = static_cast<float>(std::ldexp(1.0, slow_ceil_log2(p)));
    mm.check(bits(pow2_ceil_scale(amax, inv)) == bits(want), "pow2_ceil of " + desc(amax));
  }
}

// ---- quantizers -------------------------------------------------------------------------------

TEST(NumericActQuant, Fp8MatchesSlowReference) {
  std::mt19937 rng(101);
  const size_t nb = 9 * 60, n = nb * 32;
  const std::vector<float> x = random_blocks(rng, 32, nb, -16, -11, 448.0f, grid_e4m3);
  std::vector<uint8_t> codes(n);
  std::vector<float> scales(nb);
  act_quant_fp8(x.data(), n, codes.data(), scales.data());
  std::vector<float> qdq = x;
  act_qdq_fp8(qdq.data(), n);
  Mismatches mm;
  for (size_t b = 0; b < nb; ++b) {
    const SlowBlock want = slow_fp8_block(x.data() + b * 32);
    mm.check(bits(scales[b]) == bits(want.scale), "block " + std::to_string(b) + " scale " + desc(scales[b]));
    for (size_t i = 0; i < 32; ++i) {
      const size_t j = b * 32 + i;
      const std::string at = "block " + std::to_string(b) + " elem " + std::to_string(i) + " x=" + desc(x[j]);
      mm.check(codes[j] == want.codes[i], at + " code " + hex(codes[j]) + " want " + hex(want.codes[i]));
      mm.check(bits(qdq[j]) == bits(want.qdq[i]), at + " qdq " + desc(qdq[j]) + " want " + desc(want.qdq[i]));
      // The in-place QDQ is exactly the dequantized codes.
      mm.check(bits(qdq[j]) == bits(round_bf16(e4m3_to_f32(codes[j]) * scales[b])), at + " qdq vs dequant");
    }
  }
}

TEST(NumericActQuant, Fp4E8m0MatchesSlowReference) {
  std::mt19937 rng(202);
  const size_t nb = 9 * 60, n = nb * 32;
  const std::vector<float> x = random_blocks(rng, 32, nb, -128, -121, 6.0f, grid_quarter);
  std::vector<uint8_t> packed(n / 2), scales(nb), codes(n);
  fp4_quant_e8m0(x.data(), n, packed.data(), scales.data());
  unpack_e2m1(packed.data(), n, codes.data());
  std::vector<float> qdq = x;
  fp4_qdq_e8m0(qdq.data(), n);
  Mismatches mm;
  for (size_t b = 0; b < nb; ++b) {
    const SlowBlock want = slow_fp4_e8m0_block(x.data() + b * 32);
    mm.check(scales[b] == want.scale_code, "block " + std::to_string(b) + " scale code " + hex(scales[b]));
    for (size_t i = 0; i < 32; ++i) {
      const size_t j = b * 32 + i;
      const std::string at = "block " + std::to_string(b) + " elem " + std::to_string(i) + " x=" + desc(x[j]);
      mm.check(codes[j] == want.codes[i], at + " code " + hex(codes[j]) + " want " + hex(want.codes[i]));
      mm.check(bits(qdq[j]) == bits(want.qdq[i]), at + " qdq " + desc(qdq[j]) + " want " + desc(want.qdq[i]));
      mm.check(bits(qdq[j]) == bits(round_bf16(e2m1_to_f32(codes[j]) * e8m0_to_f32(scales[b]))),
               at + " qdq vs dequant");
    }
  }
}

TEST(NumericActQuant, Fp4E4m3MatchesSlowReference) {
  std::mt19937 rng(303);
  const size_t nb = 9 * 100, n = nb * 16;
  const std::vector<float> x = random_blocks(rng, 16, nb, -10, -5, 6.0f, grid_quarter);
  std::vector<uint8_t> packed(n / 2), scales(nb), codes(n);
  fp4_quant_e4m3(x.data(), n, packed.data(), scales.data());
  unpack_e2m1(packed.data(), n, codes.data());
  std::vector<float> qdq = x;
  fp4_qdq_e4m3(qdq.data(), n);
  Mismatches mm;
  for (size_t b = 0; b < nb; ++b) {
    const SlowBlock want = slow_fp4_e4m3_block(x.data() + b * 16);
    mm.check(scales[b] == want.scale_code, "block " + std::to_string(b) + " scale code " + hex(scales[b]) +
                                               " want " + hex(want.scale_code));
    for (size_t i = 0; i < 16; ++i) {
      const size_t j = b * 16 + i;
      const std::string at = "block " + std::to_string(b) + " elem " + std::to_string(i) + " x=" + desc(x[j]);
      mm.check(codes[j] == want.codes[i], at + " code " + hex(codes[j]) + " want " + hex(want.codes[i]));
      mm.check(bits(qdq[j]) == bits(want.qdq[i]), at + " qdq " + desc(qdq[j]) + " want " + desc(want.qdq[i]));
      mm.check(bits(qdq[j]) == bits(round_bf16(e2m1_to_f32(codes[j]) * e4m3_to_f32(scales[b]))),
               at + " qdq vs dequant");
    }
  }
}

// The E4M3 variant's scale is not a power of two, so "true division" matters: x / s can sit exactly
// on an e2m1 tie (x = s * 0.75) where x * (1/s) lands an ulp off it, and amax / 6 can sit exactly on,
// or an ulp beside, an e4m3 rounding tie (amax = 6 * midpoint). These blocks hit both.
TEST(NumericActQuant, Fp4E4m3DivisionTies) {
  // e2m1 values and midpoints with at most 3 significant bits, so s * g stays exact in bf16.
  const float g[] = {0.0f, 0.25f, 0.5f, 0.75f, 1.0f, 1.25f, 1.5f, 1.75f, 2.0f, 2.5f, 3.0f, 3.5f, 4.0f, 5.0f};
  std::mt19937 rng(404);
  std::vector<float> x;
  for (int c = 1; c < 0x7E; ++c) {
    for (int half = 0; half < 2; ++half) {
      // amax / 6 is a code's value or the midpoint to the next code (bf16-exact: 6 * m has <= 7 bits).
      const double m = half != 0 ? (slow_e4m3_value(c) + slow_e4m3_value(c + 1)) / 2 : slow_e4m3_value(c);
      const float top = static_cast<float>(6 * m);
      const float s = static_cast<float>(slow_e4m3_value(slow_e4m3_encode(top / 6.0f)));
      std::vector<float> blk(16);
      for (float& v : blk) v = static_cast<float>(g[rng() % std::size(g)]) * s * ((rng() & 1) ? -1.0f : 1.0f);
      blk[rng() % 16] = (rng() & 1) ? -top : top;
      x.insert(x.end(), blk.begin(), blk.end());
    }
  }
  for (float v : x) ASSERT_EQ(bits(v) & 0xFFFFu, 0u) << "input must be bf16: " << desc(v);
  // For bf16 inputs amax * fp32(1/6) happens to round like amax / 6; an fp32 amax one ulp beside
  // 6 * midpoint pins the division as written (the quantizers accept any fp32).
  for (int c = 1; c < 0x7E; ++c) {
    const float top = static_cast<float>(3 * (slow_e4m3_value(c) + slow_e4m3_value(c + 1)));
    for (float t : {std::nextafter(top, 0.0f), std::nextafter(top, 1e9f)}) {
      x.push_back(t);
      x.insert(x.end(), 15, 0.0f);
    }
  }
  const size_t n = x.size(), nb = n / 16;
  std::vector<uint8_t> packed(n / 2), scales(nb), codes(n);
  fp4_quant_e4m3(x.data(), n, packed.data(), scales.data());
  unpack_e2m1(packed.data(), n, codes.data());
  std::vector<float> qdq = x;
  fp4_qdq_e4m3(qdq.data(), n);
  Mismatches mm;
  for (size_t b = 0; b < nb; ++b) {
    const SlowBlock want = slow_fp4_e4m3_block(x.data() + b * 16);
    mm.check(scales[b] == want.scale_code, "block " + std::to_string(b) + " scale code " + hex(scales[b]) +
                                               " want " + hex(want.scale_code));
    for (size_t i = 0; i < 16; ++i) {
      const size_t j = b * 16 + i;
      const std::string at = "block " + std::to_string(b) + " elem " + std::to_string(i) + " x=" + desc(x[j]);
      mm.check(codes[j] == want.codes[i], at + " code " + hex(codes[j]) + " want " + hex(want.codes[i]));
      mm.check(bits(qdq[j]) == bits(want.qdq[i]), at + " qdq " + desc(qdq[j]) + " want " + desc(want.qdq[i]));
    }
  }
}

// Hand-checked blocks: the scales and the e2m1 ties of model-spec §3.1.
TEST(NumericActQuant, KnownAnswers) {
  // FP8: amax 448 gives scale 1, so values encode directly; 1.0625 ties down to 1, 464 cannot occur.
  std::vector<float> x(32, 0.0f);
  x[0] = 448.0f, x[1] = 1.0625f, x[2] = -1.1875f, x[3] = -0.0f;
  std::vector<uint8_t> codes(32);
  float scale = 0;
  act_quant_fp8(x.data(), 32, codes.data(), &scale);
  EXPECT_EQ(scale, 1.0f);
  EXPECT_EQ(codes[0], 0x7E);
  EXPECT_EQ(codes[1], 0x38);
  EXPECT_EQ(codes[2], 0xBA);
  EXPECT_EQ(codes[3], 0x80);
  // An all-zero block uses the 1e-4 floor: scale 2^-22, codes 0.
  std::vector<float> z(32, 0.0f);
  act_quant_fp8(z.data(), 32, codes.data(), &scale);
  EXPECT_EQ(scale, 0x1p-22f);

  // FP4 E4M3: amax 6 gives scale e4m3(1.0) = 0x38; the tie list of §3.1.
  std::vector<float> f = {6.0f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f,
                          -6.0f, -0.25f, -0.75f, -1.25f, -1.75f, -2.5f, -3.5f, -0.0f};
  std::vector<uint8_t> packed(8), sc(1), c(16);
  fp4_quant_e4m3(f.data(), 16, packed.data(), sc.data());
  unpack_e2m1(packed.data(), 16, c.data());
  EXPECT_EQ(sc[0], 0x38);
  const uint8_t want[16] = {7, 0, 2, 2, 4, 4, 6, 6, 15, 8, 10, 10, 12, 12, 14, 8};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(c[i], want[i]) << i;
  fp4_qdq_e4m3(f.data(), 16);
  EXPECT_EQ(f[2], 1.0f);
  EXPECT_EQ(f[6], 4.0f);
  EXPECT_EQ(f[7], 4.0f);
  EXPECT_EQ(bits(f[15]), 0x80000000u);

  // FP4 E4M3 with amax 100: scale e4m3(100/6 = 16.67) = 16 (code 0x58), so 100/16 = 6.25 clamps to 6.
  std::vector<float> g(16, 0.0f);
  g[0] = 100.0f, g[1] = 12.0f;
  fp4_quant_e4m3(g.data(), 16, packed.data(), sc.data());
  unpack_e2m1(packed.data(), 16, c.data());
  EXPECT_EQ(sc[0], 0x58);
  EXPECT_EQ(c[0], 7);  // 6 * 16 = 96
  EXPECT_EQ(c[1], 2);  // 12/16 = 0.75 ties up to 1.0
  fp4_qdq_e4m3(g.data(), 16);
  EXPECT_EQ(g[0], 96.0f);
  EXPECT_EQ(g[1], 16.0f);

  // FP4 E8M0: an all-zero block gets the floor scale 2^-126 (e8m0 code 1); amax 6 gives 2^0 (127).
  std::vector<float> h(32, 0.0f);
  std::vector<uint8_t> p32(16), s32(1);
  fp4_quant_e8m0(h.data(), 32, p32.data(), s32.data());
  EXPECT_EQ(s32[0], 1);
  h[5] = 6.0f, h[6] = -1.75f, h[7] = 2.5f;
  fp4_quant_e8m0(h.data(), 32, p32.data(), s32.data());
  EXPECT_EQ(s32[0], 127);
  EXPECT_EQ(p32[2] >> 4, 7);  // element 5
  EXPECT_EQ(p32[3], 0x4C);    // elements 6 (-2.0, code 12) and 7 (2.0, code 4)
}

}  // namespace
