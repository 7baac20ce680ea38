// A persistent worker pool for the kernels: threads are created once and park between calls, so a
// decode step's many small GEMVs pay a wake-up, not a thread creation, each.
//
// parallel_for(n, grain, fn) calls fn(begin, end) on disjoint sub-ranges that cover [0, n), each
// starting at a multiple of `grain`. The range is cut into a few chunks per thread, which the calling
// thread and the workers take in turn, so a thread slowed down by other processes on its core takes
// fewer of them instead of holding everyone up. The kernels compute every output element the same
// way whatever chunk holds it, so results do not depend on the thread count or the split.
//
// One parallel_for runs at a time: a call made while the pool is busy (from a worker, i.e. nested, or
// from a second thread) runs the whole range inline on the calling thread, so callers need no locking.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace dsv41 {

class ThreadPool {
 public:
  // threads >= 1 counts the calling thread: a pool of 1 runs everything inline.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // The process-wide pool the kernels use, sized by default_threads() at first use.
  static ThreadPool& global();
  // DSV41_THREADS when it holds a positive number, else std::thread::hardware_concurrency().
  static int default_threads();

  int threads() const { return threads_; }
  // Stops and recreates the workers (tests, benchmarks). Not while a parallel_for runs.
  void resize(int threads);

  template <class F>
  void parallel_for(int64_t n, int64_t grain, F&& fn) {
    using Fn = std::remove_reference_t<F>;
    run(n, grain, [](void* ctx, int64_t b, int64_t e) { (*static_cast<Fn*>(ctx))(b, e); },
        const_cast<void*>(static_cast<const void*>(&fn)));
  }
  template <class F>
  void parallel_for(int64_t n, F&& fn) {
    parallel_for(n, 1, fn);
  }

 private:
  using RangeFn = void (*)(void* ctx, int64_t begin, int64_t end);
  struct Job {
    RangeFn call = nullptr;
    void* ctx = nullptr;
    int64_t n = 0, grain = 1, units = 0;
    int64_t chunks = 0;
  };

  void run(int64_t n, int64_t grain, RangeFn call, void* ctx);
  void run_chunks() noexcept;  // takes chunks until none is left
  void worker(uint64_t seen);
  void start(int threads);
  void stop();

  int threads_ = 1;
  std::vector<std::thread> workers_;
  Job job_;
  std::atomic<uint64_t> generation_{0};  // bumped once per job; workers wait for it to change
  std::atomic<int> pending_{0};          // workers yet to finish the current job
  std::atomic<int64_t> next_chunk_{0};
  std::atomic<bool> busy_{false};
  std::atomic<bool> stopping_{false};
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

// ThreadPool::global().parallel_for(...).
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& fn) {
  ThreadPool::global().parallel_for(n, grain, fn);
}

}  // namespace dsv41
