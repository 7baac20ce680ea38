// Routed experts from disk, for checkpoints whose experts do not fit in RAM (the memory plan's
// "streamed" placement): a cache of packed experts of bounded size. A miss is read from the
// checkpoint's files by parallel pread (O_DIRECT where the filesystem allows it, buffered otherwise)
// and packed for the backend's kernels, both on the cache's own I/O threads; nothing of the experts goes
// through the mapping, so the resident set stays within the plan. Eviction follows measured routing
// frequency (counts halved every few thousand routings, so the hot set can move): the least used
// unpinned expert goes first, the most recently used among equals (a working set larger than the
// cache then keeps a stable part resident), and the experts a layer is computing are pinned until it
// is done.
//
// A layer asks for its experts as soon as its router has chosen them (request), computes its shared
// expert while the reads run, then waits for them (wait). The results are the same bits as with the
// experts resident: the packed copies are the loader's.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/backend.h"
#include "model/weights.h"

namespace dsv41 {

struct ExpertCacheStats {
  uint64_t capacity_bytes = 0;
  uint64_t resident_bytes = 0;
  uint64_t hits = 0, misses = 0, evictions = 0;
  uint64_t bytes_read = 0;         // from the checkpoint's files
  double read_seconds = 0;         // wall time of the reads a layer waited for
  uint64_t direct_reads = 0, buffered_reads = 0;
};

class ExpertCache {
 public:
  // `weights`: the loaded model (its checkpoint names the files and offsets; its backend packs).
  ExpertCache(const ModelWeights& weights, std::shared_ptr<const Backend> backend, uint64_t capacity_bytes,
              int io_threads = 4);
  ~ExpertCache();
  ExpertCache(const ExpertCache&) = delete;
  ExpertCache& operator=(const ExpertCache&) = delete;

  struct Entry;
  // Experts of one layer, pinned while the object lives.
  class Lease {
   public:
    const ExpertMatrices<Fp4Matrix>& operator[](size_t i) const;

   private:
    friend class ExpertCache;
    std::vector<std::shared_ptr<const Entry>> entries_;
  };
  struct Pending {
    int layer = -1;
    std::vector<int32_t> ids;
    std::vector<std::shared_ptr<Entry>> entries;  // the misses being read, each with its buffers
    std::shared_ptr<struct ReadBatch> reads;
  };
  // Starts reading `layer`'s experts `ids` (distinct) that are not resident; returns at once.
  Pending request(int layer, const std::vector<int32_t>& ids) const;
  // Waits for the reads, packs the experts read, and returns all of them pinned, in `ids` order.
  // Error naming the file when a read fails (the experts are not cached then).
  Lease wait(Pending pending) const;

  // Experts of `layer` a request should ask for at once: two such groups fit in the capacity (the
  // one computing and the one being read), at least one expert.
  int64_t group_size(int layer) const;

  ExpertCacheStats stats() const;

 private:
  struct Source {  // one routed expert's six tensors in the files
    struct Range {
      int file = -1;
      uint64_t offset = 0, bytes = 0;
    };
    Range w[3], s[3];
    int64_t n[3] = {0, 0, 0}, k[3] = {0, 0, 0};
  };
  std::vector<uint64_t> packed_expert_bytes_;  // per layer
  void io_loop();
  const uint8_t* read_range(const Source::Range& r, std::unique_ptr<uint8_t[], void (*)(uint8_t*)>& keep,
                            bool& direct) const;
  void make_room(uint64_t bytes) const;  // evicts under mu_

  const ModelWeights& weights_;
  std::shared_ptr<const Backend> backend_;
  uint64_t capacity_;
  std::vector<std::vector<Source>> sources_;  // [layer][expert]
  std::vector<std::string> files_;
  std::vector<int> fds_, direct_fds_;  // buffered and O_DIRECT descriptors per file (-1: none)

  mutable std::mutex mu_;
  mutable std::map<std::pair<int, int>, std::shared_ptr<Entry>> resident_;
  mutable std::vector<std::vector<uint32_t>> uses_;  // routing counts, [layer][expert]
  mutable uint64_t routings_ = 0;
  mutable ExpertCacheStats stats_;

  mutable std::mutex io_mu_;
  mutable std::condition_variable io_cv_;
  mutable std::deque<std::function<void(const Exec&)>> io_jobs_;
  bool stopping_ = false;
  std::vector<std::thread> io_threads_;
};

}  // namespace dsv41
