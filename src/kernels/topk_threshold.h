// Top-k under the strict lower-index-first order by one pass with a running threshold.
#pragma once

#include <cstdint>
#include <vector>

namespace dsv41 {

// The indices of the k best of `scores` (NaN-free) under "higher score first, the lower index among
// equal scores", ascending. The order is total, so the set is unique and this equals
// reference::topk_ascending(..., TopkTies::LowerIndexFirst) exactly; the work is one pass over n
// scores, groups of 16 below a running threshold skipped whole, the others appended to a candidate
// list that is cut back to the best k whenever it grows by a few thousand: linear in n whatever the
// scores' order (ascending scores, where every one enters the running top k, included).
std::vector<int32_t> topk_by_threshold(const float* scores, int64_t n, int64_t k);

// reference::select_candidate_blocks(..., TopkTies::LowerIndexFirst) with its block-level top-k by
// topk_by_threshold: the same blocks (the order is total, so the set is unique), without sorting
// an index per block of the whole history for every query.
std::vector<int32_t> candidate_blocks_by_threshold(const float* scores, int64_t n, int64_t visible,
                                                   int64_t topk_blocks, int64_t block_size);

}  // namespace dsv41
