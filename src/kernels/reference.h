// The scalar reference of every op (kernels/backend.h lists them with their numerics): plain loops
// in the reference's order of operations, single-threaded. The scalar backend runs these; every
// faster level is tested against them (tests/ops_test.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/op_types.h"

namespace dsv41::reference {

// ---- linear layers: y[m, n] = x[m, k] · Wᵀ --------------------------------------------------------
void linear_fp8(const float* x, int64_t m, const Fp8Matrix& w, float* y);
void linear_fp4(const float* x, int64_t m, const Fp4Matrix& w, float* y);
void linear_bf16(const float* x, int64_t m, const Bf16Matrix& w, float* y);
void linear_f32(const float* x, int64_t m, const Bf16Matrix& w, float* y);

// ---- norms, rotary, quantized rows ----------------------------------------------------------------
void rms_norm(const float* x, int64_t rows, int64_t n, const uint16_t* weight_bf16, float eps, float* y,
              bool round_to_bf16);
void rope(const RopeTable& table, const RotaryRows& rows, bool inverse);
void pack_kv_rows(KvFormat format, const float* x, int64_t rows, int64_t dim, uint8_t* const* out);

// ---- compressed attention -------------------------------------------------------------------------
void compressor_pool(const float* kv, const float* score, int64_t ratio, int64_t dim, float* out);
void quantize_index_queries(float* q, float* weights, int64_t count, int64_t heads, int64_t dim, float head_scale);
void index_scores(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K, const uint8_t* const* keys,
                  int64_t n_keys, const int64_t* visible, float* scores);
void index_scores_in_pool(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                          const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                          const std::vector<int32_t>* pools, int64_t block_size, float* scores);
std::vector<int32_t> topk_ascending(const float* scores, int64_t n, int64_t k,
                                    TopkTies ties = TopkTies::LowerIndexFirst);
std::vector<int32_t> select_candidate_blocks(const float* scores, int64_t n, int64_t visible, int64_t topk_blocks,
                                             int64_t block_size, TopkTies ties = TopkTies::LowerIndexFirst);
void sparse_attention(const float* q, int64_t heads, int64_t d, const KvRows& rows, const float* sink, float scale,
                      float* out);

// ---- mHC ----------------------------------------------------------------------------------------
void hc_split_sinkhorn(const float* mixes, const float* scale3, const float* base, int hc, int iters, float eps,
                       float* pre, float* post, float* comb);
void mhc_mixes(const HcShape& s, const float* X, int64_t count, const HcMixWeights& w, HcCoefficientsOut out);
void mhc_collapse(const HcShape& s, const float* X, const float* pre, int64_t count, float* u);
void mhc_expand(const HcShape& s, float* X, const float* y, const float* post, const float* comb, int64_t count);
void mhc_step(const HcShape& s, float* X, const float* y, const HcCoefficients& prev, const HcMixWeights& next,
              int64_t count, HcCoefficientsOut out, float* u);

// ---- MoE ----------------------------------------------------------------------------------------
void moe_route(const float* logits, int64_t tokens, const RouterParams& p, const float* bias, int32_t* experts,
               float* weights);
MoeDispatch moe_dispatch(const int32_t* experts, const float* weights, int64_t tokens, int64_t k, int64_t n_experts);
void gather_rows(const float* x, int64_t dim, const int64_t* rows, int64_t count, float* out);
void swiglu(float* gate, const float* up, int64_t m, int64_t n, float limit, const float* row_weights);
void moe_combine(const MoeDispatch& d, const float* expert_out, const float* shared, int64_t tokens, int64_t dim,
                 float* out);

// ---- embedding, Engram, the stream --------------------------------------------------------------
void embed(const uint16_t* table, int64_t dim, const int32_t* tokens, int64_t count, int64_t copies, float* X);
void engram_rows(const uint8_t* codes, const uint8_t* scales, int64_t rows, int64_t row_len, float* out);
void engram_gate(float* X, int64_t count, int64_t hc, int64_t dim, const float* kv, const float* qk, float eps);
void stream_mean(const float* X, int64_t count, int64_t hc, int64_t dim, float* out, int64_t out_stride);
void add(float* y, const float* x, int64_t n);

// ---- the vision tower (vision_ops.cpp) ------------------------------------------------------------
void add_bias_bf16(float* y, int64_t m, int64_t n, const float* bias);
void add_bf16(float* y, const float* x, int64_t n);
void rope_rotate_half(const float* cos, const float* sin, int64_t rows, int64_t heads, int64_t head_dim, float* x,
                      int64_t row_stride);
// One query row of dense_attention; `scores` is scratch of n floats.
void dense_attention_query(const float* q, const float* k, const float* v, int64_t n, int64_t heads, int64_t d,
                           int64_t stride, float scale, int64_t query, float* out, float* scores);
void dense_attention(const float* q, const float* k, const float* v, int64_t n, int64_t heads, int64_t d,
                     int64_t stride, float scale, float* out);
void silu_mul_bf16(const float* gate_up, int64_t m, int64_t n, float* out);
void gelu_erf_bf16(float* x, int64_t n);
void unfold_cells(const float* x, int64_t nh, int64_t nw, int64_t dim, int64_t r, float* out);

}  // namespace dsv41::reference
