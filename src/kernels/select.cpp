// Top-k selection (the reference's `topk(k, sorted=False).indices.sort()`, model-spec §3.3).
#include <algorithm>
#include <limits>
#include <cassert>
#include <numeric>

#include "kernels/reference.h"

namespace dsv41::reference {

std::vector<int32_t> topk_ascending(const float* scores, int64_t n, int64_t k) {
  assert(k >= 0 && k <= n);
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  // A strict total order on NaN-free input: higher score first, the lower index among equal scores.
  // torch leaves ties unspecified; this fixes them so that every implementation agrees.
  const auto better = [scores](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  std::nth_element(idx.begin(), idx.begin() + k, idx.end(), better);
  std::sort(idx.begin(), idx.begin() + k);
  // a fresh vector of exactly k: callers keep one per query, so the n-sized scratch must not survive
  return std::vector<int32_t>(idx.begin(), idx.begin() + k);
}

std::vector<int32_t> select_candidate_blocks(const float* scores, int64_t n, int64_t visible, int64_t topk_blocks,
                                             int64_t block_size) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t blocks = (n + block_size - 1) / block_size;
  std::vector<float> block_score(static_cast<size_t>(blocks), kNegInf);
  for (int64_t t = 0; t < n; ++t) block_score[t / block_size] = std::max(block_score[t / block_size], scores[t]);
  // the newest block is only partly filled and could be outscored by older full blocks: pin it
  const int64_t last = visible > 0 ? (visible - 1) / block_size : -1;
  if (last >= 0 && last < blocks) block_score[last] = std::numeric_limits<float>::infinity();
  std::vector<int32_t> top = topk_ascending(block_score.data(), blocks, std::min(topk_blocks, blocks));
  std::vector<int32_t> kept;
  for (int32_t b : top) {
    if (block_score[b] != kNegInf) kept.push_back(b);  // fewer reachable blocks than topk_blocks
  }
  return kept;
}

}  // namespace dsv41::reference
