// The model's weights, bound to a memory-mapped checkpoint. Quantized matrices (FP8 dense, FP4
// experts, FP8 Engram tables) and BF16 tensors stay in the mapping as zero-copy views (a BF16 tensor
// at an odd address is copied, the one alignment its kernels need); the F32 tensors are copied into
// fp32 arrays, and attn.wo_a is dequantized to bf16 values as the reference's converter does. Which
// matrices are packed for the kernels is the memory plan's choice (model/memory_plan.h).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "io/config.h"
#include "io/engram_store.h"
#include "io/safetensors.h"
#include "kernels/backend.h"
#include "model/expert_share.h"

namespace dsv41 {

// A BF16 tensor (the kernels take uint16 bf16 bits): a view into the mapping, or values of its own
// (converted at load, or copied from an odd address), with the SIMD kernels' packed copy when the
// plan packed it. Move-only: `values` may point into `owned`.
struct Bf16Tensor {
  Bf16Tensor() = default;
  Bf16Tensor(Bf16Tensor&&) = default;
  Bf16Tensor& operator=(Bf16Tensor&&) = default;
  Bf16Tensor(const Bf16Tensor&) = delete;
  Bf16Tensor& operator=(const Bf16Tensor&) = delete;

  std::vector<uint16_t> owned;
  // n·k bf16 values: owned.data() or the mapping; null for a packed matrix whose converted values
  // the loader freed (the kernels read it from `packed` alone).
  const uint16_t* values = nullptr;
  int64_t n = 0, k = 0;
  std::shared_ptr<const PackedWeights> packed;
  const uint16_t* data() const { return values; }
  bool empty() const { return n == 0; }
  Bf16Matrix view() const { return {values, n, k, packed ? packed->view() : PackedView{}}; }
  // Rows [row0, row0 + count) as a matrix of their own (one group of a block-diagonal projection).
  Bf16Matrix rows(int64_t row0, int64_t count) const {
    const Bf16Matrix all = view();
    return {values ? values + row0 * k : nullptr, count, k, all.packed.from_row(row0)};
  }
};

struct AttentionWeights {
  std::vector<float> attn_sink;  // [n_heads]
  Fp8Matrix wq_a, wq_b, wkv, wo_b;
  Bf16Tensor q_norm, kv_norm;
  Bf16Tensor wo_a;  // [o_groups·o_lora_rank, n_heads·head_dim/o_groups], dequantized to bf16
  // KV sources: the compressor and the index-key projection
  Bf16Tensor comp_wkv, comp_wgate, comp_norm, idx_wk, idx_k_norm;
  // index sources: the indexer's query and head weights
  Fp8Matrix idx_wq_b;
  Bf16Tensor idx_weights_proj;
};

struct MoeWeights {
  Bf16Tensor gate;
  std::vector<float> gate_bias;
  // The selection bias of image-span tokens (vision-spec §6.3); empty in a text-only checkpoint.
  std::vector<float> gate_bias_vl;
  ExpertMatrices<Fp8Matrix> shared;
  std::vector<ExpertMatrices<Fp4Matrix>> experts;
};

struct EngramWeights {
  std::shared_ptr<EngramStore> table;  // F8_E4M3 [rows, head_dim] rows + E8M0 [rows, head_dim/32] scales
  Fp8Matrix wkv;
  std::vector<float> qk;  // q_weight·k_weight in fp32, [hc, dim] (only the product is used)
};

struct LayerWeights {
  std::vector<float> hc_attn_fn, hc_ffn_fn, hc_attn_base, hc_ffn_base, hc_attn_scale, hc_ffn_scale;
  Bf16Tensor attn_norm, ffn_norm;
  AttentionWeights attn;
  MoeWeights ffn;
  std::optional<EngramWeights> engram;
};

struct DsparkWeights {  // the extras of the first and last DSpark stages
  Fp8Matrix main_proj;
  Bf16Tensor main_norm, norm, markov_embed, markov_head, confidence;
};

// Which matrices the loader packs for the backend's kernels (MemoryPlan::pack_dense / pack_experts);
// the others are read in the checkpoint's layout through the mapping, with the same results.
struct WeightPlacement {
  bool pack_dense = true;    // FP8 attention and shared experts, Engram wkv, the BF16 linears
  bool pack_experts = true;  // the FP4 routed experts
  // An expert-parallel rank's share (model/expert_share.h): only its routed experts are bound (the
  // others stay empty and their pages unread) and its Engram stores serve only its rows.
  ExpertShare share = {};
  // false: the routed experts and Engram tables alone, for a rank that runs no dense layer (the
  // ranks other than the leading one; parallel/expert_follower.h).
  bool dense = true;
};

struct VisionWeights;  // model/vision_weights.h

class ModelWeights {
 public:
  // Opens the checkpoint in `dir`, checks every tensor against the config, binds the views and packs
  // the matrices `placement` names for `backend`'s linear ops (in its memory); the Engram tables are
  // served from `engram_tier` (io/engram_store.h).
  ModelWeights(const std::string& dir, const ModelConfig& config, std::shared_ptr<const Backend> backend,
               EngramTier engram_tier = EngramTier::Mmap, WeightPlacement placement = {});
  ~ModelWeights();
  const ModelConfig& config() const { return config_; }
  const Checkpoint& checkpoint() const { return *checkpoint_; }
  // Anonymous memory the weights took at load: packed copies and copied or converted tensors (what
  // the memory plan's weights_anon_bytes predicts; the Engram ram tier's copy is its store's).
  uint64_t anon_bytes() const { return anon_bytes_; }

  Bf16Tensor embed, head, norm;
  std::vector<LayerWeights> layers;  // backbone layers then DSpark blocks
  DsparkWeights dspark;
  // The vision tower, when the config has one and the checkpoint carries it (a text-only conversion
  // of the release may leave it out: images are then refused); null otherwise.
  std::unique_ptr<VisionWeights> vision;

 private:
  // Re-lays every matrix the linear layers read for the backend's kernels (packed_weights.h); the
  // FP8/FP4 views keep pointing into the mapping for the scalar paths.
  void pack_matrices(const Backend& backend, WeightPlacement placement);

  ModelConfig config_;
  std::shared_ptr<const Backend> backend_;  // holds the memory of the packed copies: kept as long as they are
  std::unique_ptr<Checkpoint> checkpoint_;
  std::vector<std::unique_ptr<PackedWeights>> packed_;  // behind the FP8/FP4 views' `packed`
  uint64_t anon_bytes_ = 0;
};

}  // namespace dsv41
