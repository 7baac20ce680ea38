#include "bench_limits.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "kernels/packed_weights.h"

namespace dsv41::cli {

namespace {
double seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

DiskRead measure_disk_read(const std::string& dir, uint64_t bytes, int threads) {
  constexpr uint64_t kBlock = uint64_t{8} << 20;
  struct Block {
    std::string path;
    uint64_t offset;
  };
  std::vector<Block> blocks;
  uint64_t planned = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    const uint64_t size = entry.file_size();
    for (uint64_t off = 0; off + kBlock <= size && planned < bytes; off += kBlock, planned += kBlock) {
      blocks.push_back({entry.path().string(), off});
    }
  }
  DiskRead r;
  if (blocks.empty()) return r;
  // O_DIRECT if every file takes it; else buffered, each file's cached pages dropped first.
  bool direct = true;
  for (const Block& b : blocks) {
    const int fd = ::open(b.path.c_str(), O_RDONLY | O_DIRECT);
    if (fd < 0) {
      direct = false;
      break;
    }
    ::close(fd);
  }
  if (!direct) {
    for (const Block& b : blocks) {
      const int fd = ::open(b.path.c_str(), O_RDONLY);
      if (fd >= 0) {
        ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        ::close(fd);
      }
    }
  }
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> done{0};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> readers;
  for (int t = 0; t < std::max(threads, 1); ++t) {
    readers.emplace_back([&] {
      void* buf = std::aligned_alloc(4096, kBlock);
      if (buf == nullptr) return;
      for (size_t i; (i = next.fetch_add(1)) < blocks.size();) {
        const int fd = ::open(blocks[i].path.c_str(), O_RDONLY | (direct ? O_DIRECT : 0));
        if (fd < 0) continue;
        const ssize_t n = ::pread(fd, buf, kBlock, static_cast<off_t>(blocks[i].offset));
        if (n > 0) done += static_cast<uint64_t>(n);
        ::close(fd);
      }
      std::free(buf);
    });
  }
  for (std::thread& t : readers) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.bytes = done;
  r.gbs = secs > 0 ? static_cast<double>(done) / secs / 1e9 : 0;
  r.mode = direct ? "direct" : "buffered";
  return r;
}

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
  Fp8Matrix W{w.data(), s.data(), n, k};
  const std::unique_ptr<PackedWeights> packed = backend.pack(W);  // as a loaded model's (null: row-major)
  if (packed) W.packed = packed->view();
  return best_gflops(m, k, n, reps, [&] { backend.linear_fp8(x.data(), m, W, y.data()); });
}

double measure_fp4_gemm_gflops(const Backend& backend, int64_t m, int64_t k, int64_t n, int reps) {
  std::vector<uint8_t> w(static_cast<size_t>(n * k / 2)), s(static_cast<size_t>(n * (k / 32)), 124);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint8_t>((i * 2654435761u) >> 24);  // every E2M1 code is finite
  const std::vector<float> x = activations(m, k);
  std::vector<float> y(static_cast<size_t>(m * n));
  Fp4Matrix W{w.data(), s.data(), n, k};
  const std::unique_ptr<PackedWeights> packed = backend.pack(W);
  if (packed) W.packed = packed->view();
  return best_gflops(m, k, n, reps, [&] { backend.linear_fp4(x.data(), m, W, y.data()); });
}

}  // namespace dsv41::cli
