// Engram tables in the memory hierarchy (model-spec §3.6). Each Engram layer of the release holds an
// FP8 table of ~384M rows × 256 bytes (~98 GB) plus one E8M0 scale per 32 bytes of a row, and a token
// reads only 24 rows of it. Row ids depend only on the token ids, so the rows of a step can be
// requested before the layers in front of the Engram layer run and collected when it needs them.
// EngramStore serves one layer's table from one of three tiers:
//   Mmap  - zero-copy reads from the checkpoint mapping; the OS page cache is the cache (default).
//   Ram   - the table and scales are copied into process memory when the store is built.
//   Pread - rows are read from the file with pread(2) by a small pool of I/O threads, so neither the
//           whole table nor its mapping has to be resident.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "io/safetensors.h"

namespace dsv41 {

enum class EngramTier { Mmap, Ram, Pread };

// "mmap" | "ram" | "pread"; anything else is an Error naming --engram.
EngramTier parse_engram_tier(const std::string& name);
const char* engram_tier_name(EngramTier tier);

class EngramStore {
 public:
  using Ticket = uint64_t;

  // `table`: F8_E4M3 [rows, head_dim]; `scale`: F8_E8M0 [rows, head_dim/32] (Error otherwise, naming
  // the tensor). `io_threads` sizes the Pread tier's pool (created here, once); other tiers start none.
  // The views must outlive the store for the Mmap tier (it reads through them). `held`: the rows
  // [first, end) the store serves (end -1: to the last), an expert-parallel rank's share; the Ram tier
  // copies only those, and a request for another row is an Error.
  EngramStore(const TensorView& table, const TensorView& scale, EngramTier tier, int io_threads = 4,
              std::pair<int64_t, int64_t> held = {0, -1});
  ~EngramStore();  // stops and joins the I/O threads; tickets not gathered are dropped
  EngramStore(const EngramStore&) = delete;
  EngramStore& operator=(const EngramStore&) = delete;

  int64_t rows() const;  // the whole table's
  std::pair<int64_t, int64_t> held() const;  // the rows served: [first, end)
  int64_t row_bytes() const;    // head_dim: FP8 codes per row
  int64_t scale_bytes() const;  // row_bytes / 32: E8M0 scales per row
  EngramTier tier() const;
  const std::string& name() const;  // the table tensor's name, e.g. layers.1.engram.embed.weight

  // Checks every id (Error naming the table and the row, before anything is started), starts fetching
  // the rows and returns a ticket for gather(). Ids may repeat. Mmap: asks the kernel to read the rows'
  // pages ahead (MADV_WILLNEED); Ram: nothing to do; Pread: queues the reads on the I/O threads.
  // Any number of tickets may be outstanding and they may be gathered in any order. Thread-safe.
  Ticket prefetch(const std::vector<int64_t>& row_ids);

  // Waits for the ticket's rows, then writes the row codes into `codes` (n × row_bytes) and the scale
  // bytes into `scales` (n × scale_bytes), in the order of the prefetch's row_ids. A ticket is used
  // up by its gather. An unknown ticket, a short read or an I/O error is an Error. Thread-safe.
  void gather(Ticket ticket, uint8_t* codes, uint8_t* scales);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Mean wall time in microseconds of one step's lookup on `store`: prefetch then gather of
// `rows_per_step` uniformly random row ids (the hashed ids of the model are close to uniform). The
// ids are drawn before timing starts; `seed` makes the sequence repeatable. The page cache is left as
// it is, so a second run over a file that fits in memory measures warm-cache lookups.
double measure_engram_lookup_us(EngramStore& store, int steps, int rows_per_step, uint64_t seed);

}  // namespace dsv41
