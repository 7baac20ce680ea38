// Packing rows of the per-sequence state, scalar reference: the row codecs of numeric/row_codecs.h,
// one row at a time; and the table decoder of the rows the kernels read.
#include "kernels/kv_rows.h"

#include <array>

#include "kernels/linear_internal.h"
#include "kernels/reference.h"
#include "numeric/formats.h"

namespace dsv41 {

void decode_kv_row_fast(KvFormat format, const uint8_t* row, int64_t d, float* out) {
  static const std::array<float, 16> e2m1 = [] {
    std::array<float, 16> t{};
    for (int c = 0; c < 16; ++c) t[static_cast<size_t>(c)] = e2m1_to_f32(static_cast<uint8_t>(c));
    return t;
  }();
  const float* e4m3 = detail::e4m3_table();
  const float* e8m0 = detail::e8m0_table();
  switch (format) {
    case KvFormat::Window:  // E4M3 codes, E8M0 per 32
      for (int64_t i = 0; i < d; ++i) out[i] = e4m3[row[i]] * e8m0[row[d + i / 32]];
      return;
    case KvFormat::MainKv:  // E2M1 pairs (low nibble first), E4M3 per 16
      for (int64_t i = 0; i < d; i += 2) {
        const float s = e4m3[row[d / 2 + i / 16]];
        out[i] = e2m1[row[i / 2] & 0xF] * s;
        out[i + 1] = e2m1[row[i / 2] >> 4] * s;
      }
      return;
    case KvFormat::IndexKey:  // E2M1 pairs, E8M0 per 32
      for (int64_t i = 0; i < d; i += 2) {
        const float s = e8m0[row[d / 2 + i / 32]];
        out[i] = e2m1[row[i / 2] & 0xF] * s;
        out[i + 1] = e2m1[row[i / 2] >> 4] * s;
      }
      return;
  }
}

}  // namespace dsv41

namespace dsv41::reference {

void pack_kv_rows(KvFormat format, const float* x, int64_t rows, int64_t dim, uint8_t* const* out) {
  for (int64_t r = 0; r < rows; ++r) {
    switch (format) {
      case KvFormat::Window:
        pack_window_row(x + r * dim, dim, out[r]);
        break;
      case KvFormat::MainKv:
        pack_main_kv_row(x + r * dim, dim, out[r]);
        break;
      case KvFormat::IndexKey:
        pack_index_key_row(x + r * dim, dim, out[r]);
        break;
    }
  }
}

}  // namespace dsv41::reference
