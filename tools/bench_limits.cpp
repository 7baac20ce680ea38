#include "bench_limits.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>


namespace dsv41::cli {

namespace {
double seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

double measure_bandwidth_gbs(const Backend& backend, uint64_t bytes, int reps) {
  const size_t words = static_cast<size_t>(bytes / 8);
  std::vector<uint64_t> buf(words);
  for (size_t i = 0; i < words; ++i) buf[i] = i;  // touch every page before timing
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    std::vector<uint64_t> partial(64, 0);
    const auto t0 = std::chrono::steady_clock::now();
    backend.exec().parallel_for(static_cast<int64_t>(words), int64_t{1} << 20, [&](int64_t b, int64_t e, Scratch&) {
      uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;  // independent sums so the loads pipeline
      int64_t i = b;
      for (; i + 4 <= e; i += 4) {
        s0 += buf[i];
        s1 += buf[i + 1];
        s2 += buf[i + 2];
        s3 += buf[i + 3];
      }
      for (; i < e; ++i) s0 += buf[i];
      partial[static_cast<size_t>(b / (int64_t{1} << 20)) % 64] += s0 + s1 + s2 + s3;
    });
    const double t = seconds(t0);
    volatile uint64_t sink = partial[0];  // keep the reads
    (void)sink;
    best = std::max(best, static_cast<double>(bytes) / t / 1e9);
  }
  return best;
}

namespace {
// Best GFLOP/s of `call` (one m × k → n product) over `reps` timed calls after one warm-up.
template <class F>
double best_gflops(int64_t m, int64_t k, int64_t n, int reps, F&& call) {
  call();
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    best = std::max(best, 2.0 * static_cast<double>(m * n * k) / seconds(t0) / 1e9);
  }
  return best;
}

std::vector<float> activations(int64_t m, int64_t k) {
  std::vector<float> x(static_cast<size_t>(m * k));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i % 17) - 8) * 0.125f;  // -1 .. 1
  return x;
}
}  // namespace

double measure_fp8_gemm_gflops(const Backend& backend, int64_t m, int64_t k, int64_t n, int reps) {
  std::vector<uint8_t> w(static_cast<size_t>(n * k)), s(static_cast<size_t>(((n + 31) / 32) * ((k + 31) / 32)), 120);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint8_t>((i * 2654435761u) >> 24) & 0x7E;  // finite codes
  const std::vector<float> x = activations(m, k);
  std::vector<float> y(static_cast<size_t>(m * n));
  const Fp8Matrix W{w.data(), s.data(), n, k};
  return best_gflops(m, k, n, reps, [&] { backend.linear_fp8(x.data(), m, W, y.data()); });
}

double measure_fp4_gemm_gflops(const Backend& backend, int64_t m, int64_t k, int64_t n, int reps) {
  std::vector<uint8_t> w(static_cast<size_t>(n * k / 2)), s(static_cast<size_t>(n * (k / 32)), 124);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint8_t>((i * 2654435761u) >> 24);  // every E2M1 code is finite
  const std::vector<float> x = activations(m, k);
  std::vector<float> y(static_cast<size_t>(m * n));
  const Fp4Matrix W{w.data(), s.data(), n, k};
  return best_gflops(m, k, n, reps, [&] { backend.linear_fp4(x.data(), m, W, y.data()); });
}

}  // namespace dsv41::cli
