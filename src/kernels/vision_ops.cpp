// The references of the vision tower's ops (vision-spec §4–5): the ViT runs in bf16 with fp32 inside
// each op, one rounding to bf16 per op result, as torch does under the bf16 default dtype.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/reference.h"
#include "kernels/torch_math.h"
#include "numeric/formats.h"

namespace dsv41::reference {

void add_bias_bf16(float* y, int64_t m, int64_t n, const float* bias) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) y[i * n + j] = round_bf16(y[i * n + j] + bias[j]);
  }
}

void add_bf16(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = round_bf16(y[i] + x[i]);
}

void rope_rotate_half(const float* cos, const float* sin, int64_t rows, int64_t heads, int64_t head_dim, float* x,
                      int64_t row_stride) {
  const int64_t half = head_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * half;
    const float* s = sin + r * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * row_stride + h * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        // torch: x1·cos − x2·sin and x2·cos + x1·sin, each product and sum rounded to fp32
        const float x1 = v[i], x2 = v[i + half];
        const float a = x1 * c[i], b = x2 * s[i], d = x2 * c[i], e = x1 * s[i];
        v[i] = round_bf16(a - b);
        v[i + half] = round_bf16(d + e);
      }
    }
  }
}

void dense_attention_query(const float* q, const float* k, const float* v, int64_t n, int64_t heads, int64_t d,
                           int64_t stride, float scale, int64_t query, float* out, float* scores) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + query * stride + h * d;
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; ++t) {
      const float* kt = k + t * stride + h * d;
      float dot = 0;
      for (int64_t e = 0; e < d; ++e) dot += qh[e] * kt[e];
      scores[t] = dot * scale;
      mx = std::max(mx, scores[t]);
    }
    float sum = 0;
    for (int64_t t = 0; t < n; ++t) {
      scores[t] = torch_exp(scores[t] - mx);
      sum += scores[t];
    }
    float* o = out + query * heads * d + h * d;
    std::fill(o, o + d, 0.0f);
    for (int64_t t = 0; t < n; ++t) {
      // P stays fp32 in P·V: rounding it to bf16 (as the LM's sparse attention does) moved the
      // tiny-vision ViT 0.6% from the reference; kept fp32 the first image agrees bit for bit
      const float p = scores[t];
      const float* vt = v + t * stride + h * d;
      for (int64_t e = 0; e < d; ++e) o[e] += p * vt[e];
    }
    for (int64_t e = 0; e < d; ++e) o[e] = round_bf16(o[e] / sum);
  }
}

void dense_attention(const float* q, const float* k, const float* v, int64_t n, int64_t heads, int64_t d,
                     int64_t stride, float scale, float* out) {
  std::vector<float> scores(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) dense_attention_query(q, k, v, n, heads, d, stride, scale, i, out, scores.data());
}

void silu_mul_bf16(const float* gate_up, int64_t m, int64_t n, float* out) {
  for (int64_t i = 0; i < m; ++i) {
    const float* g = gate_up + i * 2 * n;
    for (int64_t j = 0; j < n; ++j) out[i * n + j] = round_bf16(round_bf16(torch_silu(g[j])) * g[n + j]);
  }
}

void gelu_erf_bf16(float* x, int64_t n) {
  // torch's exact GELU: x·0.5·(1 + erf(x/√2)) in fp32
  constexpr float kInvSqrt2 = 0.70710678118654752440f;
  for (int64_t i = 0; i < n; ++i) x[i] = round_bf16(x[i] * 0.5f * (1.0f + std::erf(x[i] * kInvSqrt2)));
}

void unfold_cells(const float* x, int64_t nh, int64_t nw, int64_t dim, int64_t r, float* out) {
  const int64_t oh = (nh + r - 1) / r, ow = (nw + r - 1) / r, width = dim * r * r;
  for (int64_t oy = 0; oy < oh; ++oy) {
    for (int64_t ox = 0; ox < ow; ++ox) {
      float* row = out + (oy * ow + ox) * width;
      for (int64_t ky = 0; ky < r; ++ky) {
        for (int64_t kx = 0; kx < r; ++kx) {
          const int64_t y = oy * r + ky, xx = ox * r + kx;
          const bool inside = y < nh && xx < nw;  // outside: the aligner's zero padding (right, bottom)
          for (int64_t c = 0; c < dim; ++c) row[c * r * r + ky * r + kx] = inside ? x[(y * nw + xx) * dim + c] : 0.0f;
        }
      }
    }
  }
}

}  // namespace dsv41::reference
