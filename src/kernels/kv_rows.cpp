// Packing rows of the per-sequence state, scalar reference: the row codecs of numeric/row_codecs.h,
// one row at a time.
#include "kernels/kv_rows.h"
#include "kernels/reference.h"

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
