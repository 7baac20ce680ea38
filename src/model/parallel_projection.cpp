#include "model/parallel_projection.h"

#include <cmath>
#include <string>

#include "io/layer_roles.h"
#include "model/tensor_layout.h"
#include "state/state_graph.h"
#include "util/error.h"

namespace dsv41 {

namespace {

// Probability that none of k experts drawn without replacement from E falls in a given set of E/N.
double misses_rank(int64_t experts, int64_t k, int ranks) {
  const int64_t outside = experts - experts / ranks;
  double p = 1;
  for (int64_t i = 0; i < k; ++i) p *= static_cast<double>(outside - i) / static_cast<double>(experts - i);
  return std::max(0.0, p);
}

}  // namespace

ParallelProjection project_parallel(const ModelConfig& c, int ranks, int64_t prompt_tokens) {
  if (ranks < 1) fail("--ranks", "must be at least 1");
  ParallelProjection p;
  p.ranks = ranks;
  p.prompt_tokens = prompt_tokens;
  for (const TensorSpec& t : checkpoint_tensors(c)) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    const uint64_t bytes = static_cast<uint64_t>(n) * dtype_size(t.dtype);
    if (t.name.find(".ffn.experts.") != std::string::npos) {
      p.routed_bytes += bytes;
    } else if (t.name.find(".engram.embed.") != std::string::npos) {
      p.engram_bytes += bytes;
    } else {
      p.dense_bytes += bytes;
    }
  }
  const uint64_t share = (p.routed_bytes + p.engram_bytes + static_cast<uint64_t>(ranks) - 1) / static_cast<uint64_t>(ranks);
  p.rank0_bytes = p.dense_bytes + share;
  p.other_rank_bytes = ranks > 1 ? share : 0;

  const double others = ranks - 1, remote = others / ranks, row = 2.0 * static_cast<double>(c.dim);
  constexpr double kCommand = 4 * sizeof(int64_t);
  double bytes = 0;
  for (const LayerRole& r : derive_layer_roles(c)) {
    if (r.dspark || ranks == 1) continue;
    const int64_t E = c.routed_experts(r.layer), k = c.activated_experts(r.layer);
    const double ranks_hit = others * (1 - misses_rank(E, k, ranks));
    bytes += kCommand * others + 8.0 * static_cast<double>(k) * others  // command, routing to every rank
             + ranks_hit * row                                          // the row to each remote owner
             + static_cast<double>(k) * remote * row;                   // each remote expert's output back
    if (r.engram) {
      const double ids = c.engram_hash_columns() * remote;
      bytes += kCommand * others + sizeof(int) * others +
               ids * (8.0 + static_cast<double>(c.engram_head_dim + c.engram_head_dim / 32));
    }
  }
  p.exchanged_bytes_per_decode_token = bytes;
  const StateGraph g = build_state_graph(c, derive_layer_roles(c));
  p.handover_exact_bytes = static_cast<uint64_t>(std::llround(g.global_bytes_per_token() * static_cast<double>(prompt_tokens))) +
                           static_cast<uint64_t>(g.fixed_bytes_per_sequence());
  const StateClass* window = g.find("window");
  p.handover_replay_bytes = p.handover_exact_bytes - (window ? static_cast<uint64_t>(window->bytes_per_sequence()) : 0);
  return p;
}

}  // namespace dsv41
