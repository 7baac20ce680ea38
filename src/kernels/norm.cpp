// The RMSNorm op's reference (model-spec §3.1; the reference's RMSNorm.forward).
#include <cmath>

#include "kernels/cascade_sum.h"
#include "kernels/reference.h"
#include "numeric/formats.h"

namespace dsv41 {

namespace {

void rms_norm_row(const float* x, int64_t n, const uint16_t* weight_bf16, float eps, float* y, bool round_to_bf16) {
  // mean(x²) as torch computes x.square().mean(-1): the squares rounded to fp32, summed in ATen's
  // cascade (cascade_sum.h), then one division by n.
  const float var = reference::cascade_sum_of_squares(x, n) / static_cast<float>(n);
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
