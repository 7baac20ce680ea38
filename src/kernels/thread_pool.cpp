#include "kernels/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace dsv41 {

namespace {

// True on pool workers, and on a caller while it runs its own share: a parallel_for made there
// runs inline instead of waiting for workers that are busy with the outer call.
thread_local bool t_inside_pool = false;

// Between decode-step kernels the gaps are tens of microseconds: waiting that long in a spin loop
// answers the next call in nanoseconds, where parking on a futex would cost a few microseconds of
// wake-up per call. Longer idle periods park, so an idle process does not burn a core.
constexpr auto kSpinFor = std::chrono::microseconds(100);

// Chunks per thread: enough that a thread sharing its core with another process does not hold the
// others up, few enough that taking one (an atomic increment) stays negligible.
constexpr int kChunksPerThread = 4;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Waits until `value` differs from `old`: spins for kSpinFor, then blocks in atomic::wait.
template <class T>
T wait_for_change(const std::atomic<T>& value, T old) {
  const auto until = std::chrono::steady_clock::now() + kSpinFor;
  for (int i = 0;; ++i) {
    const T v = value.load(std::memory_order_acquire);
    if (v != old) return v;
    cpu_relax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) break;
  }
  for (;;) {
    value.wait(old, std::memory_order_acquire);
    const T v = value.load(std::memory_order_acquire);
    if (v != old) return v;
  }
}

}  // namespace

ThreadPool::ThreadPool(int threads) { start(threads); }

ThreadPool::~ThreadPool() { stop(); }

ThreadPool& ThreadPool::global() {
  // Never destroyed: a static destructor joining workers could run while another static's
  // destructor still uses kernels; the parked workers simply end with the process.
  static ThreadPool* pool = new ThreadPool(default_threads());
  return *pool;
}

int ThreadPool::default_threads() {
  if (const char* env = std::getenv("DSV41_THREADS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && v > 0 && v <= 1024) return static_cast<int>(v);
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

void ThreadPool::start(int threads) {
  threads_ = std::max(1, threads);
  stopping_.store(false, std::memory_order_relaxed);
  workers_.reserve(static_cast<size_t>(threads_ - 1));
  // Workers wait for the generation to move past today's: earlier jobs (before a resize) are done.
  const uint64_t now = generation_.load(std::memory_order_relaxed);
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, now] { worker(now); });
}

void ThreadPool::stop() {
  stopping_.store(true, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::resize(int threads) {
  stop();
  start(threads);
}

void ThreadPool::run_chunks() noexcept {
  const Job& job = job_;
  for (;;) {
    const int64_t c = next_chunk_.fetch_add(1, std::memory_order_relaxed);
    if (c >= job.chunks) return;
    // Chunk c gets units [c·U/C, (c+1)·U/C): sizes differ by at most one grain.
    const int64_t begin = job.units * c / job.chunks * job.grain;
    const int64_t end = std::min(job.n, job.units * (c + 1) / job.chunks * job.grain);
    if (begin >= end) continue;
    try {
      job.call(job.ctx, begin, end);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void ThreadPool::worker(uint64_t seen) {
  t_inside_pool = true;
  for (;;) {
    seen = wait_for_change(generation_, seen);
    if (stopping_.load(std::memory_order_relaxed)) return;
    run_chunks();
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
  }
}

void ThreadPool::run(int64_t n, int64_t grain, RangeFn call, void* ctx) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t units = (n + grain - 1) / grain;
  const int64_t chunks = std::min<int64_t>(units, int64_t{kChunksPerThread} * threads_);
  if (threads_ <= 1 || chunks <= 1 || t_inside_pool || busy_.exchange(true, std::memory_order_acquire)) {
    call(ctx, 0, n);
    return;
  }
  job_ = Job{call, ctx, n, grain, units, chunks};
  next_chunk_.store(0, std::memory_order_relaxed);
  pending_.store(threads_ - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);  // publishes job_, next_chunk_ and pending_
  generation_.notify_all();

  t_inside_pool = true;
  run_chunks();
  t_inside_pool = false;

  for (int left = pending_.load(std::memory_order_acquire); left != 0;) {
    left = wait_for_change(pending_, left);
  }
  std::exception_ptr error;
  {
    const std::lock_guard<std::mutex> lock(error_mutex_);
    std::swap(error, error_);
  }
  busy_.store(false, std::memory_order_release);
  if (error) std::rethrow_exception(error);
}

}  // namespace dsv41
