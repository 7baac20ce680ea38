// Hyper-connection mixing coefficients for one token (model-spec §3.1 "hc_split_sinkhorn"; the
// port's hc_split_sinkhorn, K41:406-458). Everything is fp32 in the port's operation order; sums
// over 4 entries run in index order.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/reference.h"
#include "kernels/torch_math.h"

namespace dsv41 {

namespace {

// comb[j][k] /= (Σ_k comb[j][k] + eps): normalise each row (the port's sum over dim -1).
void divide_rows(float* comb, int hc, float eps) {
  for (int j = 0; j < hc; ++j) {
    float s = 0.0f;
    for (int k = 0; k < hc; ++k) s += comb[j * hc + k];
    const float denom = s + eps;
    for (int k = 0; k < hc; ++k) comb[j * hc + k] /= denom;
  }
}

// comb[j][k] /= (Σ_j comb[j][k] + eps): normalise each column (the port's sum over dim -2). All
// column sums are taken before any division, as the tensor op does. denom: hc floats of scratch.
void divide_columns(float* comb, int hc, float eps, float* denom) {
  for (int k = 0; k < hc; ++k) {
    float s = 0.0f;
    for (int j = 0; j < hc; ++j) s += comb[j * hc + k];
    denom[k] = s + eps;
  }
  for (int j = 0; j < hc; ++j) {
    for (int k = 0; k < hc; ++k) comb[j * hc + k] /= denom[k];
  }
}

}  // namespace

namespace reference {

void hc_split_sinkhorn(const float* mixes, const float* scale3, const float* base, int hc, int iters,
                       float eps, float* pre, float* post, float* comb) {
  std::vector<float> denom(static_cast<size_t>(std::max(hc, 0)));
  for (int c = 0; c < hc; ++c) {
    // Products and sums as separate statements: the port rounds each (no fused multiply-add).
    const float pre_scaled = mixes[c] * scale3[0];
    pre[c] = torch_sigmoid(pre_scaled + base[c]) + eps;
    const float post_scaled = mixes[hc + c] * scale3[1];
    post[c] = 2.0f * torch_sigmoid(post_scaled + base[hc + c]);
  }
  // comb = softmax over the last dim (row-wise), written out as the port does: exp(x - rowmax)
  // (torch's exp, torch_math.h), then divided by the row sum, plus eps.
  for (int j = 0; j < hc; ++j) {
    float* row = comb + j * hc;
    for (int k = 0; k < hc; ++k) {
      const float scaled = mixes[2 * hc + j * hc + k] * scale3[2];
      row[k] = scaled + base[2 * hc + j * hc + k];
    }
    const float row_max = *std::max_element(row, row + hc);
    float s = 0.0f;
    for (int k = 0; k < hc; ++k) {
      row[k] = torch_exp(row[k] - row_max);
      s += row[k];
    }
    for (int k = 0; k < hc; ++k) row[k] = row[k] / s + eps;
  }
  divide_columns(comb, hc, eps, denom.data());
  // `for _ in range(iters - 1)`: no extra rounds when iters <= 1.
  for (int it = 1; it < iters; ++it) {
    divide_rows(comb, hc, eps);
    divide_columns(comb, hc, eps, denom.data());
  }
}

}  // namespace reference

}  // namespace dsv41
