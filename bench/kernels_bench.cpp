// Micro-benchmarks of the linear-layer kernels (Google Benchmark), at the released model's shapes.
//
//  * GEMV (m = 1, the decode step) is bound by reading the weights: it reports bytes/s of weight data
//    (bytes_per_second), to set against StreamRead, a plain parallel sum over 1 GiB on the same pool.
//    Each iteration reads a different copy of the weights from a set larger than 1 GiB, as a decode
//    step reads every layer's weights once: measuring one hot copy would time the cache instead.
//  * GEMM (m = 64..512, prefill) is bound by arithmetic: it reports FLOP/s (2·m·n·k per call).
//
// Arguments: the ISA level (0 scalar, 1 AVX2, 2 AVX-512; a level the CPU lacks is skipped) and, for
// the GEMVs, the thread count (elsewhere one per core). Each benchmark runs on a backend of its own.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/linear_internal.h"
#include "kernels/reference.h"
#include "numeric/formats.h"
#include "numeric/quant.h"
#include "numeric/row_codecs.h"
#include "runtime/sampler.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using namespace dsv41;

constexpr size_t kRotateBytes = size_t{1} << 30;  // weight copies cycled through: beyond any cache

// The backend of one benchmark (threads 0: one per core); null (and the benchmark skipped) when the
// CPU lacks the level.
std::unique_ptr<Backend> setup(benchmark::State& state, int64_t isa_arg, int64_t threads) {
  const Isa isa = static_cast<Isa>(isa_arg);
  if (!isa_supported(isa)) {
    state.SkipWithError("ISA level not supported by this CPU");
    return nullptr;
  }
  std::unique_ptr<Backend> be = make_backend({isa, static_cast<int>(threads), true});
  state.SetLabel(std::string(be->name()) + " x" + std::to_string(be->threads()));
  return be;
}

std::vector<float> activations(int64_t m, int64_t k) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(m * k));
  for (auto& v : x) v = round_bf16(dist(rng));
  return x;
}

// A weight byte pattern resembling a checkpoint's: e4m3 codes of roughly Gaussian values (no NaN
// codes), or random E2M1 nibbles; copies differ only by where they live in memory.
std::vector<uint8_t> weight_bytes(size_t n, bool fp8) {
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 60.0f);
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> v(n);
  for (auto& c : v) c = fp8 ? e4m3_from_f32(dist(rng)) : static_cast<uint8_t>(byte(rng));
  return v;
}

// `copies` copies of one weight tensor, enough of them to exceed kRotateBytes when `rotate`.
struct Copies {
  std::vector<std::unique_ptr<uint8_t[]>> data;
  size_t bytes = 0;
  Copies(const std::vector<uint8_t>& src, bool rotate) : bytes(src.size()) {
    const size_t count = rotate ? std::max<size_t>(1, (kRotateBytes + bytes - 1) / bytes) : 1;
    for (size_t c = 0; c < count; ++c) {
      data.emplace_back(new uint8_t[bytes]);
      std::memcpy(data.back().get(), src.data(), bytes);
    }
  }
  const uint8_t* get(size_t iteration) const { return data[iteration % data.size()].get(); }
};

// Packed copies (packed_weights.h) of the same matrix for the backend, as many as Copies makes;
// empty unless `packed` and the backend packs.
template <class Matrix>
std::vector<std::unique_ptr<PackedWeights>> packed_copies(const Backend& be, const Copies& w, Matrix m, bool packed) {
  std::vector<std::unique_ptr<PackedWeights>> out;
  if (!packed || be.weight_tile_rows() == 0) return out;
  for (size_t c = 0; c < w.data.size(); ++c) out.push_back(be.pack(m));
  return out;
}

template <class Matrix>
Matrix with_copy(Matrix m, const std::vector<std::unique_ptr<PackedWeights>>& packed, size_t iteration) {
  if (!packed.empty()) m.packed = packed[iteration % packed.size()]->view();
  return m;
}

// ---- streaming-read reference -------------------------------------------------------------------

