#include "kernels/thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace dsv41 {

namespace {

// Between decode-step kernels the gaps are tens of microseconds: waiting that long without parking
// answers the next call in about a microsecond, where parking on a futex would cost a few
// microseconds of wake-up per call. Longer idle periods park, so an idle process does not burn a core.
constexpr auto kSpinFor = std::chrono::microseconds(100);
// The first checks spin on the core; after them each check yields the core first, so a waiting
// thread on a machine whose cores are all taken (other processes, or more threads than cores) hands
// its time slice to whoever has work, the thread it waits for included, instead of burning it.
constexpr int kPureSpins = 256;

// Chunks per thread: enough that a thread sharing its core with another process does not hold the
// others up, few enough that taking one (an atomic increment) stays negligible.
constexpr int kChunksPerThread = 4;

constexpr uint64_t kChunkMask = 0xFFFF;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Waits until `value` differs from `old`: spins (then yields) for kSpinFor, then blocks in atomic::wait.
template <class T>
T wait_for_change(const std::atomic<T>& value, T old) {
  const auto until = std::chrono::steady_clock::now() + kSpinFor;
  for (int i = 0;; ++i) {
    const T v = value.load(std::memory_order_acquire);
    if (v != old) return v;
    if (i < kPureSpins) {
      cpu_relax();
      continue;
    }
    std::this_thread::yield();
    if (std::chrono::steady_clock::now() > until) break;
  }
  for (;;) {
    value.wait(old, std::memory_order_acquire);
    const T v = value.load(std::memory_order_acquire);
    if (v != old) return v;
  }
}

}  // namespace

int ThreadPool::hardware_threads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

ThreadPool::ThreadPool(int threads) : threads_(std::max(1, threads)) {
  workers_.reserve(static_cast<size_t>(threads_ - 1));
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  for (const std::thread& t : workers_) worker_ids_.push_back(t.get_id());
}

ThreadPool::~ThreadPool() {
  stopping_.store(true, std::memory_order_relaxed);
  state_.fetch_add(uint64_t{1} << 32, std::memory_order_release);  // a new job of no chunks wakes them
  state_.notify_all();
  for (auto& t : workers_) t.join();
}

ThreadPool::Claim ThreadPool::claim() {
  const std::thread::id me = std::this_thread::get_id();
  for (;;) {
    bool expected = false;
    if (busy_.compare_exchange_strong(expected, true, std::memory_order_acquire)) {
      owner_.store(me, std::memory_order_relaxed);
      return {0, true, true};
    }
    // Held: by this thread (inside its own job, or in a serial section outside one), by a worker of
    // ours inside the job, or by another thread, whose hold this one waits out.
    if (owner_.load(std::memory_order_relaxed) == me) return {0, false, !in_job_.load(std::memory_order_relaxed)};
    for (size_t i = 0; i < worker_ids_.size(); ++i) {
      if (worker_ids_[i] == me) return {static_cast<int>(i) + 1, false, false};
    }
    busy_.wait(true, std::memory_order_relaxed);
  }
}

void ThreadPool::release() noexcept {
  owner_.store(std::thread::id{}, std::memory_order_relaxed);
  busy_.store(false, std::memory_order_release);
  busy_.notify_all();
}

void ThreadPool::run_chunks(uint64_t seq, int worker) noexcept {
  uint64_t state = state_.load(std::memory_order_acquire);
  for (;;) {
    if ((state >> 32) != seq) return;
    const uint64_t c = state & kChunkMask;
    if (c >= ((state >> 16) & kChunkMask)) return;
    if (!state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
      continue;
    }
    // Chunk c is ours, so job_ is this job's until it is done. It gets units [c·U/C, (c+1)·U/C):
    // sizes differ by at most one grain.
    const Job& job = job_;
    const int64_t ci = static_cast<int64_t>(c);
    const int64_t begin = job.units * ci / job.chunks * job.grain;
    const int64_t end = std::min(job.n, job.units * (ci + 1) / job.chunks * job.grain);
    if (begin < end) {
      try {
        job.call(job.ctx, begin, end, worker);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
    // the job's last chunk done lets the caller return and rewrite job_: nothing of it is read after
    const int64_t chunks = job.chunks;
    if (chunks_done_.fetch_add(1, std::memory_order_acq_rel) + 1 == chunks) chunks_done_.notify_one();
    state = state_.load(std::memory_order_acquire);
  }
}

void ThreadPool::worker_loop(int worker) {
  uint64_t state = state_.load(std::memory_order_acquire);
  for (;;) {
    if (stopping_.load(std::memory_order_relaxed)) return;
    run_chunks(state >> 32, worker);
    // Once a job has no unclaimed chunk its word stays as it is until the next job is published.
    const uint64_t now = state_.load(std::memory_order_acquire);
    state = (now >> 32) != (state >> 32) ? now : wait_for_change(state_, now);
  }
}

void ThreadPool::run(int64_t n, int64_t grain, bool split, RangeFn call, void* ctx) {
  if (n <= 0) return;
  const Claim c = claim();
  struct Release {
    ThreadPool* pool;
    bool owner;
    ~Release() {
      if (owner) pool->release();
    }
  } released{this, c.owner};
  grain = std::max<int64_t>(grain, 1);
  const int64_t units = (n + grain - 1) / grain;
  const int64_t chunks = std::min<int64_t>({units, int64_t{kChunksPerThread} * threads_, int64_t{kChunkMask}});
  if (!c.dispatch || !split || threads_ <= 1 || chunks <= 1) {
    call(ctx, 0, n, c.worker);
    return;
  }
  struct InJob {
    std::atomic<bool>* flag;
    ~InJob() { flag->store(false, std::memory_order_relaxed); }
  } in_job{&in_job_};
  in_job_.store(true, std::memory_order_relaxed);
  job_ = Job{call, ctx, n, grain, units, chunks};
  chunks_done_.store(0, std::memory_order_relaxed);
  const uint64_t seq = ((state_.load(std::memory_order_relaxed) >> 32) + 1) & 0xFFFFFFFFu;
  state_.store(seq << 32 | static_cast<uint64_t>(chunks) << 16, std::memory_order_release);  // publishes job_
  state_.notify_all();

  run_chunks(seq, 0);

  for (int64_t done = chunks_done_.load(std::memory_order_acquire); done != chunks;) {
    done = wait_for_change(chunks_done_, done);
  }
  std::exception_ptr error;
  {
    const std::lock_guard<std::mutex> lock(error_mutex_);
    std::swap(error, error_);
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace dsv41
