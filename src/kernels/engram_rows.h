// Dequantization of gathered Engram rows (model-spec §3.6): FP8 e4m3 codes with one E8M0 scale per
// 32 channels, each value e4m3·2^(scale − 127) rounded to bf16, as the reference's embedding lookup
// dequantizes them before the Engram projection.
#pragma once

#include <cstdint>

namespace dsv41 {

// out[r·row_len + j] = round_bf16(e4m3_to_f32(codes[r·row_len + j]) · e8m0_to_f32(scales[r·(row_len/32) + j/32]))
// for r < rows; row_len a positive multiple of 32. Runs at the active ISA level, on the kernel thread
// pool when large. Every level gives the same bits (NaN codes and NaN scales give the same quiet NaN).
void dequantize_engram_rows(const uint8_t* codes, const uint8_t* scales, int64_t rows, int64_t row_len, float* out);

namespace detail {

// The same over `blocks` blocks of 32 codes, each with its scale (rows are whole blocks, laid out
// back to back): the scalar reference and the fast versions (each needs its ISA: isa_supported; on a
// build without x86 SIMD they run the reference). Single-threaded; the tests compare them directly.
void dequantize_fp8_blocks_scalar(const uint8_t* codes, const uint8_t* scales, int64_t blocks, float* out);
void dequantize_fp8_blocks_avx2(const uint8_t* codes, const uint8_t* scales, int64_t blocks, float* out);
void dequantize_fp8_blocks_avx512(const uint8_t* codes, const uint8_t* scales, int64_t blocks, float* out);

}  // namespace detail

}  // namespace dsv41
