#include "io/engram_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <system_error>
#include <thread>

#include "util/error.h"
#include "util/regular_file.h"

namespace dsv41 {

namespace {

std::string errno_text(int err) { return std::generic_category().message(err); }

// Reads exactly `n` bytes at `offset`, or throws an Error that says what was being read and why
// it stopped. A read that returns 0 early means the file now ends before the tensor does.
void read_exact(int fd, uint8_t* dst, size_t n, uint64_t offset, const std::string& file,
                const std::string& what) {
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd, dst + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      fail(file, "cannot read " + what + " (" + std::to_string(n) + " bytes at offset " + std::to_string(offset) +
                     "): " + errno_text(errno));
    }
    if (got == 0) {
      fail(file, "short read of " + what + ": got " + std::to_string(done) + " of " + std::to_string(n) +
                     " bytes at offset " + std::to_string(offset) +
                     " (the file ends there; was it truncated after it was opened?)");
    }
    done += static_cast<size_t>(got);
  }
}

size_t page_size() {
  static const size_t size = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

// madvise wants a page-aligned start; widen [begin, begin+len) to whole pages. The extra bytes at
// either end belong to neighbouring tensors of the same read-only mapping, so the advice is harmless
// there.
void advise_pages(const uint8_t* begin, size_t len, int advice) {
  if (len == 0) return;
  const uintptr_t page = page_size();
  const uintptr_t lo = reinterpret_cast<uintptr_t>(begin) & ~(page - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(begin) + len + page - 1) & ~(page - 1);
  // Advice only: a kernel that refuses it still serves the reads, so the result is not checked.
  (void)::madvise(reinterpret_cast<void*>(lo), hi - lo, advice);
}

// MADV_WILLNEED for the pages holding rows `sorted` (ascending, unique) of a region with `stride`
// bytes per row, one call per run of adjacent pages rather than one per row.
void will_need_rows(const uint8_t* base, int64_t stride, const std::vector<int64_t>& sorted) {
  const uintptr_t page = page_size();
  uintptr_t run_lo = 0, run_hi = 0;
  for (int64_t row : sorted) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(base + row * stride);
    const uintptr_t lo = start & ~(page - 1);
    const uintptr_t hi = (start + static_cast<uintptr_t>(stride) + page - 1) & ~(page - 1);
    if (run_hi != 0 && lo <= run_hi) {
      run_hi = std::max(run_hi, hi);
      continue;
    }
    if (run_hi != 0) (void)::madvise(reinterpret_cast<void*>(run_lo), run_hi - run_lo, MADV_WILLNEED);
    run_lo = lo;
    run_hi = hi;
  }
  if (run_hi != 0) (void)::madvise(reinterpret_cast<void*>(run_lo), run_hi - run_lo, MADV_WILLNEED);
}

// The file must still hold the whole tensor when the store is built; later truncation shows up as a
// short read in gather().
void check_file_holds(int fd, const TensorView& view) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail(*view.file, "cannot stat: " + errno_text(errno));
  const uint64_t end = view.file_offset + view.nbytes();
  if (static_cast<uint64_t>(st.st_size) < end) {
    fail(*view.file, "holds " + std::to_string(st.st_size) + " bytes but tensor " + view.name() + " ends at byte " +
                         std::to_string(end));
  }
}

// Rows read by one pread at most (bounds a single read; runs of adjacent ids are rare anyway).
constexpr size_t kMaxRunRows = 64;

}  // namespace

EngramTier parse_engram_tier(const std::string& name) {
  if (name == "mmap") return EngramTier::Mmap;
  if (name == "ram") return EngramTier::Ram;
  if (name == "pread") return EngramTier::Pread;
  fail("--engram", "unknown Engram tier '" + name + "' (expected mmap, ram or pread)");
}

const char* engram_tier_name(EngramTier tier) {
  switch (tier) {
    case EngramTier::Mmap: return "mmap";
    case EngramTier::Ram: return "ram";
    case EngramTier::Pread: return "pread";
  }
  return "?";
}

struct EngramStore::Impl {
  // One prefetch: the ids as asked, and for the Pread tier the distinct rows being read.
  struct Request {
    std::vector<int64_t> ids;
    std::vector<int64_t> unique;  // ascending, distinct
    std::vector<size_t> slot;     // ids[i] == unique[slot[i]]
    std::unique_ptr<uint8_t[]> codes, scales;  // Pread: unique.size() rows of each
    size_t outstanding = 0;       // Pread jobs not finished yet (guarded by Impl::mu)
    std::string error;            // first failure of a job (guarded by Impl::mu)
  };
  // Rows unique[first, last) of `request`, read by one I/O thread.
  struct Job {
    std::shared_ptr<Request> request;
    size_t first = 0, last = 0;
  };

