// The ISA-independent SwiGLU kernel, included by simd_avx2.cpp and simd_avx512.cpp inside their target
// region and namespace (no include guard on purpose). The including file defines `V` with W fp32
// lanes, exp (torch_exp lane by lane), div, round_bf16, min and max (minps / maxps: the second
// operand where either is NaN).
//
// reference::swiglu lane by lane, the same operations in the same order, so the same bits:
//   u = clamp(u, -limit, limit) and g = min(g, limit) when limit > 0 (std::clamp and std::min keep a
//   NaN, as maxps(-limit, u) and minps(limit, g) do), h = g / (1 + exp(-g)) · u, times the row's
//   routing weight when there is one, rounded to bf16. Row tails narrower than W take the scalar form.

inline void swiglu_rows(float* g, const float* u, int64_t i0, int64_t i1, int64_t n, float limit,
                        const float* row_weights) {
  using F = V::F;
  const F one = V::set1(1.0f), hi = V::set1(limit), lo = V::set1(-limit), sign = V::set1(-0.0f);
  for (int64_t i = i0; i < i1; ++i) {
    float* gr = g + i * n;
    const float* ur = u + i * n;
    int64_t j = 0;
    for (; j + V::W <= n; j += V::W) {
      F gv = V::load(gr + j), uv = V::load(ur + j);
      if (limit > 0) {
        uv = V::min(hi, V::max(lo, uv));
        gv = V::min(hi, gv);
      }
      F h = V::mul(V::div(gv, V::add(one, V::exp(V::xor_bits(gv, sign)))), uv);
      if (row_weights != nullptr) h = V::mul(V::set1(row_weights[i]), h);
      V::store(gr + j, V::round_bf16(h));
    }
    if (j < n) reference::swiglu(gr + j, ur + j, 1, n - j, limit, row_weights != nullptr ? row_weights + i : nullptr);
  }
}

// Rows split over exec's workers when the op is large enough to pay for a wake-up.
inline void swiglu_simd(const Exec& ex, float* g, const float* u, int64_t m, int64_t n, float limit,
                        const float* row_weights) {
  ex.run(m * n >= (int64_t{1} << 15), m, 1,
         [&](int64_t i0, int64_t i1, Scratch&) { swiglu_rows(g, u, i0, i1, n, limit, row_weights); });
}
