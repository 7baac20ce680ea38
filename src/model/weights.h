// The model's weights, bound to a memory-mapped checkpoint. Quantized matrices (FP8 dense, FP4
// experts, FP8 Engram tables) stay in the mapping as zero-copy views; the small BF16/F32 tensors are
// copied once into aligned fp32 arrays (the mapping gives no alignment guarantee), and attn.wo_a is
// dequantized to bf16 values as the reference's converter does.
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

namespace dsv41 {

// A BF16 matrix copied into aligned storage (the kernels take uint16 bf16 bits), with the SIMD
// kernels' packed copy when the model packed it.
struct Bf16Tensor {
  std::vector<uint16_t> bits;
  int64_t n = 0, k = 0;
  std::shared_ptr<const PackedWeights> packed;
  Bf16Matrix view() const { return {bits.data(), n, k, packed ? packed->view() : PackedView{}}; }
  // Rows [row0, row0 + count) as a matrix of their own (one group of a block-diagonal projection).
  Bf16Matrix rows(int64_t row0, int64_t count) const {
    const Bf16Matrix all = view();
    return {bits.data() + row0 * k, count, k, all.packed.from_row(row0)};
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

class ModelWeights {
 public:
  // Opens the checkpoint in `dir`, checks every tensor against the config, binds the views and packs
  // the matrices for `backend`'s linear ops (in its memory); the Engram tables are served from
  // `engram_tier` (io/engram_store.h).
  ModelWeights(const std::string& dir, const ModelConfig& config, std::shared_ptr<const Backend> backend,
               EngramTier engram_tier = EngramTier::Mmap);
  const ModelConfig& config() const { return config_; }
  const Checkpoint& checkpoint() const { return *checkpoint_; }

  Bf16Tensor embed, head, norm;
  std::vector<LayerWeights> layers;  // backbone layers then DSpark blocks
  DsparkWeights dspark;

 private:
  // Re-lays every matrix the linear layers read for the backend's kernels (packed_weights.h); the
  // FP8/FP4 views keep pointing into the mapping for the scalar paths.
  void pack_matrices(const Backend& backend);

  ModelConfig config_;
  std::shared_ptr<const Backend> backend_;  // holds the memory of the packed copies: kept as long as they are
  std::unique_ptr<Checkpoint> checkpoint_;
  std::vector<std::unique_ptr<PackedWeights>> packed_;  // behind the FP8/FP4 views' `packed`
};

}  // namespace dsv41
