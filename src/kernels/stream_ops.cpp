// The scalar references of the ops on the residual stream's rows: the embedding gather, the mean
// over the copies (the drafter's taps) and a row add.
#include "kernels/reference.h"
#include "numeric/formats.h"

namespace dsv41::reference {

void embed(const uint16_t* table, int64_t d, const int32_t* tokens, int64_t count, int64_t copies, float* X) {
  for (int64_t i = 0; i < count; ++i) {
    const uint16_t* e = table + static_cast<int64_t>(tokens[i]) * d;
    for (int64_t cp = 0; cp < copies; ++cp)
      for (int64_t j = 0; j < d; ++j) X[(i * copies + cp) * d + j] = bf16_to_f32(e[j]);
  }
}

void stream_mean(const float* X, int64_t count, int64_t hc, int64_t d, float* out, int64_t out_stride) {
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < d; ++j) {
      float acc = 0;
      for (int64_t cp = 0; cp < hc; ++cp) acc += X[(i * hc + cp) * d + j];
      out[i * out_stride + j] = round_bf16(acc / static_cast<float>(hc));
    }
}

void add(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace dsv41::reference
