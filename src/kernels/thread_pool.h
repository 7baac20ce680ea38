// A persistent worker pool for the kernels: threads are created once and park between calls, so a
// decode step's many small GEMVs pay a wake-up, not a thread creation, each.
//
// parallel_for(n, grain, fn) calls fn(begin, end) or fn(begin, end, worker) on disjoint sub-ranges
// that cover [0, n), each starting at a multiple of `grain`; `worker` (0 = the calling thread,
// 1.. = the pool's threads) names the thread running the range, so a kernel can index per-worker
// scratch memory with it. The range is cut into a few chunks per thread, which the calling thread
// and the workers take in turn, so a thread slowed down by other processes on its core takes fewer
// of them instead of holding everyone up. A job is over when its chunks are done, not when every
// worker has looked at it: a worker the OS has not scheduled yet (the machine busy with other
// processes) costs the call nothing, where waiting for it to check in cost a scheduler time slice.
// The kernels compute every output element the same way whatever chunk holds it, so results do not
// depend on the thread count or the split.
//
// One job runs at a time. A call from a thread that is already inside this pool's job (nested) runs
// its whole range inline as that thread's worker; a call from any other thread waits until the
// running job is done. serial(n, fn) runs fn(0, n, worker) on the calling thread under the same
// rule, for work too small to split that still uses its worker's scratch; it holds the pool, so a
// parallel_for made inside it (on the same thread, outside any job) still splits over the workers.
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

  // std::thread::hardware_concurrency(), at least 1.
  static int hardware_threads();

  int threads() const { return threads_; }

  template <class F>
  void parallel_for(int64_t n, int64_t grain, F&& fn) {
    run(n, grain, true, &invoke_range<std::remove_reference_t<F>>, const_cast<void*>(static_cast<const void*>(&fn)));
  }
  template <class F>
  void serial(int64_t n, F&& fn) {
    run(n, 1, false, &invoke_range<std::remove_reference_t<F>>, const_cast<void*>(static_cast<const void*>(&fn)));
  }

 private:
  using RangeFn = void (*)(void* ctx, int64_t begin, int64_t end, int worker);
  template <class Fn>
  static void invoke_range(void* ctx, int64_t b, int64_t e, int worker) {
    Fn& fn = *static_cast<Fn*>(ctx);
    if constexpr (std::is_invocable_v<Fn&, int64_t, int64_t, int>) {
      fn(b, e, worker);
    } else {
      fn(b, e);
    }
  }
  struct Job {
    RangeFn call = nullptr;
    void* ctx = nullptr;
    int64_t n = 0, grain = 1, units = 0;
    int64_t chunks = 0;
  };
  struct Claim {
    int worker = 0;
    bool owner = false;     // this call took the pool
    bool dispatch = false;  // it may hand ranges to the workers (it holds the pool, outside a job)
  };

  void run(int64_t n, int64_t grain, bool split, RangeFn call, void* ctx);
  Claim claim();
  void release() noexcept;
  // Takes chunks of job `seq` until none is left (or another job is current).
  void run_chunks(uint64_t seq, int worker) noexcept;
  void worker_loop(int worker);

  int threads_ = 1;
  std::vector<std::thread> workers_;
  std::vector<std::thread::id> worker_ids_;  // worker i + 1 runs on worker_ids_[i]
  Job job_;
  std::atomic<bool> busy_{false};         // a job (or a serial call) holds the pool
  std::atomic<std::thread::id> owner_{};  // the thread that holds it
  std::atomic<bool> in_job_{false};       // the workers are running a job of the owner's
  // The current job in one word, so that claiming a chunk also checks whose chunk it is: the job's
  // sequence number (bits 32-63), its chunk count (16-31) and its next unclaimed chunk (0-15). A
  // worker waking late for a finished job finds the sequence changed and claims nothing; job_ is
  // read only after a claim, and the caller rewrites it only once every claimed chunk is done.
  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> chunks_done_{0};   // of the current job
  std::atomic<bool> stopping_{false};
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

}  // namespace dsv41
