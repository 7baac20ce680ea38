#include "io/layer_roles.h"

#include <algorithm>

namespace dsv41 {

const char* role_name(AttnRole role) {
  switch (role) {
    case AttnRole::Swa: return "swa";
    case AttnRole::Full: return "full";
    case AttnRole::Reindex: return "reindex";
    case AttnRole::Reuse: return "reuse";
  }
  return "?";
}

int late_layer_start(const ModelConfig& c) {
  // Past the last KV source a prompt row only matters through the windows of later layers, so those
  // layers can run on the prompt's tail alone. An Engram layer after it would change that (and its
  // n-gram rows would go unfetched for skipped rows), so the tail also starts after the last one.
  int last = -1;
  for (int l : c.kv_source_layers) last = std::max(last, l);
  for (int l : c.engram_layer_ids) last = std::max(last, l);
  return last + 1;
}

std::vector<LayerRole> derive_layer_roles(const ModelConfig& c) {
  auto in = [](const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); };
  const int late = late_layer_start(c);
  std::vector<LayerRole> roles;
  int last_kv = -1, last_index = -1;
  for (int l = 0; l < c.total_layers(); ++l) {
    LayerRole r;
    r.layer = l;
    r.dspark = l >= c.n_layers;
    r.compress_ratio = c.compress_ratios[l];
    r.kv_source = !r.dspark && in(c.kv_source_layers, l);
    r.index_source = !r.dspark && in(c.index_source_layers, l);
    if (r.kv_source) last_kv = l;
    if (r.index_source) last_index = l;
    if (r.compress_ratio == 0) {
      r.role = AttnRole::Swa;
    } else if (r.kv_source) {
      r.role = AttnRole::Full;
    } else if (r.index_source) {
      r.role = AttnRole::Reindex;
    } else {
      r.role = AttnRole::Reuse;
    }
    if (r.compress_ratio > 0) {
      r.kv_from = last_kv;
      r.index_keys_from = r.index_source ? last_kv : -1;
      r.topk_from = last_index;
    }
    r.candidate_source = !r.dspark && l == c.candidate_source_layer;
    r.candidate_user = r.index_source && c.candidate_source_layer >= 0 && l > c.candidate_source_layer;
    if (r.candidate_user) r.candidates_from = c.candidate_source_layer;
    r.engram = !r.dspark && in(c.engram_layer_ids, l);
    r.dspark_tap = !r.dspark && c.has_dspark() && in(c.dspark_target_layer_ids, l);
    r.encoder = !r.dspark && l < late;
    r.rope_theta = r.compress_ratio > 0 ? c.compress_rope_theta : c.rope_theta;
    r.yarn = r.compress_ratio > 0 && c.original_seq_len > 0;
    roles.push_back(r);
  }
  return roles;
}

}  // namespace dsv41
