// The packed row formats of the per-sequence state (model-spec §6.1). Each pack function quantizes a
// row exactly as the reference's quantize-dequantize does (same codes, same scales) and stores the
// codes; unpack returns the values the reference holds (bf16-exact), so storing packed loses nothing.
#pragma once

#include <cstdint>

namespace dsv41 {

// Compressed main KV: E2M1 nibbles + one E4M3 scale per 16 values (288 B for 512 lanes).
int64_t main_kv_bytes(int64_t dim);
void pack_main_kv_row(const float* x, int64_t dim, uint8_t* row);
void unpack_main_kv_row(const uint8_t* row, int64_t dim, float* x);

// Index keys: E2M1 nibbles + one E8M0 scale per 32 values (68 B for 128 lanes).
int64_t index_key_bytes(int64_t dim);
void pack_index_key_row(const float* x, int64_t dim, uint8_t* row);
void unpack_index_key_row(const uint8_t* row, int64_t dim, float* x);

// Sliding-window KV: E4M3 codes + one E8M0 scale per 32 values (528 B for 512 lanes).
int64_t window_row_bytes(int64_t dim);
void pack_window_row(const float* x, int64_t dim, uint8_t* row);
void unpack_window_row(const uint8_t* row, int64_t dim, float* x);

}  // namespace dsv41
