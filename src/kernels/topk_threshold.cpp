#include "kernels/topk_threshold.h"

#include <algorithm>
#include <bit>
#include <cassert>
#include <functional>
#include <limits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace dsv41 {

namespace {

// True when no score of scores[0, 16) is above t (NaN-free scores). Four compares and one mask on
// x86-64's baseline SSE: the common case once the threshold is good, a whole group skipped.
inline bool none_above(const float* scores, float t) {
#if defined(__SSE2__)
  const __m128 th = _mm_set1_ps(t);
  const __m128 lo = _mm_or_ps(_mm_cmpgt_ps(_mm_loadu_ps(scores), th), _mm_cmpgt_ps(_mm_loadu_ps(scores + 4), th));
  const __m128 hi = _mm_or_ps(_mm_cmpgt_ps(_mm_loadu_ps(scores + 8), th), _mm_cmpgt_ps(_mm_loadu_ps(scores + 12), th));
  return _mm_movemask_ps(_mm_or_ps(lo, hi)) == 0;
#else
  bool any = false;
  for (int i = 0; i < 16; ++i) any |= scores[i] > t;
  return !any;
#endif
}

// (score, index) as one integer that orders as "higher score first, the lower index among equal
// scores": the score's bits made monotonic (-0 counted as +0, as float comparison does), then the
// index inverted.
inline uint64_t rank_key(const float* scores, int64_t j) {
  const uint32_t bits = std::bit_cast<uint32_t>(scores[j] + 0.0f);
  const uint32_t ordered = (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
  return (uint64_t{ordered} << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(j));
}
inline int32_t key_index(uint64_t key) { return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(key)); }

}  // namespace

std::vector<int32_t> topk_by_threshold(const float* scores, int64_t n, int64_t k) {
  assert(k >= 0 && k <= n && n <= std::numeric_limits<int32_t>::max());
  if (k == 0) return {};
  // Candidates: the first k, then every later index whose score is above the threshold, the score of
  // the worst of the best k known at the last cut. Every later index is higher than all candidates,
  // so it can enter the top k only with a strictly higher score than that worst one (a tie loses);
  // an index left out is beaten by k candidates, and so is one a cut drops. A cut keeps the best k
  // (nth_element on rank keys) and raises the threshold; it comes when k more have entered, so the
  // threshold follows the running top k closely (about k·ln(n/k) entries on unordered scores, in
  // cuts of 2k keys) while every score is read once and appending is branch-free.
  const int64_t slack = std::max<int64_t>(k, 64);
  std::vector<uint64_t> cand(static_cast<size_t>(k + slack + 16));
  for (int64_t j = 0; j < k; ++j) cand[static_cast<size_t>(j)] = rank_key(scores, j);
  int64_t count = k;
  const auto cut = [&] {
    std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.begin() + count, std::greater<>());
    count = k;
    return scores[key_index(cand[static_cast<size_t>(k - 1)])];
  };
  float threshold = cut();
  const auto offer = [&](int64_t j) {
    cand[static_cast<size_t>(count)] = rank_key(scores, j);
    count += scores[j] > threshold;
  };
  int64_t j = k;
  for (; j + 16 <= n; j += 16) {
    if (none_above(scores + j, threshold)) continue;
    for (int i = 0; i < 16; ++i) offer(j + i);
    if (count >= k + slack) threshold = cut();
  }
  for (; j < n; ++j) offer(j);
  if (count > k) cut();
  std::vector<int32_t> top(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) top[static_cast<size_t>(i)] = key_index(cand[static_cast<size_t>(i)]);
  std::sort(top.begin(), top.end());
  return top;
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
