// What one rank of an expert-parallel job holds of the weights that are split rather than replicated
// (`mpirun -np N dsv41 ... --expert-parallel`): a contiguous range of each MoE layer's routed experts
// and of each Engram table's rows. Rank r of N holds the r-th of N equal parts of the experts (the
// reference's split: n_routed_experts must divide by N, as there) and the r-th ceil(rows/N) rows of a
// table (the release's table sizes are not multiples of every N; the last rank holds fewer rows).
#pragma once

#include <cstdint>
#include <utility>

#include "io/config.h"

namespace dsv41 {

struct ExpertShare {
  int rank = 0, ranks = 1;

  bool whole() const { return ranks == 1; }
  // [first, end) of `experts` routed experts, and the rank holding expert `e`.
  std::pair<int64_t, int64_t> experts(int64_t experts) const;
  int expert_owner(int64_t e, int64_t experts) const;
  // [first, end) of a table of `rows` rows, and the rank holding row `row`.
  std::pair<int64_t, int64_t> rows(int64_t rows) const;
  int row_owner(int64_t row, int64_t rows) const;
};

// Error naming the config key when a MoE layer's routed experts do not split into `share.ranks` equal
// parts, or the share itself is out of range.
void check_expert_share(const ModelConfig& config, const ExpertShare& share);

}  // namespace dsv41
