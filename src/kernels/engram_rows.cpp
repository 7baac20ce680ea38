// The scalar references of the Engram ops: row dequantization and the gate (model-spec §3.6).
#include <algorithm>
#include <cmath>

#include "kernels/reference.h"
#include "numeric/formats.h"
#include "kernels/torch_math.h"

namespace dsv41::reference {

void engram_rows(const uint8_t* codes, const uint8_t* scales, int64_t rows, int64_t row_len, float* out) {
  constexpr int64_t kBlock = 32;  // channels per E8M0 scale
  const int64_t blocks = rows * (row_len / kBlock);
  for (int64_t b = 0; b < blocks; ++b) {
    const float scale = e8m0_to_f32(scales[b]);
    for (int64_t j = b * kBlock; j < (b + 1) * kBlock; ++j) out[j] = round_bf16(e4m3_to_f32(codes[j]) * scale);
  }
}

void engram_gate(float* X, int64_t s, int64_t hc, int64_t d, const float* kv, const float* qk, float eps) {
  const float inv_sqrt_dim = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  for (int64_t i = 0; i < s; ++i) {
    const float* value = &kv[(i * (hc + 1) + hc) * d];
    for (int64_t cp = 0; cp < hc; ++cp) {
      float* h = &X[(i * hc + cp) * d];
      const float* key = &kv[(i * (hc + 1) + cp) * d];
      const float* qkc = &qk[cp * d];
      float hh = 0, kk = 0, dot = 0;
      for (int64_t j = 0; j < d; ++j) {
        hh += h[j] * h[j];
        kk += key[j] * key[j];
        dot += h[j] * qkc[j] * key[j];
      }
      // normalised per copy over dim: the rsqrt product is formed first, then applied
      const float rstd = (1.0f / std::sqrt(hh / static_cast<float>(d) + eps)) *
                         (1.0f / std::sqrt(kk / static_cast<float>(d) + eps));
      dot = dot * rstd * inv_sqrt_dim;
      const float gate = torch_sigmoid(std::copysign(std::sqrt(std::max(std::fabs(dot), 1e-6f)), dot));
      for (int64_t j = 0; j < d; ++j) h[j] = round_bf16(h[j] + gate * value[j]);
    }
  }
}

}  // namespace dsv41::reference
