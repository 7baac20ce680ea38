#include "kernels/topk_threshold.h"

#include <algorithm>
#include <cassert>
#include <limits>
#include <numeric>

namespace dsv41 {

std::vector<int32_t> topk_by_threshold(const float* scores, int64_t n, int64_t k) {
  assert(k >= 0 && k <= n);
  if (k == 0) return {};
  const auto better = [scores](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  // A heap of the best k seen so far with the worst of them at the front.
  std::vector<int32_t> heap(static_cast<size_t>(k));
  std::iota(heap.begin(), heap.end(), 0);
  std::make_heap(heap.begin(), heap.end(), better);
  float threshold = scores[heap.front()];
  // Every later index is higher than all kept ones, so it enters only with a strictly higher score
  // than the worst kept: a tie loses. The blocks of 16 let the compiler test them together, and a
  // block with no score above the threshold (the common case once the heap holds good scores) is
  // skipped whole.
  const auto offer = [&](int64_t j) {
    if (!(scores[j] > threshold)) return;
    std::pop_heap(heap.begin(), heap.end(), better);
    heap.back() = static_cast<int32_t>(j);
    std::push_heap(heap.begin(), heap.end(), better);
    threshold = scores[heap.front()];
  };
  int64_t j = k;
  for (; j + 16 <= n; j += 16) {
    bool any = false;
    for (int i = 0; i < 16; ++i) any |= scores[j + i] > threshold;
    if (!any) continue;
    for (int i = 0; i < 16; ++i) offer(j + i);
  }
  for (; j < n; ++j) offer(j);
  std::sort(heap.begin(), heap.end());
  return heap;
}

std::vector<int32_t> candidate_blocks_by_threshold(const float* scores, int64_t n, int64_t visible,
                                                   int64_t topk_blocks, int64_t block_size) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t blocks = (n + block_size - 1) / block_size;
  // each block's best row, as the reference takes it (std::max in row order, so a NaN never enters)
  std::vector<float> block_score(static_cast<size_t>(blocks), kNegInf);
  for (int64_t b = 0; b < blocks; ++b) {
    float best = kNegInf;
    for (int64_t t = b * block_size; t < std::min(n, (b + 1) * block_size); ++t) best = std::max(best, scores[t]);
    block_score[b] = best;
  }
  const int64_t last = visible > 0 ? (visible - 1) / block_size : -1;  // the newest block, pinned
  if (last >= 0 && last < blocks) block_score[last] = std::numeric_limits<float>::infinity();
  std::vector<int32_t> top = topk_by_threshold(block_score.data(), blocks, std::min(topk_blocks, blocks));
  std::erase_if(top, [&](int32_t b) { return block_score[b] == kNegInf; });  // fewer reachable than asked
  return top;
}

}  // namespace dsv41
