// Per-worker scratch memory of the fast kernels: growable buffers a kernel reuses from call to call,
// so hot loops do not allocate. A backend owns one Scratch per pool worker (exec.h hands each range
// its worker's), and a buffer is valid until the same slot is asked for again: a kernel body must
// not call another op while it holds buffers.
#pragma once

#include <array>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace dsv41 {

// The buffers, one name per use; kernels of one family use only their own.
enum class ScratchSlot {
  LinearPanel,       // decoded weight panel of the GEMM path
  LinearScales,      // a tile's weight scales as fp32 lanes
  LinearAcc,         // GEMM accumulators
  LinearZeros,       // zero rows standing in for rows past the matrix (zeroed())
  LinearTail,        // zero-padded copies of a partial last K block
  AttentionQuery,    // queries transposed, heads in lanes
  AttentionAcc,      // P·V accumulators
  AttentionLogits,   // one chunk's logits
  AttentionRows,     // a query's K=V rows decoded to fp32 (the calling thread's)
  AttentionRowList,  // pointers to them, null for empty slots
  IndexColumns,      // a key tile regrouped lane-wise (the integer path: its rows side by side)
  IndexKeyBytes,     // the same tile as biased bytes for vpdpbusd
  IndexScales,       // its E8M0 scales as fp32
  IndexAcc,          // dot chains of a query group
  IndexTiles,        // a chunk of key tiles' descriptions for vpdpbusd
  IndexKeys,         // key rows of one query's candidate pool
  IndexScores,       // scores of those rows
  DenseQuery,        // the ViT's attention: a block of queries transposed, queries in lanes
  DenseScores,       // their scores, then probabilities, against every key
  DenseOut,          // their outputs before the transpose back
  PairRows,          // activations or keys as bf16 pairs for vdpbf16ps (the calling thread's)
  Count
};

class Scratch {
 public:
  // Slot `slot` grown to at least `count` T's, 64-byte aligned; contents unspecified.
  template <class T>
  T* get(ScratchSlot slot, size_t count) {
    return static_cast<T*>(grow(slot, count * sizeof(T), false));
  }
  // The same, every byte zero. A caller must never write into it.
  template <class T>
  const T* zeroed(ScratchSlot slot, size_t count) {
    return static_cast<const T*>(grow(slot, count * sizeof(T), true));
  }
  size_t bytes() const {
    size_t n = 0;
    for (const Buffer& b : buffers_) n += b.bytes;
    return n;
  }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  struct Buffer {
    std::unique_ptr<void, Free> data;
    size_t bytes = 0;
  };
  void* grow(ScratchSlot slot, size_t bytes, bool zero) {
    Buffer& b = buffers_[static_cast<size_t>(slot)];
    if (b.bytes < bytes) {
      const size_t size = (bytes + 63) / 64 * 64;
      void* p = std::aligned_alloc(64, size);
      if (p == nullptr) throw std::bad_alloc();
      if (zero) std::memset(p, 0, size);
      b.data.reset(p);
      b.bytes = size;
    }
    return b.data.get();
  }
  std::array<Buffer, static_cast<size_t>(ScratchSlot::Count)> buffers_;
};

}  // namespace dsv41
