// The kernels' worker pool (kernels/thread_pool.h): ranges, workers, nesting, exceptions, and jobs
// that do not wait for workers the OS has not scheduled.
#include "kernels/thread_pool.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "test_util.h"

namespace {

using namespace dsv41;

TEST(ThreadPool, CoversTheRangeOnceInGrainMultiples) {
  for (const int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    for (const int64_t n : {0, 1, 2, 7, 16, 100, 1001}) {
      for (const int64_t grain : {1, 3, 16, 64}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        std::atomic<int> bad_start{0};
        pool.parallel_for(n, grain, [&](int64_t b, int64_t e) {
          if (b % grain != 0 || b >= e) bad_start.fetch_add(1);
          for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << threads << " " << n << " " << grain;
        EXPECT_EQ(bad_start.load(), 0);
      }
    }
  }
}

TEST(ThreadPool, UsesTheWorkersAndReusesThem) {
  ThreadPool pool(2);
  std::atomic<int> other{0};
  const auto caller = std::this_thread::get_id();
  for (int rep = 0; rep < 50; ++rep) {
    pool.parallel_for(8, 1, [&](int64_t, int64_t) {
      if (std::this_thread::get_id() != caller) other.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));  // long enough for the worker to join
    });
  }
  EXPECT_GT(other.load(), 0) << "the worker takes chunks";
  EXPECT_LT(other.load(), 50 * 8) << "the caller takes chunks too";
}

TEST(ThreadPool, NestedCallsRunInlineAndConcurrentCallsTakeTurns) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  pool.parallel_for(4, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      pool.parallel_for(10, 1, [&](int64_t b2, int64_t e2) { sum.fetch_add(e2 - b2); });
    }
  });
  EXPECT_EQ(sum.load(), 40);
  // Two threads calling at once: one holds the workers, the other waits its turn; both complete.
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 2; ++t) {
    callers.emplace_back([&] {
      for (int rep = 0; rep < 500; ++rep) {
        pool.parallel_for(64, 4, [&](int64_t b, int64_t e) { total.fetch_add(e - b); });
      }
    });
  }
  for (auto& c : callers) c.join();
  EXPECT_EQ(total.load(), 2 * 500 * 64);
}

TEST(ThreadPool, ExceptionsReachTheCaller) {
  ThreadPool pool(2);
  EXPECT_THROW(pool.parallel_for(2, 1,
                                 [](int64_t b, int64_t) {
                                   if (b == 1) throw std::runtime_error("worker");
                                 }),
               std::runtime_error);
  // The pool still works afterwards.
  std::atomic<int> n{0};
  pool.parallel_for(2, 1, [&](int64_t b, int64_t e) { n.fetch_add(static_cast<int>(e - b)); });
  EXPECT_EQ(n.load(), 2);
}

// Each range names the worker running it: 0 is the caller, the others the pool's threads, and two
// ranges running at the same time never share a worker index (kernels index scratch memory by it).
TEST(ThreadPool, RangesNameTheirWorker) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> busy(3);
  std::atomic<int> bad{0}, out_of_range{0};
  std::mutex mu;
  std::set<int> used;
  const auto caller = std::this_thread::get_id();
  for (int rep = 0; rep < 20; ++rep) {
    pool.parallel_for(48, 1, [&](int64_t, int64_t, int worker) {
      if (worker < 0 || worker >= 3) {
        out_of_range.fetch_add(1);
        return;
      }
      if (busy[worker].fetch_add(1) != 0) bad.fetch_add(1);
      if ((worker == 0) != (std::this_thread::get_id() == caller)) bad.fetch_add(1);
      {
        const std::lock_guard<std::mutex> lock(mu);
        used.insert(worker);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      busy[worker].fetch_sub(1);
    });
  }
  EXPECT_EQ(out_of_range.load(), 0);
  EXPECT_EQ(bad.load(), 0) << "a worker index ran two ranges at once, or worker 0 was not the caller";
  EXPECT_GT(used.size(), 1u) << "the pool's threads took ranges";
  // serial: the whole range once, on the calling thread, as worker 0; nested: the caller's worker
  int calls = 0;
  pool.serial(10, [&](int64_t b, int64_t e, int worker) {
    ++calls;
    EXPECT_EQ(b, 0);
    EXPECT_EQ(e, 10);
    EXPECT_EQ(worker, 0);
  });
  EXPECT_EQ(calls, 1);
  std::atomic<int> nested_bad{0};
  pool.parallel_for(12, 1, [&](int64_t, int64_t, int outer) {
    pool.serial(1, [&](int64_t, int64_t, int inner) {
      if (inner != outer) nested_bad.fetch_add(1);
    });
  });
  EXPECT_EQ(nested_bad.load(), 0) << "a nested call runs as the worker it was made on";
}

// Keeps the calling thread, and the threads it starts, on one CPU for the scope's lifetime.
class PinnedToOneCpu {
 public:
  PinnedToOneCpu() {
    pinned_ = sched_getaffinity(0, sizeof(saved_), &saved_) == 0;
    if (!pinned_) return;
    int cpu = 0;
    while (cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &saved_)) ++cpu;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    pinned_ = sched_setaffinity(0, sizeof(one), &one) == 0;
  }
  ~PinnedToOneCpu() {
    if (pinned_) sched_setaffinity(0, sizeof(saved_), &saved_);
  }
  bool pinned() const { return pinned_; }

 private:
  cpu_set_t saved_{};
  bool pinned_ = false;
};

// More threads than cores (here four on one CPU, as when other processes hold a machine's cores): a
// job is done when its chunks are, and a waiting thread yields its core, so the calls cost about
// what running them inline costs. Waiting for every worker to check in (and spinning while waiting)
// made each call cost scheduler time slices (this loop: 501 us a call against 75 us inline; now 73).
TEST(ThreadPool, JobsDoNotWaitForWorkersTheOsHasNotScheduled) {
  DSV41_SKIP_UNDER_SANITIZERS("a timing comparison");
  const PinnedToOneCpu pin;
  if (!pin.pinned()) GTEST_SKIP() << "sched_setaffinity is not permitted here";
  constexpr int kJobs = 1000;
  std::atomic<int64_t> sink{0};
  const auto time_jobs = [&](ThreadPool& pool) {
    const auto start = std::chrono::steady_clock::now();
    for (int j = 0; j < kJobs; ++j) {
      pool.parallel_for(64, 1, [&](int64_t b, int64_t e) {
        uint64_t x = static_cast<uint64_t>(b);  // unsigned: the generator's products wrap
        for (int64_t i = 0; i < (e - b) * 1000; ++i) x = x * 6364136223846793005u + 1442695040888963407u;
        sink.fetch_add(static_cast<int64_t>(x & 0xFF), std::memory_order_relaxed);
      });
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  ThreadPool inline_pool(1), oversubscribed(4);
  double inline_s = 1e9, pooled_s = 1e9;
  for (int rep = 0; rep < 3; ++rep) {  // interleaved, best of three: the machine is shared
    inline_s = std::min(inline_s, time_jobs(inline_pool));
    pooled_s = std::min(pooled_s, time_jobs(oversubscribed));
  }
  EXPECT_LT(pooled_s, 3.0 * inline_s) << "4 threads on one CPU: " << pooled_s * 1e6 / kJobs << " us a call against "
                                      << inline_s * 1e6 / kJobs << " us inline";
}

}  // namespace
