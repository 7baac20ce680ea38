#include "library_gemm.h"

#include <algorithm>
#include <chrono>

#if defined(DSV41_HAVE_ONEDNN)
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace dsv41::cli {

#if defined(DSV41_HAVE_ONEDNN)

std::string gemm_library() {
  const dnnl_version_t* v = dnnl::version();
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
}

double library_bf16_gemm_gflops(int64_t m, int64_t k, int64_t n, int reps) {
  using dnnl::memory;
  const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const memory::desc x_desc({m, k}, memory::data_type::bf16, memory::format_tag::ab);
  const memory::desc w_rows({k, n}, memory::data_type::bf16, memory::format_tag::ba);  // W[n, k], row-major
  const memory::desc w_any({k, n}, memory::data_type::bf16, memory::format_tag::any);
  const memory::desc y_desc({m, n}, memory::data_type::f32, memory::format_tag::ab);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(x_desc, w_any, y_desc), engine);
  memory x(x_desc, engine), w_checkpoint(w_rows, engine), w(pd.weights_desc(), engine), y(y_desc, engine);
  // bf16 inputs of small integers times powers of two, as act_quant'ed activations and decoded weights are
  auto* xs = static_cast<uint16_t*>(x.get_data_handle());
  for (int64_t i = 0; i < m * k; ++i) xs[i] = static_cast<uint16_t>(0x3F80 + ((i * 7) % 5) * 0x20);
  auto* ws = static_cast<uint16_t*>(w_checkpoint.get_data_handle());
  for (int64_t i = 0; i < n * k; ++i) ws[i] = static_cast<uint16_t>(0x3C00 + ((i * 13) % 7) * 0x10);
  dnnl::reorder(w_checkpoint, w).execute(stream, w_checkpoint, w);
  const dnnl::matmul matmul(pd);
  const auto call = [&] {
    matmul.execute(stream, {{DNNL_ARG_SRC, x}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, y}});
    stream.wait();
  };
  call();
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * static_cast<double>(m * n * k) / s / 1e9);
  }
  return best;
}

#else

std::string gemm_library() { return ""; }
double library_bf16_gemm_gflops(int64_t, int64_t, int64_t, int) { return 0; }

#endif

}  // namespace dsv41::cli
