// The fast indexer scores over packed FP4 index keys (the op and its numerics are in
// kernels/backend.h, the reference in kernels/reference.h). Every level computes the reference's
// chains exactly as written, so all give the same bits (a NaN's sign and payload aside: they depend
// on the operand order of an add, which no level promises).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
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

// A candidate-pool version from a whole-history one: per query, the visible keys of its pool gathered
// into one list and scored by score_one(q, weights, keys, n, scores) (one query, n keys all visible)
// as a history of their own, the scores put back in place; every other key is -inf.
template <class ScoreOne>
void index_scores_in_pools(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                           const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                           const std::vector<int32_t>* pools, int64_t block_size, float* scores, ScoreOne score_one) {
  std::fill(scores, scores + nq * n_keys, -std::numeric_limits<float>::infinity());
  std::vector<const uint8_t*> pool_keys;
  std::vector<int64_t> pool_ids;
  std::vector<float> pool_scores;
  for (int64_t i = 0; i < nq; ++i) {
    pool_keys.clear();
    pool_ids.clear();
    for (int32_t b : pools[i]) {
      for (int64_t t = b * block_size; t < std::min({n_keys, visible[i], (b + 1) * block_size}); ++t) {
        pool_keys.push_back(keys[t]);
        pool_ids.push_back(t);
      }
    }
    const int64_t n = static_cast<int64_t>(pool_keys.size());
    if (n == 0) continue;
    pool_scores.resize(static_cast<size_t>(n));
    score_one(q + i * nh * K, weights + i * nh, pool_keys.data(), n, pool_scores.data());
    for (int64_t j = 0; j < n; ++j) scores[i * n_keys + pool_ids[j]] = pool_scores[j];
  }
}

// Below this many multiply-adds (nq·n_keys·nh·K) a call stays on the calling thread: waking the pool
// costs more than it saves.
constexpr int64_t kIndexScoreParallelWork = int64_t{1} << 20;

}  // namespace dsv41::detail
