// The scalar reference of the indexer scores, and the dispatch to the fast versions
// (index_score_avx2.cpp, index_score_avx512.cpp).
#include "kernels/index_score.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/cpu_features.h"
#include "numeric/formats.h"
#include "numeric/row_codecs.h"

// The reference rounds each product before adding it; a build with FMA available must not fuse them.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace dsv41 {

namespace detail {

void index_scores_scalar(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
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

}  // namespace detail

void index_scores(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                  const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores) {
  switch (active_isa()) {
    case Isa::avx512:
      return detail::index_scores_avx512(q, weights, nq, nh, K, keys, n_keys, visible, scores);
    case Isa::avx2:
      return detail::index_scores_avx2(q, weights, nq, nh, K, keys, n_keys, visible, scores);
    case Isa::scalar:
      break;
  }
  detail::index_scores_scalar(q, weights, nq, nh, K, keys, n_keys, visible, scores);
}

}  // namespace dsv41
