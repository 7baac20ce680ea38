// The fast dequantization of gathered Engram rows (the op and its numerics are in kernels/backend.h,
// the reference in kernels/reference.h): FP8 e4m3 codes with one E8M0 scale per 32 channels, each
// value e4m3·2^(scale − 127) rounded to bf16. Every level gives the same bits (NaN codes and NaN
// scales give the same quiet NaN).
#pragma once

#include <cstdint>

namespace dsv41::detail {

// `blocks` blocks of 32 codes, each with its scale (rows are whole blocks, laid out back to back).
// Each needs its ISA (isa_supported); on a build without x86 SIMD they run the reference.
// Single-threaded: the backend splits the blocks over its workers.
void dequantize_fp8_blocks_avx2(const uint8_t* codes, const uint8_t* scales, int64_t blocks, float* out);
void dequantize_fp8_blocks_avx512(const uint8_t* codes, const uint8_t* scales, int64_t blocks, float* out);

// Below this many blocks (256 Ki values) a call stays on the calling thread: a decode step's 24 rows
// take microseconds, less than waking the pool.
constexpr int64_t kEngramParallelBlocks = 8192;
constexpr int64_t kEngramBlocksPerGrain = 256;

}  // namespace dsv41::detail
