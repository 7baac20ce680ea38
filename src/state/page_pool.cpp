#include "state/page_pool.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>
#include <utility>

#include "util/error.h"

namespace dsv41 {

namespace {

constexpr size_t kAlign = 64;
// Slabs of about this size: large enough that growth is rare, small enough that a pool that only
// ever holds a few pages does not reserve much.
constexpr size_t kSlabTargetBytes = size_t{1} << 20;
constexpr size_t kMaxPagesPerSlab = 256;

}  // namespace

PagePool::PagePool(Allocator& allocator, std::string name, size_t page_bytes, size_t max_pages)
    : allocator_(&allocator), name_(std::move(name)), page_bytes_(page_bytes), max_pages_(max_pages) {
  if (page_bytes_ == 0) fail(name_, "page_bytes must be positive");
  if (page_bytes_ > std::numeric_limits<size_t>::max() - kAlign) fail(name_, "page_bytes too large");
  stride_ = (page_bytes_ + kAlign - 1) / kAlign * kAlign;
  pages_per_slab_ = std::clamp<size_t>(kSlabTargetBytes / stride_, 1, kMaxPagesPerSlab);
  if (max_pages_ != 0) pages_per_slab_ = std::min(pages_per_slab_, max_pages_);
}

PagePool::~PagePool() = default;

void PagePool::grow() {
  size_t count = pages_per_slab_;
  // The last slab of a bounded pool is cut short so reserved pages never exceed max_pages; ids still
  // map to (id / pages_per_slab_, id % pages_per_slab_) because every earlier slab is full size.
  if (max_pages_ != 0) count = std::min(count, max_pages_ - refcount_.size());
  const size_t limit = static_cast<size_t>(std::numeric_limits<int32_t>::max());
  if (refcount_.size() + count > limit) fail(name_, "more pages than a 32-bit page id can name");
  slabs_.emplace_back(*allocator_, count * stride_, kAlign);
  const size_t first = refcount_.size();
  refcount_.resize(first + count, 0);
  // Pushed in reverse so the lowest new id is handed out first (predictable ids help debugging).
  for (size_t i = count; i-- > 0;) free_.push_back(static_cast<int32_t>(first + i));
}

int32_t PagePool::allocate() {
  if (!can_allocate(1)) fail(name_, "out of pages (" + std::to_string(in_use_) + " in use)");
  if (free_.empty()) grow();
  const int32_t page = free_.back();
  free_.pop_back();
  refcount_[page] = 1;
  ++in_use_;
  return page;
}

bool PagePool::can_allocate(size_t n) const { return max_pages_ == 0 || n <= max_pages_ - in_use_; }

void PagePool::check_live(int32_t page, const char* op) const {
  if (page < 0 || static_cast<size_t>(page) >= refcount_.size())
    fail(name_, std::string(op) + " of unknown page " + std::to_string(page));
  if (refcount_[page] <= 0) fail(name_, std::string(op) + " of free page " + std::to_string(page));
}

void PagePool::retain(int32_t page) {
  check_live(page, "retain");
  if (refcount_[page] == std::numeric_limits<int32_t>::max())
    fail(name_, "reference count overflow on page " + std::to_string(page));
  ++refcount_[page];
}

void PagePool::release(int32_t page) {
  check_live(page, "release");
  if (--refcount_[page] == 0) {
    free_.push_back(page);
    --in_use_;
  }
}

int32_t PagePool::make_writable(int32_t page) {
  check_live(page, "make_writable");
  if (refcount_[page] == 1) return page;
  // Allocate before touching the old page: if the pool is full the caller still holds its reference.
  const int32_t copy = allocate();
  std::memcpy(address(copy), address(page), page_bytes_);
  release(page);
  return copy;
}

uint8_t* PagePool::address(int32_t page) const {
  const size_t id = static_cast<size_t>(page);
  return slabs_[id / pages_per_slab_].data() + (id % pages_per_slab_) * stride_;
}

uint8_t* PagePool::data(int32_t page) {
  check_live(page, "data");
  return address(page);
}

const uint8_t* PagePool::data(int32_t page) const {
  check_live(page, "data");
  return address(page);
}

int PagePool::refcount(int32_t page) const {
  if (page < 0 || static_cast<size_t>(page) >= refcount_.size())
    fail(name_, "refcount of unknown page " + std::to_string(page));
  return refcount_[page];
}

}  // namespace dsv41
