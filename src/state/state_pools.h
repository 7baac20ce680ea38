// The page pools of the global state classes: for every KV source, one pool for its compressed main-KV
// rows and one for its index-key rows. A page covers kTokensPerPage tokens of the sequence (so
// 64/ratio rows), which keeps every owner's pages aligned with the prefix cache's token blocks: a
// cached block is exactly one page of each owner.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "io/config.h"
#include "io/layer_roles.h"
#include "state/page_pool.h"

namespace dsv41 {

constexpr int64_t kTokensPerPage = 64;

class StatePools {
 public:
  // max_bytes: the budget over all pools (0 = unlimited); split across owners by their bytes per token.
  // Pages come from `allocator` (the backend's), which must outlive the pools.
  StatePools(const ModelConfig& config, const std::vector<LayerRole>& roles, Allocator& allocator,
             uint64_t max_bytes = 0);
  PagePool& main_kv(int layer) { return *main_[static_cast<size_t>(layer)]; }
  PagePool& index_keys(int layer) { return *keys_[static_cast<size_t>(layer)]; }
  int64_t rows_per_page(int layer) const { return kTokensPerPage / ratio_[static_cast<size_t>(layer)]; }
  size_t pages_in_use() const;
  uint64_t bytes_in_use() const;

 private:
  std::vector<std::unique_ptr<PagePool>> main_, keys_;  // indexed by layer; null for non-sources
  std::vector<int> ratio_;
};

}  // namespace dsv41
