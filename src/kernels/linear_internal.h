// Internals of the linear-layer and attention kernels: the scalar references, the per-ISA fast
// versions (the tests compare them directly, whatever DSV41_ISA says) and the pieces both share.
//
// Summation order, which every version reproduces bit for bit (model-spec §3.1 fixes only "fp32 in K
// order" between blocks; the order inside a block is the reference's BLAS/MMA detail and unknown):
//  * linear_fp8 / linear_fp4: per output, per 32-block, partial = ((0 + p0) + p1) + … + p31 in k order
//    (each p = a·w is exact in fp32), then acc = acc + (partial·a_s)·w_s over blocks in k order.
//  * linear_bf16 / linear_f32: acc = ((0 + p0) + p1) + … in k order, one chain per output.
// The SIMD versions keep these chains as they are and put different outputs in different vector
// lanes (weights packed in tiles of rows at load time, or transposed on the fly), so no chain is
// split or reassociated.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/kernels.h"

namespace dsv41::detail {

constexpr int64_t kQBlock = 32;  // act_quant group = K block of the quantized GEMMs

// Decoding tables, built once (thread-safe statics).
const float* e4m3_table();  // code -> value, NaN for 0x7F/0xFF
const float* e8m0_table();  // code -> 2^(code-127), NaN for 0xFF

// x act_quant'ed to FP8 row by row: the e4m3 values times `prescale` (a power of two chosen by the
// caller so that its weight decoding stays exact; see the SIMD files) and one scale per 32 along K.
struct QuantizedActivations {
  int64_t m = 0, k = 0;
  std::vector<float> values;  // [m, k]
  std::vector<float> scales;  // [m, k/32]
  const float* row(int64_t i) const { return values.data() + i * k; }
  const float* row_scales(int64_t i) const { return scales.data() + i * (k / kQBlock); }
};
// Rows are quantized in parallel on the kernel thread pool when `parallel`.
QuantizedActivations quantize_activations(const float* x, int64_t m, int64_t k, float prescale, bool parallel);

// The same with the ISA's vector code (the fast linear layers use these; the results are identical).
QuantizedActivations quantize_activations_avx2(const float* x, int64_t m, int64_t k, float prescale);
QuantizedActivations quantize_activations_avx512(const float* x, int64_t m, int64_t k, float prescale);

// One output of a quantized linear layer in the reference order, from decoded weights: w[j] =
// table[code j] (times a power of two that cancels the activations' prescale). `wscale` holds the
// row's k/32 weight scales as e8m0 codes.
float fp8_dot_scalar(const float* a, const float* a_scales, const uint8_t* wrow, const uint8_t* wscale,
                     int64_t k, const float* table);
float fp4_dot_scalar(const float* a, const float* a_scales, const uint8_t* wrow_packed, const uint8_t* wscale,
                     int64_t k, const float* table16);

// The scalar references (single-threaded).
void linear_fp8_scalar(const float* x, int64_t m, const Fp8Matrix& w, float* y);
void linear_fp4_scalar(const float* x, int64_t m, const Fp4Matrix& w, float* y);
void linear_bf16_scalar(const float* x, int64_t m, const Bf16Matrix& w, float* y);
void linear_f32_scalar(const float* x, int64_t m, const Bf16Matrix& w, float* y);

// Fast versions, multithreaded on the kernel pool. Each needs its ISA (isa_supported); on a build
// without x86 SIMD they run the scalar reference.
void linear_fp8_avx2(const float* x, int64_t m, const Fp8Matrix& w, float* y);
void linear_fp4_avx2(const float* x, int64_t m, const Fp4Matrix& w, float* y);
void linear_bf16_avx2(const float* x, int64_t m, const Bf16Matrix& w, float* y);
void linear_f32_avx2(const float* x, int64_t m, const Bf16Matrix& w, float* y);
void linear_fp8_avx512(const float* x, int64_t m, const Fp8Matrix& w, float* y);
void linear_fp4_avx512(const float* x, int64_t m, const Fp4Matrix& w, float* y);
void linear_bf16_avx512(const float* x, int64_t m, const Bf16Matrix& w, float* y);
void linear_f32_avx512(const float* x, int64_t m, const Bf16Matrix& w, float* y);

// sparse_attention: the scalar reference and the fast versions (same bits; heads split over the pool).
void sparse_attention_scalar(const float* q, int64_t heads, int64_t d, const std::vector<const float*>& rows,
                             const float* sink, float scale, float* out);
void sparse_attention_avx2(const float* q, int64_t heads, int64_t d, const std::vector<const float*>& rows,
                           const float* sink, float scale, float* out);
void sparse_attention_avx512(const float* q, int64_t heads, int64_t d, const std::vector<const float*>& rows,
                             const float* sink, float scale, float* out);

}  // namespace dsv41::detail
