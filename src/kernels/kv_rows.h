// Reading the packed K=V rows an attention query walks (op_types.h KvRows): which row entry j is and
// its values, decoded exactly as numeric/row_codecs.h unpacks them.
#pragma once

#include <cstdint>

#include "kernels/op_types.h"
#include "numeric/row_codecs.h"

namespace dsv41 {

// Entry j of the list (null for an empty slot) and its format.
inline const uint8_t* kv_row(const KvRows& rows, int64_t j) {
  return j < rows.n_window ? rows.window[j] : rows.compressed[j - rows.n_window];
}
inline KvFormat kv_row_format(const KvRows& rows, int64_t j) {
  return j < rows.n_window ? KvFormat::Window : KvFormat::MainKv;
}

inline void decode_kv_row(KvFormat format, const uint8_t* row, int64_t dim, float* out) {
  switch (format) {
    case KvFormat::Window:
      return unpack_window_row(row, dim, out);
    case KvFormat::MainKv:
      return unpack_main_kv_row(row, dim, out);
    case KvFormat::IndexKey:
      return unpack_index_key_row(row, dim, out);
  }
}

// The same values through decoding tables (the kernels' hot loops use it; tests compare it with the
// codecs').
void decode_kv_row_fast(KvFormat format, const uint8_t* row, int64_t dim, float* out);

}  // namespace dsv41
