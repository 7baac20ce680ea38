#include "state/state_pools.h"

#include <algorithm>
#include <string>

#include "numeric/row_codecs.h"
#include "util/error.h"

namespace dsv41 {

StatePools::StatePools(const ModelConfig& c, const std::vector<LayerRole>& roles, Allocator& allocator,
                       uint64_t max_bytes) {
  main_.resize(roles.size());
  keys_.resize(roles.size());
  ratio_.assign(roles.size(), 1);
  double bytes_per_token = 0;
  for (const LayerRole& r : roles) {
    if (r.kv_source) bytes_per_token += static_cast<double>(main_kv_bytes(c.head_dim) + index_key_bytes(c.index_head_dim)) / r.compress_ratio;
  }
  // every owner gets the same number of tokens' worth of pages
  const uint64_t max_tokens = max_bytes > 0 ? static_cast<uint64_t>(static_cast<double>(max_bytes) / bytes_per_token) : 0;
  const size_t max_pages = max_bytes > 0 ? std::max<size_t>(1, max_tokens / kTokensPerPage) : 0;
  for (const LayerRole& r : roles) {
    if (!r.kv_source) continue;
    if (kTokensPerPage % r.compress_ratio != 0) {
      fail("config", "compress ratio " + std::to_string(r.compress_ratio) + " does not divide the page of " +
                         std::to_string(kTokensPerPage) + " tokens");
    }
    const size_t rows = static_cast<size_t>(kTokensPerPage / r.compress_ratio);
    const std::string l = std::to_string(r.layer);
    ratio_[r.layer] = r.compress_ratio;
    main_[r.layer] = std::make_unique<PagePool>(allocator, "main_kv of layer " + l,
                                                rows * static_cast<size_t>(main_kv_bytes(c.head_dim)), max_pages);
    keys_[r.layer] = std::make_unique<PagePool>(allocator, "index_keys of layer " + l,
                                                rows * static_cast<size_t>(index_key_bytes(c.index_head_dim)), max_pages);
  }
}

size_t StatePools::pages_in_use() const {
  size_t n = 0;
  for (const auto& p : main_) if (p) n += p->pages_in_use();
  for (const auto& p : keys_) if (p) n += p->pages_in_use();
  return n;
}

uint64_t StatePools::bytes_in_use() const {
  uint64_t n = 0;
  for (const auto& p : main_) if (p) n += p->bytes_in_use();
  for (const auto& p : keys_) if (p) n += p->bytes_in_use();
  return n;
}

}  // namespace dsv41
