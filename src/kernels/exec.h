// What a fast kernel runs on: its backend's worker pool and each worker's scratch memory. The
// backend builds one and hands it to every kernel it calls; nothing else is shared between calls.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/scratch.h"
#include "kernels/thread_pool.h"

namespace dsv41 {

class Exec {
 public:
  Exec(ThreadPool& pool, std::vector<Scratch>& scratch) : pool_(&pool), scratch_(&scratch) {}
  int threads() const { return pool_->threads(); }

  // fn(begin, end, Scratch&) over [0, n) in ranges starting at multiples of `grain`, on the pool.
  template <class F>
  void parallel_for(int64_t n, int64_t grain, F&& fn) const {
    pool_->parallel_for(n, grain, [&](int64_t b, int64_t e, int worker) { fn(b, e, (*scratch_)[worker]); });
  }
  // fn(0, n, Scratch&) on the calling thread.
  template <class F>
  void serial(int64_t n, F&& fn) const {
    pool_->serial(n, [&](int64_t b, int64_t e, int worker) { fn(b, e, (*scratch_)[worker]); });
  }
  // parallel_for when `parallel`, else serial.
  template <class F>
  void run(bool parallel, int64_t n, int64_t grain, F&& fn) const {
    if (parallel) {
      parallel_for(n, grain, fn);
    } else {
      serial(n, fn);
    }
  }

 private:
  ThreadPool* pool_;
  std::vector<Scratch>* scratch_;
};

}  // namespace dsv41
