// The model configuration: read from the HF config.json (values nested under "text_config") or the
// flat inference/config.json, whose key names differ (model-spec §1.2). Field names here follow the
// inference file, which is what the reference's ModelArgs reads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "io/vision_config.h"

namespace dsv41 {

struct ModelConfig {
  std::string source;      // the file it was read from
  std::string model_type;  // "deepseek_v41" when the file names it

  // shape
  int64_t vocab_size = 0;
  int64_t dim = 0;
  int64_t moe_inter_dim = 0;
  int n_layers = 0;      // backbone blocks
  int n_mtp_layers = 0;  // DSpark blocks, stored as mtp.{0..n-1}, layer ids n_layers.. in compress_ratios
  int n_heads = 0;
  int64_t head_dim = 0;
  int64_t rope_head_dim = 0;
  int64_t q_lora_rank = 0;
  int64_t o_lora_rank = 0;
  int o_groups = 0;
  double norm_eps = 1e-20;
  double swiglu_limit = 0;
  int64_t max_seq_len = 0;  // the longest context the model supports

  // rope
  double rope_theta = 10000;
  double compress_rope_theta = 10000;
  int64_t original_seq_len = 0;  // YaRN off when 0
  double rope_factor = 1;
  double beta_fast = 32;
  double beta_slow = 1;

  // moe
  int n_routed_experts = 0;
  int n_shared_experts = 1;
  int n_activated_experts = 0;
  std::string score_func = "sqrtsoftplus";
  double route_scale = 1;
  double gate_temp = 1;
  bool norm_topk_prob = true;

  // attention state
  int window_size = 0;
  std::vector<int> compress_ratios;  // n_layers + n_mtp_layers entries
  std::vector<int> kv_source_layers;
  std::vector<int> index_source_layers;
  int index_n_heads = 0;
  int64_t index_head_dim = 0;
  int index_topk = 0;
  int candidate_source_layer = -1;  // < 0: no candidate pre-selection
  int candidate_topk_blocks = 0;
  int candidate_block_size = 0;

  // hyper-connections
  int hc_mult = 4;
  int hc_sinkhorn_iters = 20;
  double hc_eps = 1e-6;

  // engram
  std::vector<int> engram_layer_ids;
  std::vector<int64_t> engram_num_embeddings;
  int engram_max_ngram_size = 0;
  int64_t engram_vocab_size = 0;
  int engram_n_heads = 0;
  int64_t engram_head_dim = 0;
  int64_t engram_pad_id = 2;
  int64_t engram_compressed_vocab_size = 0;

  // dspark
  int dspark_block_size = 0;
  int64_t dspark_noise_token_id = 0;
  std::vector<int> dspark_target_layer_ids;
  int64_t dspark_markov_rank = 0;
  int dspark_n_routed_experts = 0;
  int dspark_n_activated_experts = 0;

  // tokens
  int64_t bos_token_id = 0;
  int64_t eos_token_id = 1;
  int64_t pad_token_id = 2;
  // the vision tower and the image placeholder (disabled in a text-only checkpoint)
  VisionConfig vision;

  // keys of the file the engine did not read (io/config_keys.h): unknown ones, for a warning, and
  // known ones it has no use for; neither enters the fingerprint
  std::vector<std::string> unknown_keys;
  std::vector<std::string> unused_keys;

  // derived helpers
  int total_layers() const { return n_layers + n_mtp_layers; }
  int64_t nope_head_dim() const { return head_dim - rope_head_dim; }
  int engram_hash_columns() const { return (engram_max_ngram_size - 1) * engram_n_heads; }
  bool has_dspark() const { return dspark_block_size > 0 && n_mtp_layers > 0; }
  int routed_experts(int layer) const;
  int activated_experts(int layer) const;
};

// Reads a config from a model folder (its config.json, else inference/config.json) or a file, and
// validates it. Throws Error naming the file and the offending key.
ModelConfig load_config(const std::string& path);
// Same from parsed JSON; `where` names the source in errors.
ModelConfig parse_config(const nlohmann::json& json, const std::string& where);
// Every structural rule the engine relies on (lengths, ranges, source lists, divisibility), and an
// upper bound, a generous multiple of the released value, on each integer that sizes a loop or a
// per-sequence buffer without a tensor's shape to check it (config.cpp lists them).
void validate_config(const ModelConfig& config);
// The config as the flat inference/config.json object (what make-tiny writes beside the HF file).
nlohmann::json config_to_inference_json(const ModelConfig& config);
// The config as the HF config.json object (text_config nested, quantization_config at top level).
nlohmann::json config_to_hf_json(const ModelConfig& config);
// A stable identity of the model geometry (hex digest of the canonical inference JSON).
std::string config_fingerprint(const ModelConfig& config);
// What the prompt cache keys its files on: the config and the checkpoint's contents
// (Checkpoint::fingerprint) together, so that a fine-tune with the released config does not accept
// another model's entries. 16 hex digits.
std::string model_fingerprint(const ModelConfig& config, const std::string& checkpoint_fingerprint);

}  // namespace dsv41
