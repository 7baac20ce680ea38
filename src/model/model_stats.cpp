#include "model/model_stats.h"

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
  return p;
}

}  // namespace dsv41
