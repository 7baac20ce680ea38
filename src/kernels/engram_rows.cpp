// The scalar reference of the Engram row dequantization, and the dispatch to the fast versions
// (engram_rows_avx2.cpp, engram_rows_avx512.cpp), split over the kernel thread pool when large.
#include "kernels/engram_rows.h"

#include <algorithm>

#include "kernels/cpu_features.h"
#include "kernels/thread_pool.h"
#include "numeric/formats.h"

namespace dsv41 {

namespace {

constexpr int64_t kBlock = 32;  // channels per E8M0 scale
// Below this many blocks (256 Ki values) a call stays on the calling thread: a decode step's 24 rows
// take microseconds, less than waking the pool.
constexpr int64_t kParallelBlocks = 8192;
constexpr int64_t kBlocksPerGrain = 256;

}  // namespace

namespace detail {

void dequantize_fp8_blocks_scalar(const uint8_t* codes, const uint8_t* scales, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float scale = e8m0_to_f32(scales[b]);
    for (int64_t j = b * kBlock; j < (b + 1) * kBlock; ++j) out[j] = round_bf16(e4m3_to_f32(codes[j]) * scale);
  }
}

}  // namespace detail

void dequantize_engram_rows(const uint8_t* codes, const uint8_t* scales, int64_t rows, int64_t row_len, float* out) {
  using Fn = void (*)(const uint8_t*, const uint8_t*, int64_t, float*);
  Fn fn = detail::dequantize_fp8_blocks_scalar;
  switch (active_isa()) {
    case Isa::avx512:
      fn = detail::dequantize_fp8_blocks_avx512;
      break;
    case Isa::avx2:
      fn = detail::dequantize_fp8_blocks_avx2;
      break;
    case Isa::scalar:
      break;
  }
  const int64_t blocks = rows * (row_len / kBlock);
  if (blocks < kParallelBlocks) return fn(codes, scales, blocks, out);
  parallel_for(blocks, kBlocksPerGrain, [&](int64_t begin, int64_t end) {
    fn(codes + begin * kBlock, scales + begin, end - begin, out + begin * kBlock);
  });
}

}  // namespace dsv41
