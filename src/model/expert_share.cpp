#include "model/expert_share.h"

#include <algorithm>
#include <string>

#include "io/layer_roles.h"
#include "util/error.h"

namespace dsv41 {

std::pair<int64_t, int64_t> ExpertShare::experts(int64_t n) const {
  const int64_t part = n / ranks;
  return {rank * part, (rank + 1) * part};
}

int ExpertShare::expert_owner(int64_t e, int64_t n) const { return static_cast<int>(e / (n / ranks)); }

std::pair<int64_t, int64_t> ExpertShare::rows(int64_t n) const {
  const int64_t part = (n + ranks - 1) / ranks;
  return {std::min(n, rank * part), std::min(n, (rank + 1) * part)};
}

int ExpertShare::row_owner(int64_t row, int64_t n) const {
  return static_cast<int>(row / ((n + ranks - 1) / ranks));
}

void check_expert_share(const ModelConfig& c, const ExpertShare& share) {
  if (share.ranks < 1 || share.rank < 0 || share.rank >= share.ranks)
    fail("expert parallel", "rank " + std::to_string(share.rank) + " of " + std::to_string(share.ranks));
  for (const LayerRole& r : derive_layer_roles(c)) {
    if (r.dspark && !c.has_dspark()) continue;
    const int experts = c.routed_experts(r.layer);
    if (experts % share.ranks != 0) {
      fail("expert parallel", std::string(r.dspark ? "dspark_n_routed_experts" : "n_routed_experts") + " = " +
                                  std::to_string(experts) + " does not split into " + std::to_string(share.ranks) +
                                  " equal parts (run with a number of ranks that divides it)");
    }
  }
}

}  // namespace dsv41
