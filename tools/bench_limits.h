// The machine's own limits, measured in the same run as the engine: streaming-read memory bandwidth
// and the FLOP rate of the FP8 GEMM kernel the prefill uses.
#pragma once

#include <cstdint>

#include "kernels/backend.h"

namespace dsv41::cli {

// GB/s of a sequential read on the backend's workers over `bytes` (far larger than the caches), best of `reps`.
double measure_bandwidth_gbs(const Backend& backend, uint64_t bytes = uint64_t{1} << 30, int reps = 3);
// GFLOP/s of the backend's linear_fp8 at m rows × k → n (2·m·n·k FLOPs per call), best of `reps`.
double measure_fp8_gemm_gflops(const Backend& backend, int64_t m = 256, int64_t k = 5120, int64_t n = 2048,
                               int reps = 3);

}  // namespace dsv41::cli