// Sums a 1 GiB buffer as uint64 words split over the pool: the bandwidth a weight stream can expect.
void StreamRead(benchmark::State& state) {
  const std::unique_ptr<Backend> be = setup(state, static_cast<int64_t>(detected_isa()), state.range(0));
  if (!be) return;
  const size_t words = kRotateBytes / sizeof(uint64_t);
  std::unique_ptr<uint64_t[]> buf(new uint64_t[words]);
  for (size_t i = 0; i < words; ++i) buf[i] = i;
  std::atomic<uint64_t> sink{0};
  for (auto _ : state) {
    be->exec().parallel_for(static_cast<int64_t>(words), 4096, [&](int64_t b, int64_t e, Scratch&) {
      uint64_t s[8] = {};
      for (int64_t i = b; i < e; i += 8) {  // chunks are whole multiples of 4096 words
        for (int j = 0; j < 8; ++j) s[j] += buf[i + j];
      }
      uint64_t t = 0;
      for (uint64_t v : s) t += v;
      sink.fetch_add(t, std::memory_order_relaxed);  // keeps the sum live
    });
  }
  benchmark::DoNotOptimize(sink.load());
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(kRotateBytes));
}
BENCHMARK(StreamRead)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

// The cost of one parallel_for over the pool with an empty body: what each parallel kernel call pays
// on top of its work (workers spinning between back-to-back calls, as between a decode step's GEMVs).
void PoolDispatch(benchmark::State& state) {
  const std::unique_ptr<Backend> be = setup(state, static_cast<int64_t>(detected_isa()), state.range(0));
  if (!be) return;
  std::atomic<int64_t> sink{0};
  for (auto _ : state) {
    be->exec().parallel_for(64, 1, [&](int64_t b, int64_t e, Scratch&) { sink.fetch_add(e - b, std::memory_order_relaxed); });
  }
  benchmark::DoNotOptimize(sink.load());
}
BENCHMARK(PoolDispatch)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMicrosecond);

// ---- GEMV (m = 1) ---------------------------------------------------------------------------------

