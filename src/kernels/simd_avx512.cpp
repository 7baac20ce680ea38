// AVX-512 (F/BW/VL/DQ) kernels: linear layers with 16 output rows per vector, and sparse attention.
// The structure is in linear_simd_impl.h and attention_simd_impl.h, the vector operations, weight
// decoders and activation quantizer in simd_avx512_ops.h; this file compiles them for AVX-512.
#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cascade_sum.h"
#include "kernels/kv_rows.h"
#include "kernels/linear_internal.h"
#include "kernels/reference.h"
#include "kernels/torch_math.h"
#include "numeric/formats.h"
#include "numeric/quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

// Everything below is compiled for AVX-512 while the rest of the project stays baseline x86-64; it
// only runs after cpu_features() said so. No fusing of a multiply into a following add: the
// reference rounds the product (linear_f32) and the scaled partial (all quantized kinds).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
                             apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
// GCC 12's AVX-512 intrinsics start some results from a deliberately undefined vector (`__Y = __Y`),
// which -O3 then reports as maybe-uninitialized inside the intrinsic headers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace dsv41::detail::avx512 {

#include "kernels/simd_avx512_ops.h"

#include "kernels/linear_simd_impl.h"
#include "kernels/attention_simd_impl.h"
#include "kernels/dense_attention_simd_impl.h"
#include "kernels/swiglu_simd_impl.h"

}  // namespace dsv41::detail::avx512

namespace dsv41::detail {

void linear_fp8_avx512(const Exec& ex, const float* x, int64_t m, const Fp8Matrix& w, float* y) {
  avx512::run_linear<avx512::Fp8Kind>(ex, x, m, w, y);
}
void linear_fp4_avx512(const Exec& ex, const float* x, int64_t m, const Fp4Matrix& w, float* y) {
  avx512::run_linear<avx512::Fp4Kind>(ex, x, m, w, y);
}
void linear_bf16_avx512(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  avx512::run_linear<avx512::Bf16Kind<false>>(ex, x, m, w, y);
}
void linear_f32_avx512(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  // activations that are all bf16 values (the vision tower's) take linear_bf16's FMA path, unrounded
  if (avx512::all_bf16_values(x, m * w.k)) return avx512::run_linear<avx512::Bf16Kind<false, false>>(ex, x, m, w, y);
  avx512::run_linear<avx512::Bf16Kind<true>>(ex, x, m, w, y);
}
QuantizedActivations quantize_activations_avx512(const float* x, int64_t m, int64_t k, float prescale) {
  return avx512::quantize_rows(nullptr, x, m, k, prescale, false);
}
void sparse_attention_avx512(const Exec& ex, const float* q, int64_t heads, int64_t d, const KvRows& rows,
                          const float* sink, float scale, float* out) {
  avx512::sparse_attention_simd(ex, q, heads, d, rows, sink, scale, out);
}
void dense_attention_avx512(const Exec& ex, const float* q, const float* k, const float* v, int64_t n, int64_t heads,
                          int64_t d, int64_t stride, float scale, float* out) {
  avx512::dense_attention_simd(ex, q, k, v, n, heads, d, stride, scale, out);
}

void swiglu_avx512(const Exec& ex, float* gate, const float* up, int64_t m, int64_t n, float limit,
                 const float* row_weights) {
  avx512::swiglu_simd(ex, gate, up, m, n, limit, row_weights);
}

}  // namespace dsv41::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#else  // not x86: the level is never available; the references stand in so the build links

namespace dsv41::detail {
void linear_fp8_avx512(const Exec&, const float* x, int64_t m, const Fp8Matrix& w, float* y) {
  reference::linear_fp8(x, m, w, y);
}
void linear_fp4_avx512(const Exec&, const float* x, int64_t m, const Fp4Matrix& w, float* y) {
  reference::linear_fp4(x, m, w, y);
}
void linear_bf16_avx512(const Exec&, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  reference::linear_bf16(x, m, w, y);
}
void linear_f32_avx512(const Exec&, const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  reference::linear_f32(x, m, w, y);
}
QuantizedActivations quantize_activations_avx512(const float* x, int64_t m, int64_t k, float prescale) {
  return quantize_activations(x, m, k, prescale);
}
void sparse_attention_avx512(const Exec&, const float* q, int64_t heads, int64_t d, const KvRows& rows,
                          const float* sink, float scale, float* out) {
  reference::sparse_attention(q, heads, d, rows, sink, scale, out);
}
void dense_attention_avx512(const Exec&, const float* q, const float* k, const float* v, int64_t n, int64_t heads,
                          int64_t d, int64_t stride, float scale, float* out) {
  reference::dense_attention(q, k, v, n, heads, d, stride, scale, out);
}
void swiglu_avx512(const Exec&, float* gate, const float* up, int64_t m, int64_t n, float limit,
                 const float* row_weights) {
  reference::swiglu(gate, up, m, n, limit, row_weights);
}
}  // namespace dsv41::detail

#endif
