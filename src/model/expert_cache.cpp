#include "model/expert_cache.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <system_error>

#include "kernels/packed_weights.h"
#include "util/error.h"
#include "util/regular_file.h"

namespace dsv41 {

namespace {

constexpr uint64_t kDirectAlign = 4096;  // O_DIRECT's offset, length and buffer alignment

}  // namespace

// The reads of one request: how many are left, the first error, and when they started.
struct ReadBatch {
  std::mutex mu;
  std::condition_variable cv;
  int left = 0;
  std::string error;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now(), end;
};

struct ExpertCache::Entry {
  ExpertMatrices<Fp4Matrix> m;       // packed views (no row-major bytes: the kernels read the tiles)
  std::unique_ptr<PackedWeights> packed[3];
  uint64_t bytes = 0;
  std::atomic<int> direct{0}, buffered{0};  // how its tensors were read
  bool ready = false;                       // packed and counted (set by wait)
  uint64_t last_use = 0;                    // the routing count when last asked for (under mu_)
};

const ExpertMatrices<Fp4Matrix>& ExpertCache::Lease::operator[](size_t i) const { return entries_[i]->m; }

ExpertCache::ExpertCache(const ModelWeights& weights, std::shared_ptr<const Backend> backend, uint64_t capacity_bytes,
                         int io_threads)
    : weights_(weights), backend_(std::move(backend)), capacity_(capacity_bytes) {
  if (backend_->weight_tile_rows() == 0) fail("expert cache", "needs a backend that packs weights");
  const ModelConfig& c = weights.config();
  std::map<std::string, int> file_ids;
  const auto range = [&](const std::string& name) {
    const TensorView& t = weights.checkpoint().get(name);
    const auto [it, added] = file_ids.emplace(*t.file, static_cast<int>(files_.size()));
    if (added) files_.push_back(*t.file);
    return Source::Range{it->second, t.file_offset, static_cast<uint64_t>(t.nbytes())};
  };
  sources_.resize(weights.layers.size());
  uses_.resize(weights.layers.size());
  packed_expert_bytes_.assign(weights.layers.size(), 0);
  const int tile_rows = backend_->weight_tile_rows();
  for (size_t l = 0; l < weights.layers.size(); ++l) {
    const int layer = static_cast<int>(l);
    if (layer >= c.n_layers && !c.has_dspark()) continue;
    const std::string p = layer < c.n_layers ? "layers." + std::to_string(layer) + "."
                                             : "mtp." + std::to_string(layer - c.n_layers) + ".";
    const int experts = c.routed_experts(layer);
    sources_[l].resize(static_cast<size_t>(experts));
    uses_[l].assign(static_cast<size_t>(experts), 0);
    for (int e = 0; e < experts; ++e) {
      Source& s = sources_[l][static_cast<size_t>(e)];
      const ExpertMatrices<Fp4Matrix>& m = weights.layers[l].ffn.experts[static_cast<size_t>(e)];
      const Fp4Matrix* mats[3] = {&m.w1, &m.w2, &m.w3};
      for (int j = 0; j < 3; ++j) {
        const std::string base = p + "ffn.experts." + std::to_string(e) + ".w" + std::to_string(j + 1);
        s.w[j] = range(base + ".weight");
        s.s[j] = range(base + ".scale");
        s.n[j] = mats[j]->n;
        s.k[j] = mats[j]->k;
        if (e == 0) packed_expert_bytes_[l] += static_cast<uint64_t>(packed_fp4_bytes(s.n[j], s.k[j], tile_rows));
      }
    }
  }
  for (const std::string& f : files_) {
    fds_.push_back(open_regular_file(f));
    direct_fds_.push_back(::open(f.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT));  // -1 where not allowed
  }
  stats_.capacity_bytes = capacity_;
  for (int i = 0; i < std::max(io_threads, 1); ++i) io_threads_.emplace_back([this] { io_loop(); });
}

ExpertCache::~ExpertCache() {
  {
    std::lock_guard<std::mutex> lock(io_mu_);
    stopping_ = true;
  }
  io_cv_.notify_all();
  for (std::thread& t : io_threads_) t.join();
  for (int fd : fds_) ::close(fd);
  for (int fd : direct_fds_) {
    if (fd >= 0) ::close(fd);
  }
}

void ExpertCache::io_loop() {
  ThreadPool pool(1);  // packing runs on this thread alone
  std::vector<Scratch> scratch(1);
  const Exec exec(pool, scratch);
  for (;;) {
    std::function<void(const Exec&)> job;
    {
      std::unique_lock<std::mutex> lock(io_mu_);
      io_cv_.wait(lock, [&] { return stopping_ || !io_jobs_.empty(); });
      if (io_jobs_.empty()) return;  // stopping, nothing left
      job = std::move(io_jobs_.front());
      io_jobs_.pop_front();
    }
    job(exec);
  }
}

// Reads `r`; returns its first byte, inside `keep`. O_DIRECT reads the enclosing aligned range (the
// tensor then starts inside the buffer, nothing copied); a filesystem that refuses it (EINVAL) or a
// short final block gets the buffered read.
const uint8_t* ExpertCache::read_range(const Source::Range& r, std::unique_ptr<uint8_t[], void (*)(uint8_t*)>& keep,
                                       bool& direct) const {
  const auto read_all = [&](int fd, uint8_t* dst, uint64_t offset, uint64_t bytes) {
    while (bytes > 0) {
      const ssize_t n = ::pread(fd, dst, bytes, static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return errno;
      if (n == 0) return EIO;  // the file ended early
      dst += n;
      offset += static_cast<uint64_t>(n);
      bytes -= static_cast<uint64_t>(n);
    }
    return 0;
  };
  const auto buffer = [&](uint64_t n) {
    void* p = std::aligned_alloc(kDirectAlign, (n + kDirectAlign - 1) / kDirectAlign * kDirectAlign);
    if (p == nullptr) throw std::bad_alloc();
    keep = {static_cast<uint8_t*>(p), [](uint8_t* q) { std::free(q); }};
    return keep.get();
  };
  direct = false;
  const int dfd = direct_fds_[static_cast<size_t>(r.file)];
  if (dfd >= 0) {
    const uint64_t first = r.offset / kDirectAlign * kDirectAlign;
    const uint64_t last = (r.offset + r.bytes + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    uint8_t* buf = buffer(last - first);
    if (read_all(dfd, buf, first, last - first) == 0) {
      direct = true;
      return buf + (r.offset - first);
    }
  }
  uint8_t* buf = buffer(r.bytes);
  const int err = read_all(fds_[static_cast<size_t>(r.file)], buf, r.offset, r.bytes);
  if (err != 0) {
    fail(files_[static_cast<size_t>(r.file)], "cannot read an expert's " + std::to_string(r.bytes) + " bytes at " +
                                                  std::to_string(r.offset) + ": " + std::generic_category().message(err));
  }
  return buf;
}

ExpertCache::Pending ExpertCache::request(int layer, const std::vector<int32_t>& ids) const {
  Pending p;
  p.layer = layer;
  p.ids = ids;
  p.reads = std::make_shared<ReadBatch>();
  std::vector<std::pair<std::shared_ptr<Entry>, const Source*>> misses;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<uint32_t>& uses = uses_[static_cast<size_t>(layer)];
    for (int32_t e : ids) {
      uses[static_cast<size_t>(e)] += 1;
      // Aging: every 64 routings per expert of the model, halve the counts, so the set of hot
      // experts follows the traffic rather than its whole history.
      if (++routings_ % (64 * static_cast<uint64_t>(uses.size()) * uses_.size()) == 0) {
        for (auto& layer_uses : uses_) {
          for (uint32_t& u : layer_uses) u /= 2;
        }
      }
      const auto it = resident_.find({layer, e});
      if (it != resident_.end()) {
        ++stats_.hits;
        it->second->last_use = routings_;
        p.entries.push_back(it->second);
        continue;
      }
      ++stats_.misses;
      auto entry = std::make_shared<Entry>();
      p.entries.push_back(entry);
      misses.emplace_back(entry, &sources_[static_cast<size_t>(layer)][static_cast<size_t>(e)]);
    }
  }
  p.reads->left = static_cast<int>(misses.size()) * 3;
  if (misses.empty()) return p;
  {
    std::lock_guard<std::mutex> lock(io_mu_);
    for (auto& [entry, source] : misses) {
      for (int j = 0; j < 3; ++j) {
        // One matrix: its weight and scale read, then packed on this I/O thread (its own Exec), so
        // the forward thread only waits.
        io_jobs_.push_back([this, entry, source, j, batch = p.reads](const Exec& exec) {
          std::string error;
          try {
            std::unique_ptr<uint8_t[], void (*)(uint8_t*)> keep_w(nullptr, nullptr), keep_s(nullptr, nullptr);
            bool direct_w = false, direct_s = false;
            const uint8_t* w = read_range(source->w[j], keep_w, direct_w);
            const uint8_t* sc = read_range(source->s[j], keep_s, direct_s);
            (direct_w ? entry->direct : entry->buffered) += 1;
            (direct_s ? entry->direct : entry->buffered) += 1;
            const Fp4Matrix raw{w, sc, source->n[j], source->k[j]};
            entry->packed[j] = pack_fp4(exec, backend_->allocator(), raw, backend_->weight_tile_rows());
            Fp4Matrix& m = j == 0 ? entry->m.w1 : j == 1 ? entry->m.w2 : entry->m.w3;
            m = {nullptr, nullptr, source->n[j], source->k[j], entry->packed[j]->view()};
          } catch (const std::exception& ex) {
            error = ex.what();
          }
          std::lock_guard<std::mutex> done(batch->mu);
          if (!error.empty() && batch->error.empty()) batch->error = error;
          if (--batch->left == 0) {
            batch->end = std::chrono::steady_clock::now();
            batch->cv.notify_all();
          }
        });
      }
    }
  }
  io_cv_.notify_all();
  return p;
}

ExpertCache::Lease ExpertCache::wait(Pending p) const {
  {
    std::unique_lock<std::mutex> lock(p.reads->mu);
    p.reads->cv.wait(lock, [&] { return p.reads->left == 0; });
  }
  if (!p.reads->error.empty()) fail("expert cache", p.reads->error);
  uint64_t read = 0, added = 0;
  int direct = 0, buffered = 0;
  std::vector<std::shared_ptr<Entry>> fresh;
  for (size_t i = 0; i < p.entries.size(); ++i) {
    Entry& entry = *p.entries[i];
    if (entry.ready) continue;  // a hit
    const Source& s = sources_[static_cast<size_t>(p.layer)][static_cast<size_t>(p.ids[i])];
    for (int j = 0; j < 3; ++j) {
      read += s.w[j].bytes + s.s[j].bytes;
      entry.bytes += entry.packed[j]->bytes();
    }
    direct += entry.direct;
    buffered += entry.buffered;
    entry.ready = true;
    added += entry.bytes;
    fresh.push_back(p.entries[i]);
  }
  Lease lease;
  std::lock_guard<std::mutex> lock(mu_);
  if (!fresh.empty()) {
    stats_.bytes_read += read;
    stats_.read_seconds += std::chrono::duration<double>(p.reads->end - p.reads->start).count();
    stats_.direct_reads += static_cast<uint64_t>(direct);
    stats_.buffered_reads += static_cast<uint64_t>(buffered);
    make_room(added);
  }
  for (size_t i = 0; i < p.entries.size(); ++i) {
    std::shared_ptr<Entry>& entry = p.entries[i];
    if (std::find(fresh.begin(), fresh.end(), entry) != fresh.end()) {
      // Another request may have cached the same expert meanwhile: keep the first one.
      const auto [it, inserted] = resident_.emplace(std::make_pair(p.layer, p.ids[i]), entry);
      if (inserted) stats_.resident_bytes += entry->bytes;
      else entry = it->second;
      entry->last_use = routings_;
    }
    lease.entries_.push_back(entry);
  }
  return lease;
}

// Evicts the least used experts no layer is computing until `bytes` more fit (or nothing more can go).
void ExpertCache::make_room(uint64_t bytes) const {
  while (stats_.resident_bytes + bytes > capacity_) {
    // The least routed goes; among equals the most recently used, so that a working set larger than
    // the cache (every layer's experts each token, in the same order) keeps a stable part of itself
    // resident instead of evicting each expert just before it is needed again (the LRU cycle).
    const auto uses = [&](const auto& it) {
      return uses_[static_cast<size_t>(it->first.first)][static_cast<size_t>(it->first.second)];
    };
    auto victim = resident_.end();
    for (auto it = resident_.begin(); it != resident_.end(); ++it) {
      if (it->second.use_count() > 1) continue;  // pinned by a lease or a pending request
      if (victim == resident_.end() || uses(it) < uses(victim) ||
          (uses(it) == uses(victim) && it->second->last_use > victim->second->last_use)) {
        victim = it;
      }
    }
    if (victim == resident_.end()) return;
    stats_.resident_bytes -= victim->second->bytes;
    ++stats_.evictions;
    resident_.erase(victim);
  }
}

int64_t ExpertCache::group_size(int layer) const {
  const uint64_t one = packed_expert_bytes_[static_cast<size_t>(layer)];
  return one == 0 ? 1 : std::max<int64_t>(1, static_cast<int64_t>(capacity_ / (2 * one)));
}

ExpertCacheStats ExpertCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace dsv41
