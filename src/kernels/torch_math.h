// exp, sigmoid and SiLU as the reference computes them: torch on CPU, whose vectorised kernels call
// Sleef's expf with 1-ulp accuracy (Sleef_expf8_u10, the AVX2 build with fused multiply-adds),
// not a correctly rounded exp. The two disagree on about 9% of fp32 inputs in [-30, 30], and one
// such ulp is enough to move a bf16 rounding downstream: in the mHC Sinkhorn's softmax it was the
// last source of differing values in the teacher-forced golden blocks (docs/agreement.md).
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
// tests/torch_math_test.cpp holds all three to the values torch itself computes, bit for bit.
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

inline float torch_sigmoid(float x) { return 1.0f / (1.0f + torch_exp(-x)); }

inline float torch_silu(float x) { return x / (1.0f + torch_exp(-x)); }

}  // namespace dsv41