  std::string name;
  EngramTier tier = EngramTier::Mmap;
  int64_t rows = 0, row_bytes = 0, scale_bytes = 0;
  int64_t held_first = 0, held_end = 0;  // the rows this store serves (an expert-parallel rank's share)
  size_t io_threads = 0;

  // Mmap and Ram: where gather() copies from; row `src_first` is at their start (the Ram tier copies
  // only the held rows).
  int64_t src_first = 0;
  const uint8_t* codes_src = nullptr;
  const uint8_t* scales_src = nullptr;
  std::unique_ptr<uint8_t[]> ram_codes, ram_scales;

  // Pread: descriptors (the same one when both tensors share a file) and file offsets.
  std::string table_file, scale_file;
  int table_fd = -1, scale_fd = -1;
  uint64_t table_offset = 0, scale_offset = 0;

  std::mutex mu;
  std::condition_variable work_cv;  // a job was queued, or stop
  std::condition_variable done_cv;  // a request's last job finished
  std::deque<Job> queue;
  bool stop = false;
  std::vector<std::thread> workers;
  std::map<Ticket, std::shared_ptr<Request>> tickets;
  Ticket next_ticket = 1;

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    work_cv.notify_all();
    for (std::thread& t : workers) t.join();
    if (scale_fd >= 0 && scale_fd != table_fd) ::close(scale_fd);
    if (table_fd >= 0) ::close(table_fd);
  }

  void worker() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu);
        work_cv.wait(lock, [this] { return stop || !queue.empty(); });
        if (stop) return;  // queued jobs are dropped: their tickets die with the store
        job = std::move(queue.front());
        queue.pop_front();
      }
      std::string error;
      try {
        run(job);
      } catch (const std::exception& e) {
        error = e.what();
      }
      bool last;
      {
        std::lock_guard<std::mutex> lock(mu);
        Request& r = *job.request;
        if (!error.empty() && r.error.empty()) r.error = std::move(error);
        last = --r.outstanding == 0;
      }
      if (last) done_cv.notify_all();
    }
  }

  // Reads the job's rows with one pread for the codes and one for the scales of each run of
  // adjacent rows (random ids rarely form runs, but a run costs no more than a single row).
  void run(const Job& job) {
    Request& r = *job.request;
    for (size_t first = job.first; first < job.last;) {
      const int64_t first_row = r.unique[first];
      size_t count = 1;
      while (first + count < job.last && count < kMaxRunRows &&
             r.unique[first + count] == first_row + static_cast<int64_t>(count)) {
        ++count;
      }
      const int64_t last_row = first_row + static_cast<int64_t>(count) - 1;
      const auto what = [&] {
        return "rows " + std::to_string(first_row) + ".." + std::to_string(last_row) + " of " + name;
      };
      try {
        read_exact(table_fd, r.codes.get() + first * row_bytes, count * row_bytes,
                   table_offset + static_cast<uint64_t>(first_row * row_bytes), table_file, "Engram rows");
        read_exact(scale_fd, r.scales.get() + first * scale_bytes, count * scale_bytes,
                   scale_offset + static_cast<uint64_t>(first_row * scale_bytes), scale_file, "Engram scales");
      } catch (const Error& e) {
        // Name the table and rows only on failure: building the text per read would cost more
        // than a page-cache read itself.
        throw Error(std::string(e.what()) + " [" + what() + "]");
      }
      first += count;
    }
  }
};

