// exp, sigmoid, SiLU, log1p and softplus as the reference computes them: torch on CPU, whose
// vectorised kernels call Sleef's 1-ulp functions (Sleef_expf8_u10 and log1pf8_u10, the AVX2 build
// with fused multiply-adds), not correctly rounded ones. The exps differ at 9.4% of points in
// [-30, 30] (tests/torch_math_expected.h), and one such ulp is enough to move a bf16 rounding
// downstream: in the mHC Sinkhorn's softmax it was the last source of differing values in the
// teacher-forced golden blocks (docs/agreement.md).
//
// Sleef's algorithm, step by step (every `fma` one fused multiply-add, every other op one fp32
// rounding, as its vector code does):
//   q = rint(d · log2(e))                       (to nearest even, as cvtps2dq)
//   s = fma(q, -ln2_hi, d); s = fma(q, -ln2_lo, s)   (Cody-Waite: ln2 in two parts)
//   u = a degree-5 polynomial in s by Horner's rule, each step one fma
//   u = 1 + fma(s·s, u, s)
//   u = u · 2^(q>>1) · 2^(q - (q>>1))          (two exact scalings, so q up to ±150 fits)
//   d < -104 gives +0 and d > 100 gives +inf (the polynomial is not used there).
// torch's sigmoid is 1 / (1 + exp(-x)) and SiLU x / (1 + exp(-x)), each op rounded, with this exp.
//
// log1p (for softplus, log1p(exp(x)) below torch's threshold of 20) is Sleef's log1pf_u10 too:
// 1 + d split as m·2^e with m in [0.75, 1.5) (found on (1+d)/0.75's exponent), then log(1+m') =
// 2·atanh(m/(2+m)) in double-float arithmetic (pairs of fp32 carrying a value and its rounding
// error): e·ln2 as a pair times e, the quotient as a pair, a degree-2 polynomial in its square, and
// the pair summed last. tests/torch_math_test.cpp holds exp, sigmoid, SiLU and softplus to the values
// torch itself computes, bit for bit.
//
// The same arithmetic in scalar code: std::fma is one correctly rounded fused multiply-add (an
// instruction where the target has one, a libm routine otherwise), so every machine gets the same
// bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace dsv41 {

// The constants, shared with the vector forms in the ISA files (V::exp there).
namespace torch_exp_constants {
constexpr float kLog2e = 1.442695040888963407359924681001892137426645954152985934135449406931f;
constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187045e-06f;
// Horner's rule from the highest power down
constexpr float kPoly[6] = {0.000198527617612853646278381f, 0.00139304355252534151077271f,
                            0.00833336077630519866943359f,  0.0416664853692054748535156f,
                            0.166666671633720397949219f,    0.5f};
constexpr float kZeroBelow = -104.0f, kInfAbove = 100.0f;
}  // namespace torch_exp_constants

inline float torch_exp(float d) {
  using namespace torch_exp_constants;
  if (std::isnan(d)) return d;
  if (d < kZeroBelow) return 0.0f;
  if (d > kInfAbove) return std::numeric_limits<float>::infinity();
  const int q = static_cast<int>(std::nearbyint(d * kLog2e));
  const float qf = static_cast<float>(q);
  float s = std::fma(qf, -kLn2Hi, d);
  s = std::fma(qf, -kLn2Lo, s);
  float u = kPoly[0];
  for (int i = 1; i < 6; ++i) u = std::fma(u, s, kPoly[i]);
  u = 1.0f + std::fma(s * s, u, s);
  // 2^e as fp32 bits, e in [-126, 127] here (|q| <= 150 splits into halves of at most 75)
  const auto pow2 = [](int e) {
    const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  };
  const int half = q >> 1;
  return u * pow2(half) * pow2(q - half);
}

namespace torch_math_detail {

// A double-float: x + y with |y| <= ulp(x)/2, each half fp32 (Sleef's vfloat2).
struct Pair {
  float x, y;
};
inline float fma_pn(float a, float b, float c) { return std::fma(a, b, -c); }  // a·b − c, one rounding
inline float fma_np(float a, float b, float c) { return std::fma(-a, b, c); }  // c − a·b, one rounding
inline Pair mul(Pair a, float b) {
  const float s = a.x * b;
  return {s, std::fma(a.y, b, fma_pn(a.x, b, s))};
}
inline Pair div(Pair n, Pair d) {
  const float t = 1.0f / d.x, s = n.x * t, u = fma_pn(t, n.x, s);
  const float v = fma_np(d.y, t, fma_np(d.x, t, 1.0f));
  return {s, std::fma(s, v, std::fma(n.y, t, u))};
}
inline Pair add(float a, float b) {  // |a| >= |b|
  const float s = a + b;
  return {s, (a - s) + b};
}
inline Pair add(Pair a, Pair b) {
  const float s = a.x + b.x;
  return {s, (((a.x - s) + b.x) + a.y) + b.y};
}
inline Pair add(Pair a, float b) {
  const float s = a.x + b;
  return {s, ((a.x - s) + b) + a.y};
}
inline int32_t bits_of(float f) {
  int32_t i;
  std::memcpy(&i, &f, sizeof i);
  return i;
}
inline float float_of(int32_t i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}

}  // namespace torch_math_detail

// Sleef's log1pf_u10 for d <= 1e23 (beyond, Sleef takes its logf, which this does not reproduce;
// softplus never goes there).
inline float torch_log1p(float d) {
  using namespace torch_math_detail;
  if (d > 1e23f) return std::log(d);
  float dp1 = d + 1.0f;
  const bool tiny = dp1 < std::numeric_limits<float>::min();
  if (tiny) dp1 = dp1 * 18446744073709551616.0f;  // 2^64
  int32_t e = ((bits_of(dp1 * (1.0f / 0.75f)) >> 23) & 0xff) - 0x7f;
  const float t = float_of(bits_of(1.0f) + static_cast<int32_t>(static_cast<uint32_t>(-e) << 23));  // 2^-e
  const float m = std::fma(d, t, t - 1.0f);
  if (tiny) e -= 64;
  Pair s = mul({0.69314718246459960938f, -1.904654323148236017e-09f}, static_cast<float>(e));
  const Pair x = div({m, 0.0f}, add(2.0f, m));
  const float x2 = x.x * x.x;
  float p = 0.3027294874e+0f;
  p = std::fma(p, x2, 0.3996108174e+0f);
  p = std::fma(p, x2, 0.6666694880e+0f);
  s = add(s, Pair{x.x * 2.0f, x.y * 2.0f});
  s = add(s, (x2 * x.x) * p);
  float r = s.x + s.y;
  if (d > 1e38f) r = std::numeric_limits<float>::infinity();
  if (-1.0f > d || std::isnan(d)) r = std::numeric_limits<float>::quiet_NaN();
  if (d == -1.0f) r = -std::numeric_limits<float>::infinity();
  if (d == 0.0f && std::signbit(d)) r = -0.0f;
  return r;
}

// torch's softplus with beta 1 and threshold 20: x above the threshold, log1p(exp(x)) below.
inline float torch_softplus(float x) { return x > 20.0f ? x : torch_log1p(torch_exp(x)); }

inline float torch_sigmoid(float x) { return 1.0f / (1.0f + torch_exp(-x)); }

inline float torch_silu(float x) { return x / (1.0f + torch_exp(-x)); }

}  // namespace dsv41
