// Top-k selection (the reference's `topk(k, sorted=False).indices.sort()`, model-spec §3.3).
#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <numeric>

#include "kernels/reference.h"

namespace dsv41::reference {

namespace {

// A strict total order on NaN-free input: higher score first, the lower index among equal scores.
void lower_index_first(const float* scores, int64_t k, std::vector<int32_t>& idx) {
  const auto better = [scores](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  std::nth_element(idx.begin(), idx.begin() + k, idx.end(), better);
}

// torch's CPU kernel (ATen's topk_impl_loop, largest=True): higher score first, NaN above
// everything, and among equal scores whatever the algorithm leaves, which is the standard library's.
// With k·64 <= n a min-heap of k entries: make_heap over the first k, then each later entry that
// beats the heap's least pops it and is pushed; otherwise nth_element over all n at position k-1.
// Both run on the indices in order, as torch's (value, index) pairs, with the comparator on the
// scores alone, so every comparison and swap is the same. This equals torch's choices where both use
// libstdc++ (tests/select_test.cpp checks it against this machine's torch).
void torch_order(const float* scores, int64_t n, int64_t k, std::vector<int32_t>& idx) {
  const auto higher = [scores](int32_t a, int32_t b) {
    const bool a_nan = std::isnan(scores[a]), b_nan = std::isnan(scores[b]);
    return (a_nan && !b_nan) || scores[a] > scores[b];
  };
  if (k * 64 > n) {
    std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.end(), higher);
    return;
  }
  const auto heap_end = idx.begin() + k;
  std::make_heap(idx.begin(), heap_end, higher);
  for (int64_t j = k; j < n; ++j) {
    const int32_t candidate = static_cast<int32_t>(j);
    if (higher(candidate, idx.front())) {
      std::pop_heap(idx.begin(), heap_end, higher);
      *(heap_end - 1) = candidate;
      std::push_heap(idx.begin(), heap_end, higher);
    }
  }
}

}  // namespace

std::vector<int32_t> topk_ascending(const float* scores, int64_t n, int64_t k, TopkTies ties) {
  assert(k >= 0 && k <= n);
  if (k == 0) return {};
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  if (ties == TopkTies::Torch) {
    torch_order(scores, n, k, idx);
  } else {
    lower_index_first(scores, k, idx);
  }
  std::sort(idx.begin(), idx.begin() + k);
  // a fresh vector of exactly k: callers keep one per query, so the n-sized scratch must not survive
  return std::vector<int32_t>(idx.begin(), idx.begin() + k);
}

std::vector<int32_t> select_candidate_blocks(const float* scores, int64_t n, int64_t visible, int64_t topk_blocks,
                                             int64_t block_size, TopkTies ties) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t blocks = (n + block_size - 1) / block_size;
  std::vector<float> block_score(static_cast<size_t>(blocks), kNegInf);
  for (int64_t t = 0; t < n; ++t) block_score[t / block_size] = std::max(block_score[t / block_size], scores[t]);
  // the newest block is only partly filled and could be outscored by older full blocks: pin it
  const int64_t last = visible > 0 ? (visible - 1) / block_size : -1;
  if (last >= 0 && last < blocks) block_score[last] = std::numeric_limits<float>::infinity();
  std::vector<int32_t> top = topk_ascending(block_score.data(), blocks, std::min(topk_blocks, blocks), ties);
  std::vector<int32_t> kept;
  for (int32_t b : top) {
    if (block_score[b] != kNegInf) kept.push_back(b);  // fewer reachable blocks than topk_blocks
  }
  return kept;
}

}  // namespace dsv41::reference
