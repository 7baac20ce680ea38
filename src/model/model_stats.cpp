#include "model/model_stats.h"

#include <algorithm>

#include "io/layer_roles.h"
#include "model/tensor_layout.h"

namespace dsv41 {

ParamCounts count_params(const ModelConfig& c) {
  ParamCounts p;
  const auto roles = derive_layer_roles(c);
  for (const TensorSpec& s : checkpoint_tensors(c)) {
    int64_t bytes = static_cast<int64_t>(dtype_size(s.dtype));
    for (int64_t d : s.shape) bytes *= d;
    p.checkpoint_bytes += bytes;
    const int64_t n = tensor_params(s);
    p.total += n;
    if (n == 0) continue;
    if (s.kind == TensorKind::EngramTable) p.engram += n;
    if (s.layer >= c.n_layers) {
      p.dspark += n;
      continue;
    }
    if (s.layer < 0) {
      if (s.name == "head.weight" || s.name == "norm.weight") p.active_decode += n;
      continue;
    }
    int64_t active = n;
    if (s.name.find(".ffn.experts.") != std::string::npos) {
      active = n * c.activated_experts(s.layer) / c.routed_experts(s.layer);
    } else if (s.kind == TensorKind::EngramTable) {
      active = int64_t{c.engram_hash_columns()} * c.engram_head_dim;  // rows gathered per token
    }
    p.active_decode += active;
    if (roles[s.layer].encoder) p.active_prefill += active;
  }
  for (const auto& extra : {image_routing_biases(c), vision_tensors(c)}) {
    for (const TensorSpec& s : extra) {
      int64_t n = 1;
      for (int64_t d : s.shape) n *= d;
      p.checkpoint_bytes += n * static_cast<int64_t>(dtype_size(s.dtype));
      p.total += n;
      p.vision += n;
    }
  }
  return p;
}

double context_flops(const ModelConfig& c, int64_t n, bool tail) {
  const int late = late_layer_start(c);
  const double index_per_row = 2.0 * static_cast<double>(c.index_n_heads * c.index_head_dim);
  const double attention_per_row = 4.0 * static_cast<double>(c.n_heads * c.head_dim);
  const int64_t pool = c.candidate_topk_blocks * c.candidate_block_size;
  double flops = 0;
  for (const LayerRole& r : derive_layer_roles(c)) {
    if (r.dspark) continue;
    const int64_t first = tail && r.layer >= late ? std::max<int64_t>(0, n - c.window_size) : 0;
    for (int64_t p = first; p < n; ++p) {
      const int64_t visible = r.compress_ratio > 0 ? (p + 1) / r.compress_ratio : 0;  // compressed rows so far
      const int64_t attended = std::min<int64_t>(c.window_size, p + 1) + std::min<int64_t>(c.index_topk, visible);
      flops += attention_per_row * static_cast<double>(attended);
      if (r.index_source) {
        flops += index_per_row * static_cast<double>(r.candidate_user ? std::min(visible, pool) : visible);
      }
    }
  }
  return flops;
}

}  // namespace dsv41
