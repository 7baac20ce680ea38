// The scalar references of the indexer's ops: its queries' quantization and the scores over packed
// FP4 keys, over the whole history or one candidate pool (the fast versions are in
// index_score_avx2.cpp and index_score_avx512.cpp).
#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/reference.h"
#include "numeric/formats.h"
#include "numeric/quant.h"
#include "numeric/row_codecs.h"

// The reference rounds each product before adding it; a build with FMA available must not fuse them.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace dsv41 {

namespace reference {

void index_scores(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                         const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> key(static_cast<size_t>(K));
  for (int64_t t = 0; t < n_keys; ++t) {
    unpack_index_key_row(keys[t], K, key.data());
    for (int64_t i = 0; i < nq; ++i) {
      if (t >= visible[i]) {
        scores[i * n_keys + t] = neg_inf;
        continue;
      }
      float sum = 0;  // bf16 ops, fp32 accumulation: dot -> bf16, relu, × weight -> bf16, head sum -> bf16
      for (int64_t h = 0; h < nh; ++h) {
        const float* qh = q + (i * nh + h) * K;
        float dot = 0;
        for (int64_t e = 0; e < K; ++e) dot += qh[e] * key[e];
        dot = std::max(round_bf16(dot), 0.0f);
        sum += round_bf16(dot * weights[i * nh + h]);
      }
      scores[i * n_keys + t] = round_bf16(sum);
    }
  }
}

void index_scores_in_pool(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                          const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                          const std::vector<int32_t>* pools, int64_t block_size, float* scores) {
  std::fill(scores, scores + nq * n_keys, -std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < nq; ++i) {
    for (int32_t b : pools[i]) {
      const int64_t t0 = b * block_size, t1 = std::min(n_keys, (b + 1) * block_size);
      if (t0 >= t1) continue;
      // one query against the block's keys: the same chains as index_scores
      std::vector<float> block(static_cast<size_t>(t1 - t0));
      const int64_t seen = std::clamp<int64_t>(visible[i] - t0, 0, t1 - t0);
      index_scores(q + i * nh * K, weights + i * nh, 1, nh, K, keys + t0, t1 - t0, &seen, block.data());
      std::copy(block.begin(), block.end(), scores + i * n_keys + t0);
    }
  }
}

void quantize_index_queries(float* q, float* weights, int64_t count, int64_t heads, int64_t dim, float head_scale) {
  for (int64_t i = 0; i < count; ++i) {
    fp4_qdq_e8m0(&q[i * heads * dim], static_cast<size_t>(heads * dim));
    for (int64_t h = 0; h < heads; ++h) weights[i * heads + h] = round_bf16(weights[i * heads + h] * head_scale);
  }
}

}  // namespace reference

}  // namespace dsv41
