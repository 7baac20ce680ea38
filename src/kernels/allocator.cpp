#include "kernels/allocator.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <utility>

namespace dsv41 {

namespace {
constexpr size_t kHugePage = size_t{2} << 20;
}  // namespace

void* HostAllocator::allocate(size_t bytes, size_t alignment) {
  const size_t align = bytes >= kHugePage ? std::max(alignment, kHugePage) : std::max<size_t>(alignment, 64);
  const size_t size = (std::max<size_t>(bytes, 1) + align - 1) / align * align;
  void* p = std::aligned_alloc(align, size);
  if (p == nullptr) throw std::bad_alloc();
  if (align >= kHugePage) madvise(p, size, MADV_HUGEPAGE);  // a hint: ignored where THP is off
  in_use_.fetch_add(bytes, std::memory_order_relaxed);
  return p;
}

void HostAllocator::deallocate(void* p, size_t bytes) noexcept {
  if (p == nullptr) return;
  std::free(p);
  in_use_.fetch_sub(bytes, std::memory_order_relaxed);
}

Buffer::Buffer(Allocator& allocator, size_t bytes, size_t alignment)
    : allocator_(&allocator), data_(static_cast<uint8_t*>(allocator.allocate(bytes, alignment))), bytes_(bytes) {}

Buffer::~Buffer() { reset(); }

Buffer::Buffer(Buffer&& other) noexcept
    : allocator_(std::exchange(other.allocator_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    reset();
    allocator_ = std::exchange(other.allocator_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void Buffer::reset() noexcept {
  if (allocator_ != nullptr) allocator_->deallocate(data_, bytes_);
  allocator_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace dsv41
