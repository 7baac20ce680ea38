// The mHC ops' scalar references (the numerics are in kernels/backend.h).
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cascade_sum.h"
#include "kernels/reference.h"
#include "numeric/formats.h"

namespace dsv41 {

namespace reference {

void mhc_mixes(const HcShape& s, const float* X, int64_t count, const HcMixWeights& w, HcCoefficientsOut out) {
  const int64_t hc = s.hc, n = s.width(), mix = s.mix_count();
  std::vector<float> mixes(static_cast<size_t>(mix));
  for (int64_t i = 0; i < count; ++i) {
    const float* x = X + i * n;
    const float mean = cascade_sum_of_squares(x, n) / static_cast<float>(n);  // torch's order
    const float rsqrt = 1.0f / std::sqrt(mean + s.norm_eps);
    for (int64_t o = 0; o < mix; ++o) {
      const float* f = w.fn + o * n;
      float acc = 0;
      for (int64_t j = 0; j < n; ++j) acc += x[j] * f[j];
      mixes[o] = acc * rsqrt;
    }
    hc_split_sinkhorn(mixes.data(), w.scale, w.base, static_cast<int>(hc), s.sinkhorn_iters, s.hc_eps,
                      out.pre + i * hc, out.post + i * hc, out.comb + i * hc * hc);
  }
}

void mhc_collapse(const HcShape& s, const float* X, const float* pre, int64_t count, float* u) {
  const int64_t hc = s.hc, d = s.dim;
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t j = 0; j < d; ++j) {
      float acc = 0;
      for (int64_t cp = 0; cp < hc; ++cp) acc += pre[i * hc + cp] * X[(i * hc + cp) * d + j];
      u[i * d + j] = round_bf16(acc);
    }
  }
}

void mhc_expand(const HcShape& s, float* X, const float* y, const float* post, const float* comb,
                       int64_t count) {
  const int64_t hc = s.hc, d = s.dim;
  std::vector<float> out(static_cast<size_t>(hc * d));
  for (int64_t i = 0; i < count; ++i) {
    const float* c = comb + i * hc * hc;
    float* x = X + i * hc * d;
    for (int64_t k = 0; k < hc; ++k) {
      for (int64_t j = 0; j < d; ++j) {
        float acc = 0;
        for (int64_t src = 0; src < hc; ++src) acc += c[src * hc + k] * x[src * d + j];
        out[k * d + j] = round_bf16(post[i * hc + k] * y[i * d + j] + acc);
      }
    }
    std::copy(out.begin(), out.end(), x);
  }
}

void mhc_step(const HcShape& s, float* X, const float* y, const HcCoefficients& prev,
                     const HcMixWeights& next, int64_t count, HcCoefficientsOut out, float* u) {
  mhc_expand(s, X, y, prev.post, prev.comb, count);
  mhc_mixes(s, X, count, next, out);
  mhc_collapse(s, X, prev.pre, count, u);
}

}  // namespace reference

}  // namespace dsv41
