#include "machine_peaks.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include "kernels/amx_tile_config.h"
#include "kernels/cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace dsv41::cli {

namespace {

// Each loop returns the FLOPs it did and leaves one result in `sink`, so nothing can be dropped.
// Independent chains: enough accumulators to cover the unit's latency × issue width on current
// cores (fp32 FMA: latency 4-5, two pipes, so 10+ chains; tdpbf16ps: four accumulator tiles fed by
// two A and two B tiles, as a GEMM microkernel does).
using Loop = double (*)(int64_t iters, float* sink);

// Plain fp32 multiply-add in the build's baseline instruction set, for CPUs with none of the above.
double baseline_fp32_loop(int64_t iters, float* sink) {
  float c[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  const float a = 0.999999f, b = 0.5f;
  for (int64_t i = 0; i < iters; ++i) {
    for (float& x : c) x = x * a + b;
  }
  float s = 0;
  for (float x : c) s += x;
  *sink = s;
  return 2.0 * 8 * static_cast<double>(iters);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) double avx2_fma_loop(int64_t iters, float* sink) {
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(0.5f);
  __m256 c0 = _mm256_set1_ps(0), c1 = _mm256_set1_ps(1), c2 = _mm256_set1_ps(2), c3 = _mm256_set1_ps(3);
  __m256 c4 = _mm256_set1_ps(4), c5 = _mm256_set1_ps(5), c6 = _mm256_set1_ps(6), c7 = _mm256_set1_ps(7);
  __m256 c8 = _mm256_set1_ps(8), c9 = _mm256_set1_ps(9), c10 = _mm256_set1_ps(10), c11 = _mm256_set1_ps(11);
  for (int64_t i = 0; i < iters; ++i) {
    c0 = _mm256_fmadd_ps(c0, a, b), c1 = _mm256_fmadd_ps(c1, a, b), c2 = _mm256_fmadd_ps(c2, a, b);
    c3 = _mm256_fmadd_ps(c3, a, b), c4 = _mm256_fmadd_ps(c4, a, b), c5 = _mm256_fmadd_ps(c5, a, b);
    c6 = _mm256_fmadd_ps(c6, a, b), c7 = _mm256_fmadd_ps(c7, a, b), c8 = _mm256_fmadd_ps(c8, a, b);
    c9 = _mm256_fmadd_ps(c9, a, b), c10 = _mm256_fmadd_ps(c10, a, b), c11 = _mm256_fmadd_ps(c11, a, b);
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
                           _mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7)));
  s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(c8, c9), _mm256_add_ps(c10, c11)));
  *sink = _mm256_cvtss_f32(s);
  return 2.0 * 8 * 12 * static_cast<double>(iters);
}

// 16 chains of 16 lanes: covers two 512-bit FMA pipes at latency 4 with room to spare.
__attribute__((target("avx512f"))) double avx512_fma_loop(int64_t iters, float* sink) {
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(0.5f);
  __m512 c[16];
  for (int j = 0; j < 16; ++j) c[j] = _mm512_set1_ps(static_cast<float>(j));
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) c[j] = _mm512_fmadd_ps(c[j], a, b);
  }
  __m512 s = c[0];
  for (int j = 1; j < 16; ++j) s = _mm512_add_ps(s, c[j]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);  // (not _mm512_reduce_add_ps: GCC 12 warns inside its own header)
  *sink = lanes[0] + lanes[15];
  return 2.0 * 16 * 16 * static_cast<double>(iters);
}

// vdpbf16ps: per fp32 lane, two bf16 products added to the accumulator (4 FLOPs per lane).
__attribute__((target("avx512f,avx512bf16"))) double avx512_bf16_loop(int64_t iters, float* sink) {
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80);  // bf16 pairs (1.0, 1.0)
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3C003C00);  // (2^-7, 2^-7): sums stay small
  __m512 c[16];
  for (int j = 0; j < 16; ++j) c[j] = _mm512_set1_ps(static_cast<float>(j));
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) c[j] = _mm512_dpbf16_ps(c[j], a, b);
  }
  __m512 s = c[0];
  for (int j = 1; j < 16; ++j) s = _mm512_add_ps(s, c[j]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);  // (not _mm512_reduce_add_ps: GCC 12 warns inside its own header)
  *sink = lanes[0] + lanes[15];
  return 4.0 * 16 * 16 * static_cast<double>(iters);
}

