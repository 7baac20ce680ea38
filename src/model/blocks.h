// The one skeleton every forward runs — prefill, batched decode, the DSpark drafter: the embedding
// into hc stream copies, blocks of mHC-wrapped attention and MoE with the single-pass handoff of
// `pre` (model-spec §3.2), and the head. What differs between them is only the state-dependent
// middle of attention (AttentionCore) and what runs around the blocks.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "io/config.h"
#include "io/layer_roles.h"
#include "kernels/backend.h"
#include "model/attention.h"
#include "model/expert_cache.h"
#include "model/expert_peers.h"
#include "model/weights.h"

namespace dsv41 {

// The residual stream of a batch of rows: hc copies of each row, and the `pre` of the last sublayer
// that the next one collapses with.
struct Stream {
  int64_t rows = 0;
  std::vector<float> X;    // [rows, hc, dim]
  std::vector<float> pre;  // [rows, hc]
  std::vector<uint8_t> span;  // [rows]: 1 at an image-span position; empty when there is none
  // Keeps only the rows listed (ascending), in that order.
  void keep(const std::vector<int64_t>& kept, int64_t hc, int64_t dim);
};

// Turns a block's projected rows (all of the stream's rows) into the attention output
// o [rows, n_heads·head_dim], before the output projection.
using AttentionCore = std::function<void(AttentionProjection& projected, float* o)>;

// The embedding of `tokens` repeated into hc copies; the first pre is the identity collapse.
Stream embed_tokens(const Backend& be, const ModelConfig& c, const Bf16Tensor& table, const int32_t* tokens,
                    int64_t count);

// One block over every row of the stream: attention (projections, `core`, output projection), then
// the FFN, each wrapped in the mHC mixes. `replay` leaves the compressor's projections out; `experts`
// serves the routed experts when the memory plan streams them (null: the weights' own); `peers` hold
// the routed experts outside this rank's share in an expert-parallel job (null: none).
void run_block(const Backend& be, const ModelConfig& c, const LayerRole& role, const LayerWeights& L, Stream& x,
               bool replay, const AttentionCore& core, const ExpertCache* experts = nullptr,
               ExpertPeers* peers = nullptr);

// The head over `count` rows from `first`: collapse with the last pre, `norm`, the fp32 projection
// to logits [count, vocab]. The collapsed rows before the norm go to `hidden` when it is given.
void run_head(const Backend& be, const ModelConfig& c, const Stream& x, int64_t first, int64_t count,
              const Bf16Tensor& norm, const Bf16Tensor& head, float* logits, std::vector<float>* hidden = nullptr);

}  // namespace dsv41
