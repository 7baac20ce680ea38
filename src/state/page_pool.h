// Fixed-size byte pages with reference counts: the storage under every per-sequence KV array.
// Prefix caching (model-spec §5) shares the global KV rows of a common prompt prefix between
// sequences; sharing whole pages by reference count, and copying a page only when a holder writes
// to a shared one, makes a cache hit cost no copy at all.
//
// Not thread-safe: one scheduler thread owns a pool and every PagedRows built on it. Adding a lock
// here would not make the callers' read-modify-write sequences (check, allocate, write) atomic anyway.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/allocator.h"

namespace dsv41 {

class PagePool {
 public:
  // max_pages 0 means no limit. Nothing is allocated until the first allocate(); slabs of pages
  // come from `allocator` (the backend's), which must outlive the pool.
  PagePool(Allocator& allocator, std::string name, size_t page_bytes, size_t max_pages);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // A page with reference count 1. Its bytes are NOT cleared (callers that need zeros clear what
  // they use). Throws Error "<name>: out of pages (N in use)" when max_pages are in use.
  int32_t allocate();
  bool can_allocate(size_t n) const;

  void retain(int32_t page);
  // Frees the page when the count reaches 0. Releasing a free or unknown page throws Error and
  // changes nothing: a double release is a bookkeeping bug that must not corrupt other holders.
  void release(int32_t page);

  // Returns a page this holder may write: `page` itself when it is the only reference, otherwise a
  // fresh copy (the caller's reference moves from the old page to the copy).
  int32_t make_writable(int32_t page);

  uint8_t* data(int32_t page);  // 64-byte aligned
  const uint8_t* data(int32_t page) const;
  int refcount(int32_t page) const;  // 0 for a free page; Error for an id never handed out

  const std::string& name() const { return name_; }
  size_t page_bytes() const { return page_bytes_; }
  size_t max_pages() const { return max_pages_; }
  size_t pages_in_use() const { return in_use_; }
  size_t bytes_in_use() const { return in_use_ * page_bytes_; }
  size_t pages_reserved() const { return refcount_.size(); }  // in use + on the free list

 private:
  void grow();  // adds one slab and puts its pages on the free list
  void check_live(int32_t page, const char* op) const;
  uint8_t* address(int32_t page) const;

  Allocator* allocator_;
  std::string name_;
  size_t page_bytes_;
  size_t stride_;          // page_bytes rounded up to 64 so every page stays aligned
  size_t max_pages_;
  size_t pages_per_slab_;  // fixed so a page id maps to (slab, offset) by division
  std::vector<Buffer> slabs_;
  std::vector<int32_t> refcount_;  // one per reserved page
  std::vector<int32_t> free_;      // LIFO: the most recently freed page is reused first (warm in cache)
  size_t in_use_ = 0;
};

}  // namespace dsv41