// tdpbf16ps C[16×16 fp32] += A[16×32 bf16] · B[32×16 bf16, stored as 16 rows of 16 bf16 pairs]:
// 2·16·16·32 FLOPs. Tiles 0-3 accumulate, 4-5 hold A, 6-7 hold B, each C fed by a distinct (A, B).
// The tile state is per thread: each thread configures its own and releases it.
__attribute__((target("amx-tile,amx-bf16"))) double amx_bf16_loop(int64_t iters, float* sink) {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.bytes_per_row[t] = 64;
    cfg.rows[t] = 16;
  }
  alignas(64) uint16_t operand[16 * 32];
  for (uint16_t& v : operand) v = 0x3C00;  // bf16 2^-7
  alignas(64) float out[16 * 16];
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  *sink = out[0];
  return 2.0 * 16 * 16 * 32 * 4 * static_cast<double>(iters);
}
#endif

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Iterations that take about `target_s` on one core.
int64_t calibrate(Loop loop, double target_s) {
  float sink = 0;
  int64_t iters = 1 << 10;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    loop(iters, &sink);
    const double t = seconds_since(t0);
    if (t >= target_s / 4 || iters >= (int64_t{1} << 40)) return std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(iters) * target_s / std::max(t, 1e-9)));
    iters *= 2;
  }
}

// GFLOP/s of `loop` on `threads` threads started together; the slowest thread's time counts.
double run_on_threads(Loop loop, int64_t iters, int threads) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<double> flops(static_cast<size_t>(threads)), secs(static_cast<size_t>(threads));
  std::vector<float> sinks(static_cast<size_t>(threads));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      const auto t0 = std::chrono::steady_clock::now();
      flops[static_cast<size_t>(t)] = loop(iters, &sinks[static_cast<size_t>(t)]);
      secs[static_cast<size_t>(t)] = seconds_since(t0);
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  go.store(true, std::memory_order_release);
  for (std::thread& th : pool) th.join();
  double total = 0;
  for (double f : flops) total += f;
  return total / *std::max_element(secs.begin(), secs.end()) / 1e9;
}

UnitPeak measure(const char* unit, Loop loop, int threads) {
  const int64_t iters = calibrate(loop, 0.05);
  UnitPeak p{unit, 0, 0};
  for (int rep = 0; rep < 3; ++rep) {  // best of three: the machine is shared and noisy
    p.gflops_per_core = std::max(p.gflops_per_core, run_on_threads(loop, iters, 1));
    p.gflops = std::max(p.gflops, run_on_threads(loop, iters, threads));
  }
  return p;
}

}  // namespace

std::vector<UnitPeak> measure_unit_peaks(int threads) {
  threads = std::max(1, threads);
  std::vector<UnitPeak> out;
  const CpuFeatures& f = cpu_features();
#if defined(__x86_64__)
  if (f.amx_permitted) out.push_back(measure("amx_bf16", amx_bf16_loop, threads));
  if (f.avx512_bf16) out.push_back(measure("avx512_bf16", avx512_bf16_loop, threads));
  if (f.avx512) out.push_back(measure("avx512_fp32_fma", avx512_fma_loop, threads));
  if (f.avx2) out.push_back(measure("avx2_fp32_fma", avx2_fma_loop, threads));
#endif
  if (out.empty()) out.push_back(measure("baseline_fp32", baseline_fp32_loop, threads));
  std::sort(out.begin(), out.end(), [](const UnitPeak& a, const UnitPeak& b) { return a.gflops > b.gflops; });
  return out;
}

}  // namespace dsv41::cli