EngramStore::EngramStore(const TensorView& table, const TensorView& scale, EngramTier tier, int io_threads,
                         std::pair<int64_t, int64_t> held)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.name = table.name();
  s.tier = tier;
  if (table.dtype() != DType::F8_E4M3 || table.shape().size() != 2) {
    fail(table.name(), "an Engram table must be a 2-D F8_E4M3 tensor, got " + std::string(dtype_name(table.dtype())));
  }
  s.rows = table.shape()[0];
  s.row_bytes = table.shape()[1];
  if (s.rows <= 0 || s.row_bytes <= 0 || s.row_bytes % 32 != 0) {
    fail(table.name(), "an Engram table needs rows > 0 and a row length divisible by 32, got [" +
                           std::to_string(s.rows) + "," + std::to_string(s.row_bytes) + "]");
  }
  s.scale_bytes = s.row_bytes / 32;
  if (scale.dtype() != DType::F8_E8M0 || scale.shape() != std::vector<int64_t>{s.rows, s.scale_bytes}) {
    fail(scale.name(), "the scales of " + table.name() + " must be F8_E8M0 [" + std::to_string(s.rows) + "," +
                           std::to_string(s.scale_bytes) + "]");
  }
  s.held_first = held.first;
  s.held_end = held.second < 0 ? s.rows : held.second;
  if (s.held_first < 0 || s.held_first > s.held_end || s.held_end > s.rows) {
    fail(table.name(), "rows " + std::to_string(s.held_first) + ".." + std::to_string(s.held_end) +
                           " to hold are not within the table of " + std::to_string(s.rows) + " rows");
  }

  switch (tier) {
    case EngramTier::Mmap:
      s.codes_src = table.data;
      s.scales_src = scale.data;
      // A lookup touches 24 random rows of 256 bytes; the kernel's default fault-around readahead
      // would pull in tens of neighbouring pages per row, none of them wanted, spending disk
      // bandwidth and evicting useful page cache. MADV_RANDOM makes a fault read just its page.
      advise_pages(table.data, table.nbytes(), MADV_RANDOM);
      advise_pages(scale.data, scale.nbytes(), MADV_RANDOM);
      break;

    case EngramTier::Ram: {
      // Read with pread rather than copied from the mapping: sequential reads get full readahead,
      // a truncated file is an Error instead of SIGBUS, and each chunk is dropped from the page
      // cache once copied so that a 98 GB table does not sit in memory twice.
      // (Only the held rows: the share of an expert-parallel rank.)
      auto load = [&s](const TensorView& view, int64_t row_len, std::unique_ptr<uint8_t[]>& out) {
        const int fd = open_regular_file(*view.file);
        struct Closer {
          int fd;
          ~Closer() { ::close(fd); }
        } closer{fd};
        check_file_holds(fd, view);
        const size_t total = static_cast<size_t>((s.held_end - s.held_first) * row_len);
        const uint64_t start = view.file_offset + static_cast<uint64_t>(s.held_first * row_len);
        out = std::make_unique_for_overwrite<uint8_t[]>(std::max<size_t>(total, 1));
        constexpr size_t kChunk = size_t{64} << 20;
        for (size_t done = 0; done < total; done += kChunk) {
          const size_t n = std::min(kChunk, total - done);
          const uint64_t offset = start + done;
          read_exact(fd, out.get() + done, n, offset, *view.file, "tensor " + view.name());
          (void)::posix_fadvise(fd, static_cast<off_t>(offset), static_cast<off_t>(n), POSIX_FADV_DONTNEED);
        }
      };
      load(table, s.row_bytes, s.ram_codes);
      load(scale, s.scale_bytes, s.ram_scales);
      s.src_first = s.held_first;
      s.codes_src = s.ram_codes.get();
      s.scales_src = s.ram_scales.get();
      break;
    }

    case EngramTier::Pread:
      if (io_threads < 1 || io_threads > 256) {
        fail("engram store", "io_threads must be in 1..256, got " + std::to_string(io_threads));
      }
      s.table_file = *table.file;
      s.scale_file = *scale.file;
      s.table_offset = table.file_offset;
      s.scale_offset = scale.file_offset;
      s.table_fd = open_regular_file(s.table_file);
      s.scale_fd = s.scale_file == s.table_file ? s.table_fd : open_regular_file(s.scale_file);
      check_file_holds(s.table_fd, table);
      check_file_holds(s.scale_fd, scale);
      // Same reason as MADV_RANDOM above: no readahead around 256-byte reads. (Linux applies this to
      // the whole descriptor, whatever the range.)
      (void)::posix_fadvise(s.table_fd, 0, 0, POSIX_FADV_RANDOM);
      if (s.scale_fd != s.table_fd) (void)::posix_fadvise(s.scale_fd, 0, 0, POSIX_FADV_RANDOM);
      // The pool lives as long as the store: a lookup only queues work. If starting a thread throws,
      // ~Impl joins those already running.
      s.io_threads = static_cast<size_t>(io_threads);
      s.workers.reserve(s.io_threads);
      for (int i = 0; i < io_threads; ++i) s.workers.emplace_back([&s] { s.worker(); });
      break;
  }
}

EngramStore::~EngramStore() = default;

int64_t EngramStore::rows() const { return impl_->rows; }
std::pair<int64_t, int64_t> EngramStore::held() const { return {impl_->held_first, impl_->held_end}; }
int64_t EngramStore::row_bytes() const { return impl_->row_bytes; }
int64_t EngramStore::scale_bytes() const { return impl_->scale_bytes; }
EngramTier EngramStore::tier() const { return impl_->tier; }
const std::string& EngramStore::name() const { return impl_->name; }