// Args: n (outputs), k (inputs), ISA level, threads.
void Fp8Gemv(benchmark::State& state) {
  const int64_t n = state.range(0), k = state.range(1);
  const std::unique_ptr<Backend> be = setup(state, state.range(2), state.range(3));
  if (!be) return;
  const Copies w(weight_bytes(static_cast<size_t>(n * k), true), true);
  std::mt19937 rng(3);
  std::vector<uint8_t> scales(static_cast<size_t>(((n + 31) / 32) * (k / 32)));
  for (auto& c : scales) c = static_cast<uint8_t>(120 + rng() % 8);
  const std::vector<float> x = activations(1, k);
  std::vector<float> y(static_cast<size_t>(n));
  const auto packed = packed_copies(*be, w, Fp8Matrix{w.get(0), scales.data(), n, k}, state.range(4) != 0);
  size_t it = 0;
  for (auto _ : state) {
    const size_t i = it++;
    be->linear_fp8(x.data(), 1, with_copy(Fp8Matrix{w.get(i), scales.data(), n, k}, packed, i), y.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(w.bytes + scales.size()));
}

void Fp4Gemv(benchmark::State& state) {
  const int64_t n = state.range(0), k = state.range(1);
  const std::unique_ptr<Backend> be = setup(state, state.range(2), state.range(3));
  if (!be) return;
  const Copies w(weight_bytes(static_cast<size_t>(n * k / 2), false), true);
  std::mt19937 rng(3);
  std::vector<uint8_t> scales(static_cast<size_t>(n * (k / 32)));
  for (auto& c : scales) c = static_cast<uint8_t>(120 + rng() % 8);
  const std::vector<float> x = activations(1, k);
  std::vector<float> y(static_cast<size_t>(n));
  const auto packed = packed_copies(*be, w, Fp4Matrix{w.get(0), scales.data(), n, k}, state.range(4) != 0);
  size_t it = 0;
  for (auto _ : state) {
    const size_t i = it++;
    be->linear_fp4(x.data(), 1, with_copy(Fp4Matrix{w.get(i), scales.data(), n, k}, packed, i), y.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(w.bytes + scales.size()));
}

// linear_f32 (router, head) and linear_bf16 (compressor, indexer) GEMVs; arg 4: 0 = f32, 1 = bf16.
void Bf16Gemv(benchmark::State& state) {
  const int64_t n = state.range(0), k = state.range(1);
  const std::unique_ptr<Backend> be = setup(state, state.range(2), state.range(3));
  if (!be) return;
  std::vector<uint8_t> src(static_cast<size_t>(n * k * 2));
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  for (size_t i = 0; i < src.size(); i += 2) {
    const uint16_t b = bf16_from_f32(dist(rng));
    std::memcpy(&src[i], &b, 2);
  }
  const Copies w(src, true);
  const std::vector<float> x = activations(1, k);
  std::vector<float> y(static_cast<size_t>(n));
  size_t it = 0;
  const bool bf16 = state.range(4) != 0;
  const auto packed =
      packed_copies(*be, w, Bf16Matrix{reinterpret_cast<const uint16_t*>(w.get(0)), n, k}, state.range(5) != 0);
  for (auto _ : state) {
    const size_t i = it++;
    const Bf16Matrix mat = with_copy(Bf16Matrix{reinterpret_cast<const uint16_t*>(w.get(i)), n, k}, packed, i);
    if (bf16) {
      be->linear_bf16(x.data(), 1, mat, y.data());
    } else {
      be->linear_f32(x.data(), 1, mat, y.data());
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(w.bytes));
}

// Arg 5 (packed): the weights in the checkpoint's row-major layout (0) or packed at load time (1).
void GemvArgs(benchmark::internal::Benchmark* b, const std::vector<std::pair<int64_t, int64_t>>& shapes) {
  b->ArgNames({"n", "k", "isa", "threads", "packed"});
  for (const auto& [n, k] : shapes) {
    b->Args({n, k, 0, 1, 0});  // the scalar reference is single-threaded and reads rows
    for (const int64_t isa : {1, 2}) {
      for (const int64_t threads : {1, 2}) {
        for (const int64_t packed : {0, 1}) b->Args({n, k, isa, threads, packed});
      }
    }
    // avx512_bf16 (skipped where absent): its own GEMV reads packed tiles only
    for (const int64_t threads : {1, 2}) b->Args({n, k, 3, threads, 1});
  }
  b->UseRealTime()->Unit(benchmark::kMicrosecond);
}

// wq_a 5120 -> 1280, wq_b 1280 -> 32768 (FP8); expert w1/w3 5120 -> 2304 and w2 2304 -> 5120 (FP4).
BENCHMARK(Fp8Gemv)->Apply([](benchmark::internal::Benchmark* b) { GemvArgs(b, {{1280, 5120}, {32768, 1280}}); });
BENCHMARK(Fp4Gemv)->Apply([](benchmark::internal::Benchmark* b) { GemvArgs(b, {{2304, 5120}, {5120, 2304}}); });
// Router 5120 -> 256 (f32) and a 5120 -> 16384 slice of the head (f32); compressor-like 5120 -> 512 (bf16).
BENCHMARK(Bf16Gemv)
    ->ArgNames({"n", "k", "isa", "threads", "bf16", "packed"})
    ->Args({256, 5120, 2, 2, 0, 1})
    ->Args({16384, 5120, 0, 1, 0, 0})
    ->Args({16384, 5120, 1, 2, 0, 0})
    ->Args({16384, 5120, 1, 2, 0, 1})
    ->Args({16384, 5120, 2, 1, 0, 0})
    ->Args({16384, 5120, 2, 1, 0, 1})
    ->Args({16384, 5120, 2, 2, 0, 0})
    ->Args({16384, 5120, 2, 2, 0, 1})
    ->Args({512, 5120, 2, 2, 1, 0})
    ->Args({512, 5120, 2, 2, 1, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// ---- GEMM (m > 1) -------------------------------------------------------------------------------

// Args: m, n, k, ISA level, packed. One hot weight copy: at these m the arithmetic, not the read,
// bounds it.
void Fp8Gemm(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const std::unique_ptr<Backend> be = setup(state, state.range(3), 0);
  if (!be) return;
  const std::vector<uint8_t> w = weight_bytes(static_cast<size_t>(n * k), true);
  std::vector<uint8_t> scales(static_cast<size_t>(((n + 31) / 32) * (k / 32)), 125);
  const std::vector<float> x = activations(m, k);
  std::vector<float> y(static_cast<size_t>(m * n));
  std::unique_ptr<PackedWeights> packed;
  Fp8Matrix mat{w.data(), scales.data(), n, k};
  if (state.range(4) != 0 && (packed = be->pack(mat))) mat.packed = packed->view();
  for (auto _ : state) {
    be->linear_fp8(x.data(), m, mat, y.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOP/s"] =
      benchmark::Counter(static_cast<double>(2 * m * n * k), benchmark::Counter::kIsIterationInvariantRate);
}

void Fp4Gemm(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const std::unique_ptr<Backend> be = setup(state, state.range(3), 0);
  if (!be) return;
  const std::vector<uint8_t> w = weight_bytes(static_cast<size_t>(n * k / 2), false);
  std::vector<uint8_t> scales(static_cast<size_t>(n * (k / 32)), 125);
  const std::vector<float> x = activations(m, k);
  std::vector<float> y(static_cast<size_t>(m * n));
  std::unique_ptr<PackedWeights> packed;
  Fp4Matrix mat{w.data(), scales.data(), n, k};
  if (state.range(4) != 0 && (packed = be->pack(mat))) mat.packed = packed->view();
  for (auto _ : state) {
    be->linear_fp4(x.data(), m, mat, y.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOP/s"] =
      benchmark::Counter(static_cast<double>(2 * m * n * k), benchmark::Counter::kIsIterationInvariantRate);
}

void GemmArgs(benchmark::internal::Benchmark* b, int64_t n, int64_t k) {
  b->ArgNames({"m", "n", "k", "isa", "packed"});
  b->Args({64, n, k, 0, 0});  // the scalar reference, once, for scale
  for (const int64_t m : {64, 128, 256, 512, 1024}) {
    for (const int64_t isa : {1, 2, 3}) {  // 3: avx512_bf16, skipped where absent
      for (const int64_t packed : {0, 1}) b->Args({m, n, k, isa, packed});  // packed: as a loaded model's
    }
  }
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(Fp8Gemm)->Apply([](benchmark::internal::Benchmark* b) { GemmArgs(b, 1280, 5120); });
BENCHMARK(Fp4Gemm)->Apply([](benchmark::internal::Benchmark* b) { GemmArgs(b, 2304, 5120); });

// ---- activation quantization ----------------------------------------------------------------------

// act_quant of one 5120-wide row, which every quantized GEMV pays before reading weights: the
// scalar reference (arg 0) and the vector versions the fast kernels use (1 AVX2, 2 AVX-512).
void ActQuant(benchmark::State& state) {
  const int64_t k = state.range(0);
  const Isa isa = static_cast<Isa>(state.range(1));
  if (!isa_supported(isa)) {
    state.SkipWithError("ISA level not supported by this CPU");
    return;
  }
  state.SetLabel(isa_name(isa));
  const std::vector<float> x = activations(1, k);
  for (auto _ : state) {
    detail::QuantizedActivations q = isa == Isa::avx512 ? detail::quantize_activations_avx512(x.data(), 1, k, 1.0f)
                                     : isa == Isa::avx2 ? detail::quantize_activations_avx2(x.data(), 1, k, 1.0f)
                                                        : detail::quantize_activations(x.data(), 1, k, 1.0f);
    benchmark::DoNotOptimize(q.values.data());
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * k);
}
BENCHMARK(ActQuant)
    ->ArgNames({"k", "isa"})
    ->Args({5120, 0})
    ->Args({5120, 1})
    ->Args({5120, 2})
    ->Unit(benchmark::kMicrosecond);

// One query of sparse attention at the released shape (64 heads, d = 512, 128 window + 512
// selected rows); arg: ISA level.
void SparseAttention(benchmark::State& state) {
  const std::unique_ptr<Backend> be = setup(state, state.range(0), 0);
  if (!be) return;
  const int64_t heads = 64, d = 512, len = 640;
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const int64_t window = 128, wrb = window_row_bytes(d), mrb = main_kv_bytes(d);
  std::vector<float> q(static_cast<size_t>(heads * d)), row(static_cast<size_t>(d)), sink(heads, 0.5f);
  for (auto& v : q) v = round_bf16(dist(rng) * 0.05f);
  // the rows packed as the state holds them: the window's FP8 rows, then FP4 compressed rows
  std::vector<uint8_t> packed(static_cast<size_t>(window * wrb + (len - window) * mrb));
  std::vector<const uint8_t*> rows(static_cast<size_t>(len));
  for (int64_t j = 0; j < len; ++j) {
    for (auto& v : row) v = round_bf16(dist(rng));
    uint8_t* p = j < window ? &packed[j * wrb] : &packed[window * wrb + (j - window) * mrb];
    j < window ? pack_window_row(row.data(), d, p) : pack_main_kv_row(row.data(), d, p);
    rows[j] = p;
  }
  const KvRows list{rows.data(), window, rows.data() + window, len - window};
  std::vector<float> out(q.size());
  for (auto _ : state) {
    be->sparse_attention(q.data(), heads, d, list, sink.data(), 1.0f / std::sqrt(static_cast<float>(d)), out.data());
    benchmark::ClobberMemory();
  }
  state.counters["FLOP/s"] = benchmark::Counter(static_cast<double>(4 * heads * len * d),
                                                benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(SparseAttention)->ArgName("isa")->Arg(0)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMicrosecond);


// ---- indexer scores and Engram rows ----------------------------------------------------------------

// The ceiling the indexer's integer path is held to: vpdpbusd on registers only, 16 independent
// accumulators of 16 int32 lanes (4 byte products each), on one thread; reports multiply-adds per
// second ("MAC/s"). Skipped on a CPU without AVX-512 VNNI.
#if defined(__x86_64__)
__attribute__((target("avx512f,avx512vnni"))) int64_t vnni_register_loop(int64_t iters, int32_t* sink) {
  const __m512i a = _mm512_set1_epi32(0x01010101), b = _mm512_set1_epi32(0x01FF01FF);  // sums stay 0
  __m512i c[16];
  for (int j = 0; j < 16; ++j) c[j] = _mm512_set1_epi32(j);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) c[j] = _mm512_dpbusd_epi32(c[j], a, b);
  }
  __m512i t = c[0];
  for (int j = 1; j < 16; ++j) t = _mm512_add_epi32(t, c[j]);
  alignas(64) int32_t lanes[16];
  _mm512_store_si512(lanes, t);
  *sink = lanes[0] + lanes[15];
  return 16 * 16 * 4 * iters;
}
#endif
void Int8DotPeak(benchmark::State& state) {
#if defined(__x86_64__)
  if (!cpu_features().avx512_vnni) {
    state.SkipWithError("no AVX-512 VNNI on this CPU");
    return;
  }
  int64_t macs = 0;
  int32_t sink = 0;
  for (auto _ : state) macs += vnni_register_loop(1 << 20, &sink);
  benchmark::DoNotOptimize(sink);
  state.counters["MAC/s"] = benchmark::Counter(static_cast<double>(macs), benchmark::Counter::kIsRate);
#else
  state.SkipWithError("x86-64 only");
#endif
}
BENCHMARK(Int8DotPeak)->UseRealTime()->Unit(benchmark::kMillisecond);

// Indexer scores for `nq` queries against `keys` packed key rows, each row in its own place as paged
// rows are, at the released shape (32 heads × 128) or the `long` preset's (2 × 32). Keys are Gaussian
// vectors FP4-quantized as the indexer writes them (each 32-block's scale follows its values), queries
// FP4 quantize-dequantized; reports keys/s (query-key pairs scored per second) and MAC/s (their
// multiply-adds, to set against Int8DotPeak). Args: ISA level, queries, keys, threads, heads, head dim.
void IndexScores(benchmark::State& state) {
  const std::unique_ptr<Backend> be = setup(state, state.range(0), state.range(3));
  if (!be) return;
  const int64_t nq = state.range(1), n_keys = state.range(2), nh = state.range(4), K = state.range(5);
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const int64_t stride = 128;  // rows apart, as pages of rows would leave them
  std::vector<uint8_t> rows(static_cast<size_t>(n_keys * stride));
  std::vector<const uint8_t*> keys(static_cast<size_t>(n_keys));
  std::vector<float> key(static_cast<size_t>(K));
  for (int64_t t = 0; t < n_keys; ++t) {
    for (auto& v : key) v = dist(rng);
    uint8_t* row = rows.data() + t * stride;
    pack_index_key_row(key.data(), K, row);
    keys[t] = row;
  }
  std::vector<float> q(static_cast<size_t>(nq * nh * K)), w(static_cast<size_t>(nq * nh));
  for (auto& v : q) v = dist(rng);
  fp4_qdq_e8m0(q.data(), q.size());
  for (auto& v : w) v = round_bf16(dist(rng) * 0.1f);
  std::vector<int64_t> visible(static_cast<size_t>(nq), n_keys);
  std::vector<float> scores(static_cast<size_t>(nq * n_keys));
  for (auto _ : state) {
    be->index_scores(q.data(), w.data(), nq, nh, K, keys.data(), n_keys, visible.data(), scores.data());
    benchmark::ClobberMemory();
  }
  state.counters["keys/s"] =
      benchmark::Counter(static_cast<double>(nq * n_keys), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["MAC/s"] =
      benchmark::Counter(static_cast<double>(nq * n_keys * nh * K), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(IndexScores)
    ->ArgNames({"isa", "queries", "keys", "threads", "heads", "dim"})
    ->Args({0, 1, 8192, 1, 32, 128})
    ->Args({1, 1, 8192, 1, 32, 128})
    ->Args({2, 1, 8192, 1, 32, 128})
    ->Args({1, 1, 8192, 2, 32, 128})
    ->Args({2, 1, 8192, 2, 32, 128})
    ->Args({0, 64, 2048, 1, 32, 128})
    ->Args({1, 64, 2048, 1, 32, 128})
    ->Args({2, 64, 2048, 1, 32, 128})
    ->Args({1, 64, 2048, 2, 32, 128})
    ->Args({2, 64, 2048, 2, 32, 128})
    ->Args({1, 16, 65536, 1, 2, 32})
    ->Args({2, 16, 65536, 1, 2, 32})
    ->Args({1, 1, 32768, 1, 2, 32})
    ->Args({2, 1, 32768, 1, 2, 32})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// Engram row dequantization at the released row width (256 FP8 codes + 8 E8M0 scales): 24 rows are
// one decode step's lookup (3 n-gram orders × 8 heads), 24 × 512 a 512-token prefill's. Reports the
// packed bytes read per second. Args: ISA level, rows, threads.
void EngramDequantize(benchmark::State& state) {
  const std::unique_ptr<Backend> be = setup(state, state.range(0), state.range(2));
  if (!be) return;
  const int64_t n = state.range(1), row_len = 256;
  std::mt19937 rng(6);
  std::uniform_int_distribution<int> byte(0, 255), scale(110, 135);
  std::vector<uint8_t> codes(static_cast<size_t>(n * row_len)), scales(static_cast<size_t>(n * row_len / 32));
  for (auto& c : codes) c = static_cast<uint8_t>(byte(rng));
  for (auto& c : scales) c = static_cast<uint8_t>(scale(rng));
  std::vector<float> out(codes.size());
  for (auto _ : state) {
    be->engram_rows(codes.data(), scales.data(), n, row_len, out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(codes.size() + scales.size()));
}
BENCHMARK(EngramDequantize)
    ->ArgNames({"isa", "rows", "threads"})
    ->Args({0, 24, 1})
    ->Args({1, 24, 1})
    ->Args({2, 24, 1})
    ->Args({0, 24 * 512, 1})
    ->Args({1, 24 * 512, 1})
    ->Args({2, 24 * 512, 1})
    ->Args({2, 24 * 512, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace

// ---- mHC step -------------------------------------------------------------------------------------

namespace {

// The step between two sublayers at the released width (hc 4, dim 5120) for `tokens` tokens: expand
// the sublayer output into the stream, the next sublayer's 24 mixes and Sinkhorn, the collapse into
// its input. isa 0 is the unfused scalar sequence the model ran before the fused kernel; 1 and 2
// the fused AVX2 and AVX-512 versions. Bytes: the stream read and written, y read, u written, fn read
// once per call. Each call reads a different copy of fn (64 copies, 128 MiB), as a forward pass reads
// each sublayer's fn once: one hot copy would time the cache instead.
void MhcStep(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  const std::unique_ptr<Backend> be = setup(state, state.range(1), 0);
  if (!be) return;
  HcShape s;
  s.hc = 4;
  s.dim = 5120;
  s.norm_eps = 1e-6f;
  const int64_t n = s.width(), mix = s.mix_count();
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> X(static_cast<size_t>(tokens * n)), y(static_cast<size_t>(tokens * s.dim)),
      u(y.size()), fn(static_cast<size_t>(mix * n)), base(static_cast<size_t>(mix)), scale{0.5f, 0.7f, 1.3f};
  for (auto& v : X) v = round_bf16(dist(rng));
  for (auto& v : y) v = round_bf16(dist(rng) * 0.01f);
  for (auto& v : fn) v = dist(rng) * 0.02f;
  for (auto& v : base) v = dist(rng) * 0.1f;
  // the previous sublayer's coefficients: a real Sinkhorn output, so the stream stays bounded
  std::vector<float> pre(static_cast<size_t>(tokens * 4)), post(pre.size()), comb(static_cast<size_t>(tokens * 16));
  std::vector<float> mixes(static_cast<size_t>(mix));
  for (int64_t t = 0; t < tokens; ++t) {
    for (auto& v : mixes) v = dist(rng);
    reference::hc_split_sinkhorn(mixes.data(), scale.data(), base.data(), 4, 20, 1e-6f, &pre[t * 4], &post[t * 4], &comb[t * 16]);
  }
  const int64_t copies = 64;
  std::vector<float> fn_copies(static_cast<size_t>(copies) * fn.size());
  for (int64_t i = 0; i < copies; ++i) std::copy(fn.begin(), fn.end(), fn_copies.begin() + i * mix * n);
  std::vector<float> next_pre(pre.size()), next_post(pre.size()), next_comb(comb.size());
  const HcCoefficients prev{pre.data(), post.data(), comb.data()};
  const HcCoefficientsOut out{next_pre.data(), next_post.data(), next_comb.data()};
  int64_t call = 0;
  for (auto _ : state) {
    const HcMixWeights w{&fn_copies[static_cast<size_t>(call++ % copies * mix * n)], scale.data(), base.data()};
    if (state.range(1) == 0) {
      reference::mhc_step(s, X.data(), y.data(), prev, w, tokens, out, u.data());
    } else {
      be->mhc_step(s, X.data(), y.data(), prev, w, tokens, out, u.data());
    }
    benchmark::ClobberMemory();
  }
  const int64_t bytes = tokens * (2 * n + 2 * s.dim) * 4 + mix * n * 4;
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * bytes);
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * tokens);  // tokens/s
}
BENCHMARK(MhcStep)
    ->ArgNames({"tokens", "isa"})
    ->ArgsProduct({{1, 16, 128}, {0, 1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);


// Sampling one row at temperature > 0 (arg: the vocabulary): Sampler::sample, whose cost is ordering
// the vocabulary (a radix sort on the logits' bits), against a comparison sort with the same rule,
// the way the sampler ordered it before. Per row, single-threaded.
void SampleRow(benchmark::State& state) {
  const int64_t V = state.range(0);
  const bool comparison = state.range(1) != 0;
  std::vector<float> logits(static_cast<size_t>(V));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (float& x : logits) x = normal(rng);
  dsv41::Sampler sampler(dsv41::SamplingParams{0.7, 1.0, 1});
  std::vector<int32_t> order(static_cast<size_t>(V));
  for (auto _ : state) {
    if (comparison) {
      for (int64_t i = 0; i < V; ++i) order[static_cast<size_t>(i)] = static_cast<int32_t>(i);
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
      });
      benchmark::DoNotOptimize(order.data());
    } else {
      benchmark::DoNotOptimize(sampler.sample(logits.data(), V));
    }
  }
}
BENCHMARK(SampleRow)->ArgNames({"vocab", "comparison_sort"})->ArgsProduct({{4096, 129280}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
