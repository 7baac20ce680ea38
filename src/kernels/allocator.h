// Where a backend's long-lived memory comes from: the packed weight copies and the state pages.
// A backend owns one Allocator and hands it to whatever allocates on its behalf, so a backend whose
// memory lives elsewhere (another NUMA node, a device) changes one object; it also counts what is
// allocated, for the memory accounting.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace dsv41 {

class Allocator {
 public:
  virtual ~Allocator() = default;
  // `bytes` (> 0) aligned to `alignment` (a power of two, at least 64); std::bad_alloc when there
  // is none. The contents are not cleared.
  virtual void* allocate(size_t bytes, size_t alignment) = 0;
  virtual void deallocate(void* p, size_t bytes) noexcept = 0;
  virtual size_t bytes_in_use() const = 0;
};

// Host memory from the C heap. Blocks of 2 MiB and more are 2 MiB aligned and asked for as
// transparent huge pages, which spare streaming reads over them most of their TLB misses.
class HostAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes, size_t alignment) override;
  void deallocate(void* p, size_t bytes) noexcept override;
  size_t bytes_in_use() const override { return in_use_.load(std::memory_order_relaxed); }

 private:
  std::atomic<size_t> in_use_{0};
};

// Memory from an allocator, given back when the buffer goes. Move-only.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Allocator& allocator, size_t bytes, size_t alignment = 64);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  void reset() noexcept;
  Allocator* allocator_ = nullptr;
  uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace dsv41