EngramStore::Ticket EngramStore::prefetch(const std::vector<int64_t>& row_ids) {
  Impl& s = *impl_;
  for (size_t i = 0; i < row_ids.size(); ++i) {
    const int64_t row = row_ids[i];
    if (row < 0 || row >= s.rows) {
      fail(s.name, "row id " + std::to_string(row) + " (position " + std::to_string(i) +
                       " of the request) outside the table of " + std::to_string(s.rows) + " rows");
    }
    if (row < s.held_first || row >= s.held_end) {
      fail(s.name, "row id " + std::to_string(row) + " (position " + std::to_string(i) +
                       " of the request) is not among the rows " + std::to_string(s.held_first) + ".." +
                       std::to_string(s.held_end) + " held here");
    }
  }
  auto request = std::make_shared<Impl::Request>();
  request->ids = row_ids;
  std::vector<Impl::Job> jobs;
  if (s.tier != EngramTier::Ram) {
    request->unique = row_ids;
    std::sort(request->unique.begin(), request->unique.end());
    request->unique.erase(std::unique(request->unique.begin(), request->unique.end()), request->unique.end());
  }
  if (s.tier == EngramTier::Mmap) {
    will_need_rows(s.codes_src, s.row_bytes, request->unique);
    will_need_rows(s.scales_src, s.scale_bytes, request->unique);
  } else if (s.tier == EngramTier::Pread) {
    const std::vector<int64_t>& u = request->unique;
    request->slot.resize(row_ids.size());
    for (size_t i = 0; i < row_ids.size(); ++i) {
      request->slot[i] = static_cast<size_t>(std::lower_bound(u.begin(), u.end(), row_ids[i]) - u.begin());
    }
    request->codes = std::make_unique_for_overwrite<uint8_t[]>(u.size() * s.row_bytes);
    request->scales = std::make_unique_for_overwrite<uint8_t[]>(u.size() * s.scale_bytes);
    // One job per I/O thread at most: handing a thread its work costs a wake-up (microseconds),
    // so the rows are split into a few equal slices rather than queued one by one. Each thread
    // then keeps its own reads in flight, giving the device a queue depth of io_threads.
    const size_t per_job = std::max<size_t>(1, (u.size() + s.io_threads - 1) / s.io_threads);
    for (size_t first = 0; first < u.size(); first += per_job) {
      jobs.push_back({request, first, std::min(u.size(), first + per_job)});
    }
    request->outstanding = jobs.size();
  }

  Ticket ticket;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    ticket = s.next_ticket++;
    s.tickets.emplace(ticket, request);
    for (Impl::Job& job : jobs) s.queue.push_back(std::move(job));
  }
  if (!jobs.empty()) s.work_cv.notify_all();
  return ticket;
}

void EngramStore::gather(Ticket ticket, uint8_t* codes, uint8_t* scales) {
  Impl& s = *impl_;
  std::shared_ptr<Impl::Request> request;
  {
    std::unique_lock<std::mutex> lock(s.mu);
    const auto it = s.tickets.find(ticket);
    if (it == s.tickets.end()) {
      fail(s.name, "unknown Engram ticket " + std::to_string(ticket) + " (never issued, or already gathered)");
    }
    request = std::move(it->second);
    s.tickets.erase(it);  // taken now, so a second gather of the same ticket is an Error
    s.done_cv.wait(lock, [&request] { return request->outstanding == 0; });
  }
  const Impl::Request& r = *request;
  if (!r.error.empty()) throw Error(r.error);

  const size_t rb = static_cast<size_t>(s.row_bytes), sb = static_cast<size_t>(s.scale_bytes);
  for (size_t i = 0; i < r.ids.size(); ++i) {
    const uint8_t* code_row;
    const uint8_t* scale_row;
    if (s.tier == EngramTier::Pread) {
      code_row = r.codes.get() + r.slot[i] * rb;
      scale_row = r.scales.get() + r.slot[i] * sb;
    } else {
      code_row = s.codes_src + static_cast<size_t>(r.ids[i] - s.src_first) * rb;
      scale_row = s.scales_src + static_cast<size_t>(r.ids[i] - s.src_first) * sb;
    }
    std::memcpy(codes + i * rb, code_row, rb);
    std::memcpy(scales + i * sb, scale_row, sb);
  }
}

double measure_engram_lookup_us(EngramStore& store, int steps, int rows_per_step, uint64_t seed) {
  if (steps < 1 || rows_per_step < 1) {
    fail("engram measurement", "steps and rows_per_step must be positive, got " + std::to_string(steps) + " and " +
                                   std::to_string(rows_per_step));
  }
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> pick(store.held().first, store.held().second - 1);
  std::vector<std::vector<int64_t>> ids(static_cast<size_t>(steps));
  for (auto& step : ids) {
    step.resize(static_cast<size_t>(rows_per_step));
    for (int64_t& id : step) id = pick(rng);
  }
  std::vector<uint8_t> codes(static_cast<size_t>(rows_per_step * store.row_bytes()));
  std::vector<uint8_t> scales(static_cast<size_t>(rows_per_step * store.scale_bytes()));

  const auto start = std::chrono::steady_clock::now();
  for (const auto& step : ids) store.gather(store.prefetch(step), codes.data(), scales.data());
  const std::chrono::duration<double, std::micro> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / steps;
}

}  // namespace dsv41
