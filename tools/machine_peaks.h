// The machine's arithmetic peaks, measured by register-only loops: each unit present (AMX-BF16
// tiles, AVX-512-BF16 dot products, AVX-512 and AVX2 fp32 FMA) runs independent accumulator chains
// that never touch memory, on every core at once. These are the ceilings a GEMM is judged against;
// the project's own kernels never serve as their own yardstick.
#pragma once

#include <string>
#include <vector>

namespace dsv41::cli {

struct UnitPeak {
  std::string unit;  // "amx_bf16", "avx512_bf16", "avx512_fp32_fma", "avx2_fp32_fma", "baseline_fp32"
  double gflops = 0;  // on `threads` cores together
  double gflops_per_core = 0;  // one core alone
};

// Every unit this CPU and OS can run, best first. `threads` cores run the loop together.
std::vector<UnitPeak> measure_unit_peaks(int threads);

}  // namespace dsv41::cli
