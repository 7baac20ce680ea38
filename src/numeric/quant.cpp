// The reference's activation quantizers (model-spec §3.1). Every step is fp32 exactly as the kernel
// writes it: real divisions where it divides, and one bf16 rounding of the dequantized product.
#include "numeric/quant.h"

#include <algorithm>
#include <bit>
#include <cassert>
#include <cmath>

#include "numeric/formats.h"

namespace dsv41 {

float pow2_ceil_scale(float amax, float max_inv) {
  // The kernel's rule on the fp32 product's bits: exponent field, plus one unless the mantissa is
  // zero (an exact power of two stays). A subnormal product (exponent field 0) therefore gives
  // 2^-126; the callers' amax floors keep the product normal anyway.
  const uint32_t bits = std::bit_cast<uint32_t>(amax * max_inv);
  const int exp = static_cast<int>((bits >> 23) & 0xFFu);
  const uint32_t man = bits & 0x7FFFFFu;
  const int log2ceil = exp - 127 + (man != 0 ? 1 : 0);
  return std::bit_cast<float>(static_cast<uint32_t>(log2ceil + 127) << 23);
}

namespace {

float block_amax(const float* x, size_t n) {
  float amax = 0.0f;
  for (size_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

// One FP8 block: e4m3 codes and the power-of-two scale.
float fp8_block(const float* x, uint8_t* codes) {
  const float amax = std::max(block_amax(x, kFp8Block), 1e-4f);
  const float s = pow2_ceil_scale(amax, 1.0f / 448.0f);
  for (size_t i = 0; i < kFp8Block; ++i) codes[i] = e4m3_from_f32(x[i] / s);
  return s;
}

// One FP4 block of n elements with the fp32 scale s already chosen: e2m1 codes of clamp(x/s, ±6).
void fp4_block_codes(const float* x, size_t n, float s, uint8_t* codes) {
  for (size_t i = 0; i < n; ++i) codes[i] = e2m1_from_f32(std::clamp(x[i] / s, -6.0f, 6.0f));
}

// E8M0 variant: power-of-two scale from amax floored at 6 * 2^-126 (so the scale is >= 2^-126).
float fp4_e8m0_block(const float* x, uint8_t* codes) {
  const float amax = std::max(block_amax(x, kFp4E8m0Block), 6.0f * 0x1p-126f);
  const float s = pow2_ceil_scale(amax, 1.0f / 6.0f);
  fp4_block_codes(x, kFp4E8m0Block, s, codes);
  return s;
}

// E4M3 variant: the scale is amax / 6 rounded to e4m3 (amax floored at 6 * 2^-9, so the scale is at
// least the smallest e4m3 subnormal and never zero). Returns the scale's e4m3 code.
uint8_t fp4_e4m3_block(const float* x, uint8_t* codes) {
  const float amax = std::max(block_amax(x, kFp4E4m3Block), 6.0f * 0x1p-9f);
  const uint8_t sc = e4m3_from_f32(amax / 6.0f);
  fp4_block_codes(x, kFp4E4m3Block, e4m3_to_f32(sc), codes);
  return sc;
}

}  // namespace

void act_quant_fp8(const float* x, size_t n, uint8_t* codes, float* scales) {
  assert(n % kFp8Block == 0);
  for (size_t b = 0; b < n / kFp8Block; ++b) {
    scales[b] = fp8_block(x + b * kFp8Block, codes + b * kFp8Block);
  }
}

void act_qdq_fp8(float* x, size_t n) {
  assert(n % kFp8Block == 0);
  uint8_t codes[kFp8Block];
  for (size_t b = 0; b < n; b += kFp8Block) {
    const float s = fp8_block(x + b, codes);
    for (size_t i = 0; i < kFp8Block; ++i) x[b + i] = round_bf16(e4m3_to_f32(codes[i]) * s);
  }
}

void fp4_quant_e8m0(const float* x, size_t n, uint8_t* packed, uint8_t* scales) {
  assert(n % kFp4E8m0Block == 0);
  uint8_t codes[kFp4E8m0Block];
  for (size_t b = 0; b < n / kFp4E8m0Block; ++b) {
    scales[b] = e8m0_from_pow2(fp4_e8m0_block(x + b * kFp4E8m0Block, codes));
    pack_e2m1(codes, kFp4E8m0Block, packed + b * kFp4E8m0Block / 2);
  }
}

void fp4_qdq_e8m0(float* x, size_t n) {
  assert(n % kFp4E8m0Block == 0);
  uint8_t codes[kFp4E8m0Block];
  for (size_t b = 0; b < n; b += kFp4E8m0Block) {
    const float s = fp4_e8m0_block(x + b, codes);
    for (size_t i = 0; i < kFp4E8m0Block; ++i) x[b + i] = round_bf16(e2m1_to_f32(codes[i]) * s);
  }
}

void fp4_quant_e4m3(const float* x, size_t n, uint8_t* packed, uint8_t* scales) {
  assert(n % kFp4E4m3Block == 0);
  uint8_t codes[kFp4E4m3Block];
  for (size_t b = 0; b < n / kFp4E4m3Block; ++b) {
    scales[b] = fp4_e4m3_block(x + b * kFp4E4m3Block, codes);
    pack_e2m1(codes, kFp4E4m3Block, packed + b * kFp4E4m3Block / 2);
  }
}

void fp4_qdq_e4m3(float* x, size_t n) {
  assert(n % kFp4E4m3Block == 0);
  uint8_t codes[kFp4E4m3Block];
  for (size_t b = 0; b < n; b += kFp4E4m3Block) {
    const float s = e4m3_to_f32(fp4_e4m3_block(x + b, codes));
    for (size_t i = 0; i < kFp4E4m3Block; ++i) x[b + i] = round_bf16(e2m1_to_f32(codes[i]) * s);
  }
}

}  // namespace dsv41
