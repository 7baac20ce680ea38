// A growable array of fixed-size rows (e.g. one 288 B main-KV row per compressed position,
// model-spec §6.1) stored in a PagePool's pages. Rows never straddle pages, so row i lives at
// page i / rows_per_page, offset (i % rows_per_page) * row_bytes.
//
// share() gives a second sequence the same prefix without copying: both hold references to the same
// pages, and whichever writes to a shared page first gets its own copy (copy-on-write). Full shared
// pages of a prompt prefix are never written again (rows are append-only apart from rollback), so
// they stay shared for the life of both sequences; only the partial last page is ever copied.
//
// Not thread-safe, like the pool it lives in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "state/page_pool.h"

namespace dsv41 {

class PagedRows {
 public:
  PagedRows(PagePool& pool, size_t row_bytes);
  ~PagedRows();
  PagedRows(const PagedRows&) = delete;
  PagedRows& operator=(const PagedRows&) = delete;
  // A moved-from PagedRows is empty but still usable on the same pool.
  PagedRows(PagedRows&& other) noexcept;
  PagedRows& operator=(PagedRows&& other) noexcept;

  int64_t size() const { return size_; }
  size_t row_bytes() const { return row_bytes_; }
  size_t rows_per_page() const { return rows_per_page_; }
  PagePool& pool() const { return *pool_; }

  // Read access; Error when i is outside [0, size()).
  const uint8_t* row(int64_t i) const;
  // The addresses of rows [0, n) into out[0, n), a page at a time (the indexer reads every row of a
  // long history each step: one check per page, not per row). Error when n > size().
  void row_addresses(int64_t n, const uint8_t** out) const;
  // Adds a zeroed row and returns its bytes. Valid until the next call that changes this array.
  uint8_t* append();
  // Write access to an existing row; copies its page first if another holder shares it.
  uint8_t* mutable_row(int64_t i);
  // Keeps rows [0, n) and releases the pages no longer needed (rollback of rejected draft tokens).
  void truncate(int64_t n);

  // A new array with the first n rows, sharing this array's pages (no copy).
  PagedRows share(int64_t n) const;
  // Page ids in row order; holds exactly ceil(size() / rows_per_page()) pages.
  const std::vector<int32_t>& pages() const { return pages_; }

  // Takes over page references the caller already holds (e.g. a prefix-cache entry being restored).
  // On Error nothing is taken and the caller still owns the references.
  static PagedRows adopt(PagePool& pool, size_t row_bytes, std::vector<int32_t> pages, int64_t rows);

 private:
  void release_all() noexcept;
  size_t pages_for(int64_t rows) const;
  uint8_t* row_in_page(int32_t page, int64_t i) const;
  void check_index(int64_t i, const char* op) const;

  PagePool* pool_;
  size_t row_bytes_;
  size_t rows_per_page_;
  std::vector<int32_t> pages_;
  int64_t size_ = 0;
};

}  // namespace dsv41
