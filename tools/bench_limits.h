// Measured in the same run as the engine: the machine's streaming-read memory bandwidth (a limit of
// the hardware) and the rate of the project's own FP8 and FP4 GEMM kernels (reported against the
// units' register-only peaks of machine_peaks.h, never used as a limit themselves).
#pragma once

#include <cstdint>
#include <string>

#include "kernels/backend.h"

namespace dsv41::cli {

// GB/s of a sequential read on the backend's workers over `bytes` (far larger than the caches), best of `reps`.
double measure_bandwidth_gbs(const Backend& backend, uint64_t bytes = uint64_t{1} << 30, int reps = 3);
// GB/s of reading a model folder's .safetensors files from disk, the page cache bypassed: O_DIRECT
// reads of 8 MiB blocks by `threads` readers over the files in turn (buffered reads of files whose
// cached pages were dropped first where the filesystem refuses O_DIRECT), at most `bytes`; and how
// it read them ("direct" or "buffered").
struct DiskRead {
  double gbs = 0;
  uint64_t bytes = 0;
  std::string mode;
};
DiskRead measure_disk_read(const std::string& dir, uint64_t bytes = uint64_t{4} << 30, int threads = 4);

// GFLOP/s of the backend's linear_fp8 / linear_fp4 at m rows × k → n (2·m·n·k FLOPs per call), best
// of `reps`, on weights of finite codes with the checkpoint's block scales, packed for the backend's
// tiles as a loaded model's are.
double measure_fp8_gemm_gflops(const Backend& backend, int64_t m, int64_t k, int64_t n, int reps = 3);
double measure_fp4_gemm_gflops(const Backend& backend, int64_t m, int64_t k, int64_t n, int reps = 3);

}  // namespace dsv41::cli
