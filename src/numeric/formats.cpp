// Scalar number formats (model-spec §2.2, §3.1). Everything here is exact integer/bit arithmetic or
// exact power-of-two scaling, so the results do not depend on the floating-point environment.
#include "numeric/formats.h"

#include <bit>
#include <cassert>
#include <cmath>
#include <limits>

namespace dsv41 {

// ---- bf16 -------------------------------------------------------------------------------------

uint16_t bf16_from_f32(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  // NaN: keep sign and top payload bits, force the quiet bit so truncation cannot produce inf.
  if (std::isnan(x)) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  // Round to nearest even: add just under half an ulp, plus one when the kept lsb is odd, so an
  // exact tie rounds up only from an odd value. Infinities pass through (low half is zero), and a
  // finite value that rounds past the largest bf16 correctly becomes inf.
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7FFFu + lsb) >> 16);
}

float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

float round_bf16(float x) { return bf16_to_f32(bf16_from_f32(x)); }

// ---- e4m3fn -----------------------------------------------------------------------------------

float e4m3_to_f32(uint8_t code) {
  const bool neg = (code & 0x80u) != 0;
  const int exp = (code >> 3) & 0xF;
  const int man = code & 0x7;
  if (exp == 0xF && man == 0x7) return std::numeric_limits<float>::quiet_NaN();
  // Subnormals are man * 2^-9; normals are (8 + man) * 2^(exp - 10), i.e. 1.man * 2^(exp - 7).
  const float mag = exp == 0 ? std::ldexp(static_cast<float>(man), -9)
                             : std::ldexp(static_cast<float>(8 + man), exp - 10);
  return neg ? -mag : mag;
}

uint8_t e4m3_from_f32(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  // satfinite: clamp first, so nothing (not even inf) can round up past 448 = 1.75 * 2^8.
  const float a = std::fmin(std::fabs(x), 448.0f);
  // e = unbiased exponent of the e4m3 binade holding a; below 2^-6 the subnormal spacing 2^-9
  // applies, which is the spacing of binade -6. Either way the code step is 2^(e - 3).
  int e = -6;
  if (a >= 0x1p-6f) {
    std::frexp(a, &e);  // a = m * 2^e with m in [0.5, 1)
    e -= 1;
  }
  // q = a / 2^(e-3) lies in [0, 16); the power-of-two scaling is exact, as are the floor and the
  // fraction below, so the tie test is exact.
  const float scaled = std::ldexp(a, 3 - e);
  int q = static_cast<int>(scaled);
  const float frac = scaled - static_cast<float>(q);
  if (frac > 0.5f || (frac == 0.5f && (q & 1) != 0)) ++q;
  // With E = e + 7 the biased exponent, a normal code is E*8 + (q - 8) = (e + 6)*8 + q; for the
  // subnormal binade (e = -6) this is just q. A carry to q = 16 lands on the next binade's
  // mantissa 0, and a <= 448 keeps the result at most 0x7E.
  return static_cast<uint8_t>(sign | ((e + 6) * 8 + q));
}

// ---- ue8m0 ------------------------------------------------------------------------------------

float e8m0_to_f32(uint8_t code) {
  if (code == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(code) - 127);  // code 0 is the fp32 subnormal 2^-127
}

uint8_t e8m0_from_pow2(float pow2) {
  int e = 0;
  [[maybe_unused]] const float m = std::frexp(pow2, &e);  // pow2 = 0.5 * 2^e
  assert(m == 0.5f && e - 1 >= -127 && e - 1 <= 127 && "e8m0_from_pow2: not a power of two in range");
  return static_cast<uint8_t>(e - 1 + 127);
}

// ---- e2m1 -------------------------------------------------------------------------------------

namespace {
constexpr float kE2m1Mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
// Midpoints between consecutive magnitudes, and whether a tie there rounds up: ties go to the even
// code, and the upper neighbour is even exactly for the midpoints after odd codes 1, 3, 5.
constexpr float kE2m1Mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
constexpr bool kE2m1TieUp[7] = {false, true, false, true, false, true, false};
}  // namespace

float e2m1_to_f32(uint8_t code) {
  const float mag = kE2m1Mag[code & 0x7];
  return (code & 0x8) != 0 ? -mag : mag;
}

uint8_t e2m1_from_f32(float x) {
  const float a = std::fabs(x);
  // The code is the number of midpoints passed, counting a tie as passed only where it rounds up.
  int code = 0;
  for (int i = 0; i < 7; ++i) {
    if (a > kE2m1Mid[i] || (a == kE2m1Mid[i] && kE2m1TieUp[i])) ++code;
  }
  return static_cast<uint8_t>((std::signbit(x) ? 0x8 : 0x0) | code);
}

void pack_e2m1(const uint8_t* codes, size_t n, uint8_t* packed) {
  assert(n % 2 == 0);
  for (size_t i = 0; i < n / 2; ++i) {
    packed[i] = static_cast<uint8_t>((codes[2 * i] & 0xF) | ((codes[2 * i + 1] & 0xF) << 4));
  }
}

void unpack_e2m1(const uint8_t* packed, size_t n, uint8_t* codes) {
  assert(n % 2 == 0);
  for (size_t i = 0; i < n / 2; ++i) {
    codes[2 * i] = packed[i] & 0xF;
    codes[2 * i + 1] = static_cast<uint8_t>(packed[i] >> 4);
  }
}

}  // namespace dsv41
