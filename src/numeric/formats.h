// The scalar number formats of the checkpoint and of the reference's quantizers (model-spec §2.2, §3.1).
// Every conversion here is bit-exact with the reference: bf16 round-to-nearest-even, OCP e4m3fn with
// saturation, E2M1 with round-to-nearest-even ties, and UE8M0 power-of-two scales.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dsv41 {

// ---- bf16 -------------------------------------------------------------------------------------
// fp32 -> bf16 bits, round to nearest even; NaN stays NaN (quiet), infinities stay infinite.
uint16_t bf16_from_f32(float x);
float bf16_to_f32(uint16_t bits);
// x rounded to the nearest bf16 value, returned as fp32 (the reference's "cast to bf16").
float round_bf16(float x);

// ---- OCP FP8 e4m3fn (bias 7, no infinities, max 448, NaN = S.1111.111) --------------------------
float e4m3_to_f32(uint8_t code);
// Round to nearest even, saturating: |x| > 448 gives ±448 (CUDA satfinite). NaN gives 0x7F.
uint8_t e4m3_from_f32(float x);

// ---- UE8M0 scales (unsigned exponent only: value 2^(code-127), 0xFF = NaN) -----------------------
float e8m0_to_f32(uint8_t code);
// The code of a power of two in [2^-127, 2^127]; anything else is a programming error (asserts).
uint8_t e8m0_from_pow2(float pow2);

// ---- E2M1 (FP4): sign bit 3, magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6] --------------------------------
float e2m1_to_f32(uint8_t code);  // code in 0..15
// x must lie in [-6, 6]. Round to nearest; at an exact midpoint the result is the even code, so
// 0.75 -> 1, 1.75 -> 2, 3.5 -> 4 go up and 0.25, 1.25, 2.5, 5 go down. The sign of zero is kept.
uint8_t e2m1_from_f32(float x);

// Two codes per byte along the row: the low nibble holds the even element (model-spec §2.2).
// n must be even; `packed` has n/2 bytes.
void pack_e2m1(const uint8_t* codes, size_t n, uint8_t* packed);
void unpack_e2m1(const uint8_t* packed, size_t n, uint8_t* codes);

}  // namespace dsv41
