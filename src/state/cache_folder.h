// The prompt-cache folder as the disk tier of one process sees it (model-spec §5): an index of the
// entries it may restore, a byte budget, and writes that never fail the request that makes them.
//
// The index is built once, at construction, from the entries' headers (disk_cache.h), and then follows
// this process's own stores and evictions, so a long request neither lists the folder nor opens every
// file on the scheduler thread. Entries another process adds later are not seen until a restart;
// entries that vanish or go bad later are found out when read (read_cache_entry verifies every byte)
// and forgotten. The budget covers the indexed entries; when a store goes over it, the least recently
// used (stored or restored) go first. Files of other models, modes or format versions are never
// removed: the folder may be shared.
//
// The cache is an optimisation, so no disk problem is ever an error for a request: a write that fails
// (the folder removed or replaced, the disk full) is counted and the request goes on uncached. A write
// that finds the disk full (ENOSPC, EDQUOT) first removes the least recently used entries, enough for
// the new one, and is tried once more. Each problem is logged once: a file skipped is forgotten,
// failing writes are logged when they start failing and when they work again, and a full disk when it
// is first found. A removed folder is made again by the next store.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "state/disk_cache.h"

namespace dsv41 {

class CacheFolder {
 public:
  using Log = std::function<void(const std::string&)>;  // one line for the operator, naming the file
  // Puts an entry's bytes in its file: write_file_atomic (io/safetensors_writer.h), or a test's stand-in.
  // A write refused for lack of space throws FileWriteError with out_of_space().
  using Writer = std::function<void(const std::string& path, const std::vector<uint8_t>& bytes)>;
  struct Item {
    std::string path;
    std::vector<int32_t> tokens;
    std::string cache_namespace;  // "" or a cache salt's digest: restored only for the same salt
    uint64_t bytes = 0;
    uint64_t last_use = 0;  // this process's clock; at start, the order of the files' modification times
  };
  struct Stats {
    uint64_t files = 0, bytes = 0;  // indexed now
    uint64_t evictions = 0;         // files removed to keep the budget or to make room on a full disk
    uint64_t write_failures = 0;    // stores that did not reach the disk
    uint64_t disk_full = 0;         // stores that found the disk full (ENOSPC, EDQUOT)
    uint64_t temporaries_removed = 0;
  };

  // Makes `dir` if it is missing (throws Error naming it when that fails: a bad setting should stop a
  // server at start), removes temporaries that a crash left, indexes the entries of `fingerprint` and
  // `mode`, logs every file it cannot use, and evicts down to `budget_bytes`. A null log writes to stderr.
  CacheFolder(std::string dir, std::string fingerprint, std::string mode, uint64_t budget_bytes, Log log_sink,
              Writer writer = nullptr);

  const std::string& dir() const { return dir_; }
  uint64_t budget_bytes() const { return budget_; }
  const std::map<std::string, Item>& items() const { return items_; }  // by file name

  // Reads and verifies the entry items() holds under `name`. When the file is gone or bad it is logged,
  // forgotten and std::nullopt comes back; when it is good it becomes the most recently used.
  std::optional<CacheEntry> read(const std::string& name);
  // The caller found a good file's content unusable (it does not fit the model): logged and forgotten.
  void reject(const std::string& name, const std::string& reason);

  // Writes `entry` (this folder's fingerprint and mode) under its cache_file_name and evicts what the
  // budget then needs. Returns the bytes written, 0 when nothing was stored; never throws.
  uint64_t store(const CacheEntry& entry);

  Stats stats() const;

 private:
  void log(const std::string& line) const;
  void forget(const std::string& name, const std::string& why);
  void evict_to_budget();
  // Removes the least recently used entry (there must be one); its bytes.
  uint64_t evict_least_recent();
  // Writes `bytes` to `path`; on a full disk, evicts the least recently used entries for room and
  // tries once more. Throws what the last write threw.
  void write_making_room(const std::string& name, const std::string& path, const std::vector<uint8_t>& bytes);

  std::string dir_, fingerprint_, mode_;
  uint64_t budget_;
  Log log_;
  Writer write_;
  std::map<std::string, Item> items_;
  uint64_t bytes_ = 0, clock_ = 0;
  bool writing_ = true;  // false while stores fail: the next failure is not logged again
  bool warned_too_big_ = false;
  bool disk_full_ = false;  // the last store found the disk full: the next one is not logged again
  Stats counts_;  // the counters; files and bytes come from the index
};

}  // namespace dsv41
