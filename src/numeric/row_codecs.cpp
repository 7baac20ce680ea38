#include "numeric/row_codecs.h"

#include <vector>

#include "numeric/formats.h"
#include "numeric/quant.h"

namespace dsv41 {

int64_t main_kv_bytes(int64_t d) { return d / 2 + d / 16; }
int64_t index_key_bytes(int64_t d) { return d / 2 + d / 32; }
int64_t window_row_bytes(int64_t d) { return d + d / 32; }

void pack_main_kv_row(const float* x, int64_t d, uint8_t* row) {
  fp4_quant_e4m3(x, static_cast<size_t>(d), row, row + d / 2);
}

void unpack_main_kv_row(const uint8_t* row, int64_t d, float* x) {
  const uint8_t* scales = row + d / 2;
  for (int64_t i = 0; i < d; i += 2) {
    const float s = e4m3_to_f32(scales[i / 16]);
    x[i] = e2m1_to_f32(row[i / 2] & 0xF) * s;  // low nibble = even element
    x[i + 1] = e2m1_to_f32(row[i / 2] >> 4) * s;
  }
}

void pack_index_key_row(const float* x, int64_t d, uint8_t* row) {
  fp4_quant_e8m0(x, static_cast<size_t>(d), row, row + d / 2);
}

void unpack_index_key_row(const uint8_t* row, int64_t d, float* x) {
  const uint8_t* scales = row + d / 2;
  for (int64_t i = 0; i < d; i += 2) {
    const float s = e8m0_to_f32(scales[i / 32]);
    x[i] = e2m1_to_f32(row[i / 2] & 0xF) * s;
    x[i + 1] = e2m1_to_f32(row[i / 2] >> 4) * s;
  }
}

void pack_window_row(const float* x, int64_t d, uint8_t* row) {
  std::vector<float> scales(static_cast<size_t>(d / 32));
  act_quant_fp8(x, static_cast<size_t>(d), row, scales.data());
  for (int64_t b = 0; b < d / 32; ++b) row[d + b] = e8m0_from_pow2(scales[b]);
}

void unpack_window_row(const uint8_t* row, int64_t d, float* x) {
  for (int64_t i = 0; i < d; ++i) x[i] = e4m3_to_f32(row[i]) * e8m0_to_f32(row[d + i / 32]);
}

}  // namespace dsv41
