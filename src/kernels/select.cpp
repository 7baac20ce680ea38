// Top-k selection (the reference's `topk(k, sorted=False).indices.sort()`, model-spec §3.3).
#include <algorithm>
#include <cassert>
#include <numeric>

#include "kernels/kernels.h"

namespace dsv41 {

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
  idx.resize(static_cast<size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace dsv41
