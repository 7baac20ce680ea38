// The reference's activation quantizers (model-spec §3.1): `act_quant` (FP8, blocks of 32,
// power-of-two scales) and both `fp4_act_quant` variants. Inputs are fp32 arrays that hold
// bf16-representable values (the reference's kernels take bf16 input); QDQ results are rounded to bf16.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dsv41 {

constexpr size_t kFp8Block = 32;     // act_quant group and weight tile edge
constexpr size_t kFp4E8m0Block = 32; // indexer q/k, MXFP4 experts
constexpr size_t kFp4E4m3Block = 16; // compressed main KV

// 2^ceil(log2(amax * max_inv)) by the kernel's exponent-bit rule: take the exponent field of the
// fp32 product and add one if its mantissa is nonzero. max_inv is fp32(1/448) or fp32(1/6).
float pow2_ceil_scale(float amax, float max_inv);

// FP8 act_quant with ue8m0 scales over blocks of 32. n % 32 == 0.
// codes: n e4m3 codes; scales: n/32 power-of-two scales (fp32 values).
void act_quant_fp8(const float* x, size_t n, uint8_t* codes, float* scales);
// In-place quantize-dequantize (the reference's inplace=True), results rounded to bf16.
void act_qdq_fp8(float* x, size_t n);

// FP4 with E8M0 scales per 32 (indexer q and keys). packed: n/2 bytes; scales: n/32 e8m0 codes.
void fp4_quant_e8m0(const float* x, size_t n, uint8_t* packed, uint8_t* scales);
void fp4_qdq_e8m0(float* x, size_t n);

// FP4 with E4M3 scales per 16 (compressed main KV). packed: n/2 bytes; scales: n/16 e4m3 codes.
void fp4_quant_e4m3(const float* x, size_t n, uint8_t* packed, uint8_t* scales);
void fp4_qdq_e4m3(float* x, size_t n);

}  // namespace dsv41
