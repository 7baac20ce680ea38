#include "model/mhc.h"

#include <cmath>

#include "kernels/kernels.h"
#include "numeric/formats.h"

namespace dsv41 {

Mixes hc_mixes(const ModelConfig& c, const float* X, int64_t count, const std::vector<float>& fn,
               const std::vector<float>& scale, const std::vector<float>& base) {
  const int64_t hc = c.hc_mult, n = hc * c.dim, mix = (2 + hc) * hc;
  Mixes m;
  m.pre.resize(static_cast<size_t>(count * hc));
  m.post.resize(static_cast<size_t>(count * hc));
  m.comb.resize(static_cast<size_t>(count * hc * hc));
  std::vector<float> mixes(static_cast<size_t>(mix));
  for (int64_t i = 0; i < count; ++i) {
    const float* x = X + i * n;
    float sq = 0;
    for (int64_t j = 0; j < n; ++j) sq += x[j] * x[j];
    const float rsqrt = 1.0f / std::sqrt(sq / static_cast<float>(n) + static_cast<float>(c.norm_eps));
    for (int64_t o = 0; o < mix; ++o) {
      const float* f = &fn[o * n];
      float acc = 0;
      for (int64_t j = 0; j < n; ++j) acc += x[j] * f[j];
      mixes[o] = acc * rsqrt;
    }
    hc_split_sinkhorn(mixes.data(), scale.data(), base.data(), c.hc_mult, c.hc_sinkhorn_iters,
                      static_cast<float>(c.hc_eps), &m.pre[i * hc], &m.post[i * hc], &m.comb[i * hc * hc]);
  }
  return m;
}

void hc_pre(const ModelConfig& c, const float* X, const float* pre, int64_t count, float* y) {
  const int64_t hc = c.hc_mult, d = c.dim;
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t j = 0; j < d; ++j) {
      float acc = 0;
      for (int64_t cp = 0; cp < hc; ++cp) acc += pre[i * hc + cp] * X[(i * hc + cp) * d + j];
      y[i * d + j] = round_bf16(acc);
    }
  }
}

void hc_post(const ModelConfig& c, float* X, const float* y, const Mixes& m, int64_t count) {
  const int64_t hc = c.hc_mult, d = c.dim;
  std::vector<float> out(static_cast<size_t>(hc * d));
  for (int64_t i = 0; i < count; ++i) {
    const float* comb = &m.comb[i * hc * hc];
    float* x = X + i * hc * d;
    for (int64_t k = 0; k < hc; ++k) {
      for (int64_t j = 0; j < d; ++j) {
        float acc = 0;
        for (int64_t src = 0; src < hc; ++src) acc += comb[src * hc + k] * x[src * d + j];
        out[k * d + j] = round_bf16(m.post[i * hc + k] * y[i * d + j] + acc);
      }
    }
    std::copy(out.begin(), out.end(), x);
  }
}

}  // namespace dsv41
