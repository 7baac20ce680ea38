// The RMSNorm op's reference (model-spec §3.1; the reference's RMSNorm.forward).
#include <cmath>

#include "kernels/reference.h"
#include "numeric/formats.h"

namespace dsv41 {

namespace {

void rms_norm_row(const float* x, int64_t n, const uint16_t* weight_bf16, float eps, float* y, bool round_to_bf16) {
  // mean(x²): squares rounded to fp32 (x.square()), summed in fp32 in index order, divided by n
  // (torch's CPU mean is sum then div). torch sums with a cascade, so this differs from it by a few
  // fp32 ulps of the mean at most, far below the bf16 output resolution.
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float sq = x[i] * x[i];
    sum += sq;
  }
  const float var = sum / static_cast<float>(n);
  // torch.rsqrt on CPU is 1/sqrt, both correctly rounded.
  const float rstd = 1.0f / std::sqrt(var + eps);
  for (int64_t i = 0; i < n; ++i) {
    const float normed = x[i] * rstd;
    const float v = bf16_to_f32(weight_bf16[i]) * normed;  // weight · x, promoted to fp32
    y[i] = round_to_bf16 ? round_bf16(v) : v;
  }
}

}  // namespace

namespace reference {

void rms_norm(const float* x, int64_t rows, int64_t n, const uint16_t* weight_bf16, float eps, float* y,
              bool round_to_bf16) {
  for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * n, n, weight_bf16, eps, y + r * n, round_to_bf16);
}

}  // namespace reference

}  // namespace dsv41
