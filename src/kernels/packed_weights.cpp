#include "kernels/packed_weights.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

namespace dsv41 {

namespace {

constexpr int64_t kKBlock = 32;

// One tile: `count` rows of `cols` elements T, written column by column with `tile_rows` slots per
// column, then zeros for the missing rows and for the columns up to `padded_cols`. Rows are read 64
// columns at a time so each pass touches few cache lines per row.
template <class T>
void transpose_tile(const uint8_t* rows, int64_t count, int64_t row_bytes, int64_t cols, int64_t padded_cols,
                    int tile_rows, uint8_t* tile) {
  constexpr int64_t kStrip = 64;
  T* out = reinterpret_cast<T*>(tile);
  for (int64_t c0 = 0; c0 < cols; c0 += kStrip) {
    const int64_t c1 = std::min(cols, c0 + kStrip);
    for (int64_t r = 0; r < count; ++r) {
      T row[kStrip];
      std::memcpy(row, rows + r * row_bytes + c0 * static_cast<int64_t>(sizeof(T)),
                  static_cast<size_t>(c1 - c0) * sizeof(T));
      for (int64_t c = c0; c < c1; ++c) out[c * tile_rows + r] = row[c - c0];
    }
    for (int64_t r = count; r < tile_rows; ++r) {
      for (int64_t c = c0; c < c1; ++c) out[c * tile_rows + r] = T{0};
    }
  }
  std::fill(out + cols * tile_rows, out + padded_cols * tile_rows, T{0});
}

}  // namespace

PackedView PackedView::from_row(int64_t row0) const {
  if (tile_rows == 0) return *this;
  if (row0 % tile_rows != 0) return {};  // not on a tile boundary: the kernels read the row-major view
  PackedView v = *this;
  const int64_t t = row0 / tile_rows;
  v.tiles += t * tile_bytes;
  if (v.scales != nullptr) v.scales += t * scale_tile_bytes;
  if (v.nan_tiles != nullptr) v.nan_tiles += t;
  return v;
}

// The buffers are not zeroed: the packing threads write every byte, so the pages are first touched
// (and cleared by the kernel) on every core, not on the loading thread.
PackedWeights::PackedWeights(const Exec& exec, Allocator& allocator, const uint8_t* rows, int64_t n, int64_t row_bytes,
                             int64_t padded_row_bytes, int elem_bytes, int tile_rows, const uint8_t* row_scales,
                             int64_t scale_cols, bool nan_check) {
  const int64_t tiles = (n + tile_rows - 1) / tile_rows;
  const int64_t real_cols = row_bytes / elem_bytes, padded_cols = padded_row_bytes / elem_bytes;
  view_.tile_rows = tile_rows;
  view_.tile_bytes = padded_row_bytes * tile_rows;
  tiles_ = Buffer(allocator, static_cast<size_t>(tiles * view_.tile_bytes));
  view_.tiles = tiles_.data();
  if (row_scales != nullptr) {
    view_.scale_tile_bytes = scale_cols * tile_rows;
    scales_ = Buffer(allocator, static_cast<size_t>(tiles * view_.scale_tile_bytes));
    view_.scales = scales_.data();
  }
  if (nan_check) {
    nan_tiles_ = Buffer(allocator, static_cast<size_t>(tiles));
    view_.nan_tiles = nan_tiles_.data();
  }
  uint8_t* out = tiles_.data();
  uint8_t* scales = scales_.data();
  uint8_t* nan = nan_tiles_.data();
  // Tiles are independent; each reads its rows column by column and writes its block in order.
  exec.parallel_for(tiles, 1, [&](int64_t t0, int64_t t1, Scratch&) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = t * tile_rows, count = std::min<int64_t>(tile_rows, n - r0);
      uint8_t* tile = out + t * view_.tile_bytes;
      if (elem_bytes == 1) {
        transpose_tile<uint8_t>(rows + r0 * row_bytes, count, row_bytes, real_cols, padded_cols, tile_rows, tile);
      } else {
        transpose_tile<uint16_t>(rows + r0 * row_bytes, count, row_bytes, real_cols, padded_cols, tile_rows, tile);
      }
      if (scales != nullptr) {
        uint8_t* s = scales + t * view_.scale_tile_bytes;
        for (int64_t b = 0; b < scale_cols; ++b) {
          for (int64_t r = 0; r < tile_rows; ++r) {
            s[b * tile_rows + r] = r < count ? row_scales[(r0 + r) * scale_cols + b] : uint8_t{127};
          }
        }
      }
      if (nan != nullptr) {
        bool any = false;
        for (int64_t r = 0; r < count && !any; ++r) {
          const uint8_t* row = rows + (r0 + r) * row_bytes;
          for (int64_t c = 0; c < row_bytes; ++c) any |= (row[c] & 0x7F) == 0x7F;
        }
        nan[t] = any ? 1 : 0;
      }
    }
  });
}

namespace {
int64_t padded(int64_t k) { return (k + kKBlock - 1) / kKBlock * kKBlock; }
}  // namespace

std::unique_ptr<PackedWeights> pack_fp8(const Exec& exec, Allocator& allocator, const Fp8Matrix& w, int tile_rows) {
  return std::make_unique<PackedWeights>(exec, allocator, w.w, w.n, w.k, padded(w.k), 1, tile_rows, nullptr, 0, true);
}

std::unique_ptr<PackedWeights> pack_fp4(const Exec& exec, Allocator& allocator, const Fp4Matrix& w, int tile_rows) {
  // one column = one byte = two consecutive k (low nibble first), as in the checkpoint
  return std::make_unique<PackedWeights>(exec, allocator, w.w, w.n, w.k / 2, padded(w.k) / 2, 1, tile_rows, w.scale,
                                         w.k / kKBlock, false);
}

std::unique_ptr<PackedWeights> pack_bf16(const Exec& exec, Allocator& allocator, const Bf16Matrix& w, int tile_rows) {
  return std::make_unique<PackedWeights>(exec, allocator, reinterpret_cast<const uint8_t*>(w.w), w.n, w.k * 2,
                                         padded(w.k) * 2, 2, tile_rows, nullptr, 0, false);
}

namespace {
int64_t tile_count(int64_t n, int tile_rows) { return (n + tile_rows - 1) / tile_rows; }
}  // namespace

int64_t packed_fp8_bytes(int64_t n, int64_t k, int tile_rows) {
  const int64_t tiles = tile_count(n, tile_rows);
  return tiles * tile_rows * padded(k) + tiles;  // the tiles, one NaN flag per tile
}

int64_t packed_fp4_bytes(int64_t n, int64_t k, int tile_rows) {
  const int64_t tiles = tile_count(n, tile_rows);
  return tiles * tile_rows * (padded(k) / 2 + k / kKBlock);  // the tiles, their scale codes
}

int64_t packed_bf16_bytes(int64_t n, int64_t k, int tile_rows) {
  return tile_count(n, tile_rows) * tile_rows * padded(k) * 2;
}

}  // namespace dsv41
