// Internals of the linear-layer and attention kernels: the per-level fast versions and the pieces
// they share with the scalar references (kernels/reference.h).
//
// The fast versions keep the references' summation chains (kernels/backend.h) as they are and put
// different outputs in different vector lanes (weights packed in tiles of rows at load time, or
// transposed on the fly), so no chain is split or reassociated.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/exec.h"
#include "kernels/op_types.h"

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
QuantizedActivations quantize_activations(const float* x, int64_t m, int64_t k, float prescale);

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

// Fast versions, split over exec's workers. Each needs its ISA (isa_supported); on a build without
// x86 SIMD they run the scalar reference.
void linear_fp8_avx2(const Exec& ex, const float* x, int64_t m, const Fp8Matrix& w, float* y);
void linear_fp4_avx2(const Exec& ex, const float* x, int64_t m, const Fp4Matrix& w, float* y);
void linear_bf16_avx2(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y);
void linear_f32_avx2(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y);
void linear_fp8_avx512(const Exec& ex, const float* x, int64_t m, const Fp8Matrix& w, float* y);
void linear_fp4_avx512(const Exec& ex, const float* x, int64_t m, const Fp4Matrix& w, float* y);
void linear_bf16_avx512(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y);
void linear_f32_avx512(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y);
// The AVX-512-BF16 level's FP8 and FP4 layers (simd_avx512_bf16.cpp): vdpbf16ps for more than a few
// rows, the AVX-512 GEMV below that; the same bits.
void linear_fp8_avx512_bf16(const Exec& ex, const float* x, int64_t m, const Fp8Matrix& w, float* y);
void linear_fp4_avx512_bf16(const Exec& ex, const float* x, int64_t m, const Fp4Matrix& w, float* y);
void linear_bf16_avx512_bf16(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y);
void linear_f32_avx512_bf16(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y);
// The same, with the GEMV of packed tiles on vdpbf16ps too (weights turned into pairs by VBMI's byte
// permutes); only where the CPU has AVX-512 VBMI. The same bits.
void linear_fp8_avx512_bf16_vbmi(const Exec& ex, const float* x, int64_t m, const Fp8Matrix& w, float* y);
void linear_fp4_avx512_bf16_vbmi(const Exec& ex, const float* x, int64_t m, const Fp4Matrix& w, float* y);
// The AMX-BF16 level's FP8, FP4 and BF16 layers (simd_amx.cpp): every row count on the tile unit,
// with that level's own numerics (declared there).
void linear_fp8_amx(const Exec& ex, const float* x, int64_t m, const Fp8Matrix& w, float* y);
void linear_fp4_amx(const Exec& ex, const float* x, int64_t m, const Fp4Matrix& w, float* y);
void linear_bf16_amx(const Exec& ex, const float* x, int64_t m, const Bf16Matrix& w, float* y);
// Whether this CPU's vdpbf16ps rounds as those kernels need (each of a lane's two products added in
// turn, the upper one first); only to be asked where the CPU has AVX-512-BF16.
bool bf16_dot_rounds_in_order();
// vdpbf16ps's FLOP rate over the fp32 FMA's, timed in register-only loops (a few milliseconds); the
// same proviso.
double bf16_dot_over_fma_rate();

// swiglu (reference::swiglu's bits): rows split over exec's workers.
void swiglu_avx2(const Exec& ex, float* gate, const float* up, int64_t m, int64_t n, float limit,
                 const float* row_weights);
void swiglu_avx512(const Exec& ex, float* gate, const float* up, int64_t m, int64_t n, float limit,
                   const float* row_weights);

// sparse_attention: heads split over exec's workers.
void sparse_attention_avx2(const Exec& ex, const float* q, int64_t heads, int64_t d, const KvRows& rows,
                           const float* sink, float scale, float* out);
void sparse_attention_avx512(const Exec& ex, const float* q, int64_t heads, int64_t d, const KvRows& rows,
                             const float* sink, float scale, float* out);
// The AVX-512-BF16 level's: q·k on vdpbf16ps where the query and rows are bf16 values in its range.
void sparse_attention_avx512_bf16(const Exec& ex, const float* q, int64_t heads, int64_t d, const KvRows& rows,
                                  const float* sink, float scale, float* out);

// dense_attention (the ViT's): blocks of queries × heads split over exec's workers.
void dense_attention_avx2(const Exec& ex, const float* q, const float* k, const float* v, int64_t n, int64_t heads,
                          int64_t d, int64_t stride, float scale, float* out);
void dense_attention_avx512_bf16(const Exec& ex, const float* q, const float* k, const float* v, int64_t n,
                                 int64_t heads, int64_t d, int64_t stride, float scale, float* out);
void dense_attention_avx512(const Exec& ex, const float* q, const float* k, const float* v, int64_t n, int64_t heads,
                            int64_t d, int64_t stride, float scale, float* out);

}  // namespace dsv41::detail
