// Weight matrices re-laid at load time for the SIMD linear layers.
//
// The fast kernels put 2W consecutive output rows (one "tile") in the lanes of two vectors, so that
// every output keeps the reference's sequential chain over k (linear_internal.h). From the
// checkpoint's row-major layout that needs a byte transpose per 32×32 block on every call, which
// costs more than reading the bytes: a decode step was bound by it, not by memory. Packed once, a
// tile's weights for one k lie side by side and the inner loop only loads, widens and multiplies.
//
// Layout: tiles of `tile_rows` rows (the last one padded with zero rows); inside a tile, column c
// (one element: an FP8 byte, a byte of two FP4 nibbles, or a bf16 word) of every row, rows
// consecutive, columns in order. Rows are padded to whole K blocks of 32 with zeros. FP4 scales are
// laid the same way ([tile][k block][row], padding rows get 127 = 1.0); FP8's per-32×32 scales are read
// from the checkpoint as they are. The packed copy replaces nothing: the row-major view stays
// valid for the scalar reference and for tiles the SIMD code does not decode (FP8 NaN codes).
#pragma once

#include <cstdint>
#include <memory>

#include "kernels/allocator.h"
#include "kernels/exec.h"
#include "kernels/op_types.h"

namespace dsv41 {

// Owns the packed bytes of one matrix, in memory from the backend's allocator.
class PackedWeights {
 public:
  // Packs `n` rows of `row_bytes` bytes (elements of `elem_bytes`), padding each row to
  // `padded_row_bytes`, tiles split over `exec`'s workers. For FP4 pass the row-major scale codes
  // ([n, scale_cols]); for FP8 pass nan_check = true to flag tiles holding an E4M3 NaN code (0x7F/0xFF).
  PackedWeights(const Exec& exec, Allocator& allocator, const uint8_t* rows, int64_t n, int64_t row_bytes,
                int64_t padded_row_bytes, int elem_bytes, int tile_rows, const uint8_t* row_scales, int64_t scale_cols,
                bool nan_check);
  PackedView view() const { return view_; }
  size_t bytes() const { return tiles_.size() + scales_.size() + nan_tiles_.size(); }

 private:
  Buffer tiles_, scales_, nan_tiles_;
  PackedView view_;
};

// Packed copies of the three matrix kinds in tiles of `tile_rows` rows; the returned object must
// outlive every view that points into it.
std::unique_ptr<PackedWeights> pack_fp8(const Exec& exec, Allocator& allocator, const Fp8Matrix& w, int tile_rows);
std::unique_ptr<PackedWeights> pack_fp4(const Exec& exec, Allocator& allocator, const Fp4Matrix& w, int tile_rows);
std::unique_ptr<PackedWeights> pack_bf16(const Exec& exec, Allocator& allocator, const Bf16Matrix& w, int tile_rows);

// The bytes each of them allocates for an [n, k] matrix (k logical: FP4 stores k/2 bytes a row),
// what a memory plan counts before anything is loaded. PackedWeights::bytes() of the result equals it.
int64_t packed_fp8_bytes(int64_t n, int64_t k, int tile_rows);
int64_t packed_fp4_bytes(int64_t n, int64_t k, int tile_rows);
int64_t packed_bf16_bytes(int64_t n, int64_t k, int tile_rows);

}  // namespace dsv41
