// The fast indexer scores over packed FP4 index keys (the op and its numerics are in
// kernels/backend.h, the reference in kernels/reference.h). Every level computes the reference's
// chains exactly as written, so all give the same bits (a NaN's sign and payload aside: they depend
// on the operand order of an add, which no level promises).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/exec.h"

namespace dsv41::detail {

// Each needs its ISA (isa_supported); on a build without x86 SIMD they run the reference. Key tiles
// are split over exec's workers when the work is large.
void index_scores_avx2(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                       const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores);
void index_scores_avx512(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                         const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores);
void index_scores_in_pool_avx2(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh,
                               int64_t K, const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                               const std::vector<int32_t>* pools, int64_t block_size, float* scores);
void index_scores_in_pool_avx512(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh,
                                 int64_t K, const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                                 const std::vector<int32_t>* pools, int64_t block_size, float* scores);

// The AVX-512 level's versions where the CPU has AVX-512 VNNI: each 32-element block's product in
// integers, the same bits (index_score_vnni.cpp says why; queries or keys outside what integers can
// stand for take the fp32 chains above).
void index_scores_avx512_vnni(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh,
                              int64_t K, const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                              float* scores);
void index_scores_in_pool_avx512_vnni(const Exec& ex, const float* q, const float* weights, int64_t nq, int64_t nh,
                                      int64_t K, const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                                      const std::vector<int32_t>* pools, int64_t block_size, float* scores);

// Below this many multiply-adds (nq·n_keys·nh·K) a call stays on the calling thread: waking the pool
// costs more than it saves.
constexpr int64_t kIndexScoreParallelWork = int64_t{1} << 20;

}  // namespace dsv41::detail
