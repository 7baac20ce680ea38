// A library's GEMM beside the project's own kernels (bench --scenario gemm): oneDNN's bf16 matmul at
// the same shapes, where the build has oneDNN (Debian's libdnnl-dev; optional, CMakeLists.txt).
#pragma once

#include <cstdint>
#include <string>

namespace dsv41::cli {

// The library and its version ("oneDNN 2.6.3"), empty when the build has none.
std::string gemm_library();

// y[m, n] = x[m, k] · W[n, k]ᵀ with bf16 activations and weights and fp32 out, the weights reordered
// once into the layout the library picks (so they are read as bf16, 2 bytes each, where the
// project's FP8 and FP4 kernels read 1 and 0.5), on the library's own threads (all cores); the best
// GFLOP/s of `reps` calls after one untimed call. 0 when the build has no library.
double library_bf16_gemm_gflops(int64_t m, int64_t k, int64_t n, int reps);

}  // namespace dsv41::cli
