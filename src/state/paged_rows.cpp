#include "state/paged_rows.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "util/error.h"

namespace dsv41 {

PagedRows::PagedRows(PagePool& pool, size_t row_bytes)
    : pool_(&pool), row_bytes_(row_bytes), rows_per_page_(row_bytes == 0 ? 0 : pool.page_bytes() / row_bytes) {
  if (row_bytes_ == 0) fail(pool.name(), "PagedRows row_bytes must be positive");
  if (rows_per_page_ == 0)
    fail(pool.name(), "row of " + std::to_string(row_bytes_) + " bytes does not fit a page of " +
                          std::to_string(pool.page_bytes()) + " bytes");
}

PagedRows::~PagedRows() { release_all(); }

PagedRows::PagedRows(PagedRows&& other) noexcept
    : pool_(other.pool_),
      row_bytes_(other.row_bytes_),
      rows_per_page_(other.rows_per_page_),
      pages_(std::move(other.pages_)),
      size_(other.size_) {
  other.pages_.clear();
  other.size_ = 0;
}

PagedRows& PagedRows::operator=(PagedRows&& other) noexcept {
  if (this == &other) return *this;
  release_all();
  pool_ = other.pool_;
  row_bytes_ = other.row_bytes_;
  rows_per_page_ = other.rows_per_page_;
  pages_ = std::move(other.pages_);
  size_ = other.size_;
  other.pages_.clear();
  other.size_ = 0;
  return *this;
}

void PagedRows::release_all() noexcept {
  // Every page here holds a reference this array counted, so release cannot fail; if the pool's
  // bookkeeping were ever broken, a destructor must still not throw, hence the catch.
  for (int32_t page : pages_) {
    try {
      pool_->release(page);
    } catch (const Error&) {
    }
  }
  pages_.clear();
  size_ = 0;
}

size_t PagedRows::pages_for(int64_t rows) const {
  return (static_cast<size_t>(rows) + rows_per_page_ - 1) / rows_per_page_;
}

uint8_t* PagedRows::row_in_page(int32_t page, int64_t i) const {
  return pool_->data(page) + (static_cast<size_t>(i) % rows_per_page_) * row_bytes_;
}

void PagedRows::check_index(int64_t i, const char* op) const {
  if (i < 0 || i >= size_)
    fail(pool_->name(), std::string(op) + ": row " + std::to_string(i) + " out of range [0, " +
                            std::to_string(size_) + ")");
}

const uint8_t* PagedRows::row(int64_t i) const {
  check_index(i, "row");
  return row_in_page(pages_[static_cast<size_t>(i) / rows_per_page_], i);
}

void PagedRows::row_addresses(int64_t n, const uint8_t** out) const {
  if (n < 0 || n > size_)
    fail(pool_->name(), "row_addresses of " + std::to_string(n) + " rows, have " + std::to_string(size_));
  for (int64_t first = 0; first < n; first += static_cast<int64_t>(rows_per_page_)) {
    const uint8_t* page = pool_->data(pages_[static_cast<size_t>(first) / rows_per_page_]);
    const int64_t last = std::min(n, first + static_cast<int64_t>(rows_per_page_));
    for (int64_t i = first; i < last; ++i) out[i] = page + static_cast<size_t>(i - first) * row_bytes_;
  }
}

uint8_t* PagedRows::append() {
  const size_t slot = static_cast<size_t>(size_) % rows_per_page_;
  if (slot == 0) {
    pages_.reserve(pages_.size() + 1);  // so push_back cannot throw after the page is taken
    pages_.push_back(pool_->allocate());
  } else {
    // The last page may be shared with a sequence branched from this one (or this one's parent):
    // its other rows are theirs too, so write into a private copy.
    pages_.back() = pool_->make_writable(pages_.back());
  }
  uint8_t* out = row_in_page(pages_.back(), size_);
  std::memset(out, 0, row_bytes_);
  ++size_;
  return out;
}

uint8_t* PagedRows::mutable_row(int64_t i) {
  check_index(i, "mutable_row");
  int32_t& page = pages_[static_cast<size_t>(i) / rows_per_page_];
  page = pool_->make_writable(page);
  return row_in_page(page, i);
}

void PagedRows::truncate(int64_t n) {
  if (n < 0 || n > size_)
    fail(pool_->name(), "truncate to " + std::to_string(n) + " rows, have " + std::to_string(size_));
  const size_t keep = pages_for(n);
  while (pages_.size() > keep) {
    pool_->release(pages_.back());
    pages_.pop_back();
  }
  // Rows past n in the kept last page keep stale bytes; append() clears each row it hands out.
  size_ = n;
}

PagedRows PagedRows::share(int64_t n) const {
  if (n < 0 || n > size_)
    fail(pool_->name(), "share of " + std::to_string(n) + " rows, have " + std::to_string(size_));
  PagedRows out(*pool_, row_bytes_);
  const size_t count = pages_for(n);
  out.pages_.reserve(count);
  for (size_t p = 0; p < count; ++p) {
    pool_->retain(pages_[p]);
    out.pages_.push_back(pages_[p]);
  }
  out.size_ = n;
  return out;
}

PagedRows PagedRows::adopt(PagePool& pool, size_t row_bytes, std::vector<int32_t> pages, int64_t rows) {
  PagedRows out(pool, row_bytes);
  if (rows < 0 || pages.size() != out.pages_for(rows))
    fail(pool.name(), "adopt of " + std::to_string(rows) + " rows needs " +
                          std::to_string(rows < 0 ? 0 : out.pages_for(rows)) + " pages, got " +
                          std::to_string(pages.size()));
  for (int32_t page : pages)
    if (pool.refcount(page) <= 0) fail(pool.name(), "adopt of free page " + std::to_string(page));
  out.pages_ = std::move(pages);
  out.size_ = rows;
  return out;
}

}  // namespace dsv41
