#include "model/synthetic_checkpoint.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "model/checkpoint_writer.h"
#include "io/engram_layout.h"
#include "model/tensor_layout.h"
#include "text/engram_token_map.h"
#include "text/tiny_tokenizer.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace dsv41 {

using nlohmann::json;

namespace {

// A small, fully specified generator (splitmix64 seeding + xoshiro256**), so that a seed gives the
// same checkpoint on every platform; std:: distributions are implementation-defined.
class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (auto& s : s_) {
      seed += 0x9E3779B97F4A7C15ull;
      uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      s = z ^ (z >> 31);
    }
  }
  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  float uniform() { return static_cast<float>(next() >> 40) * 0x1.0p-24f; }  // [0, 1)
  // Approximately normal: the sum of four uniforms, centred and scaled to unit variance.
  float normal() { return (uniform() + uniform() + uniform() + uniform() - 2.0f) * 1.7320508f; }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

uint64_t name_seed(const std::string& name, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ seed;  // FNV-1a over the name, mixed with the seed
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

bool ends_with(const std::string& s, const char* suffix) {
  size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// Mean and spread of each kind of tensor, chosen so activations stay O(1) through the stack: sublayer
// inputs are scaled down by their norm weights, projections keep variance, routers and mixes are O(1).
struct Init {
  float mean = 0, std = 0;
};
Init init_for(const TensorSpec& s, const ModelConfig& c) {
  const std::string& n = s.name;
  const float k = s.logical_in > 0 ? static_cast<float>(s.logical_in)
                                   : static_cast<float>(s.shape.size() > 1 ? s.shape[1] : 1);
  if (n == "embed.weight" || ends_with(n, "markov_head.embed.weight")) return {0, 0.12f};
  if (ends_with(n, "attn_norm.weight") || ends_with(n, "ffn_norm.weight")) return {0.1f, 0.01f};
  if (ends_with(n, "norm.weight")) return {1.0f, 0.1f};  // final, q/kv, compressor, main, k norms
  if (ends_with(n, "hc_attn_base") || ends_with(n, "hc_ffn_base")) return {0, 0.5f};
  if (ends_with(n, "hc_attn_scale") || ends_with(n, "hc_ffn_scale")) return {-0.65f, 0.2f};
  if (ends_with(n, "attn_sink")) return {-0.2f, 0.7f};
  if (ends_with(n, "gate.bias") || ends_with(n, "gate.bias_vl")) return {0.5f, 0.3f};
  // The vision tower: its norms near one, biases small, the span vectors like embedding rows.
  if (ends_with(n, "norm1.weight") || ends_with(n, "norm2.weight")) return {1.0f, 0.1f};
  if (ends_with(n, ".bias")) return {0, 0.02f};
  if (n == "image_start" || n == "image_end" || n == "image_newline") return {0, 0.12f};
  if (ends_with(n, "gate.weight")) return {0, 3.0f / std::sqrt(static_cast<float>(c.dim))};
  if (s.kind == TensorKind::EngramTable) return {0, 0.5f};
  return {0, 1.0f / std::sqrt(k)};  // projections: unit gain
}

std::vector<float> random_values(const TensorSpec& s, const ModelConfig& c, uint64_t seed, int64_t count) {
  Rng rng(name_seed(s.name, seed));
  Init init = init_for(s, c);
  std::vector<float> v(static_cast<size_t>(count));
  for (float& x : v) x = init.mean + init.std * rng.normal();
  return v;
}

ModelConfig base_config(int64_t vocab, int64_t dim, int64_t inter, int n_heads, int64_t head_dim,
                        int64_t rope_dim, int64_t q_lora, int o_groups, int64_t o_lora, int window) {
  ModelConfig c;
  c.model_type = "deepseek_v41";
  c.vocab_size = vocab;
  c.dim = dim;
  c.moe_inter_dim = inter;
  c.n_heads = n_heads;
  c.head_dim = head_dim;
  c.rope_head_dim = rope_dim;
  c.q_lora_rank = q_lora;
  c.o_groups = o_groups;
  c.o_lora_rank = o_lora;
  c.window_size = window;
  c.norm_eps = 1e-20;
  c.swiglu_limit = 10.0;
  c.rope_theta = 10000;
  c.compress_rope_theta = 160000;
  c.beta_fast = 32;
  c.beta_slow = 1;
  c.score_func = "sqrtsoftplus";
  c.route_scale = 1.5;
  c.hc_mult = 4;
  c.hc_sinkhorn_iters = 20;
  c.hc_eps = 1e-6;
  c.engram_max_ngram_size = 4;
  c.engram_pad_id = 2;
  c.dspark_noise_token_id = 0;  // set from the tokenizer below
  return c;
}

}  // namespace

const std::vector<std::string>& synthetic_presets() {
  static const std::vector<std::string> presets = {"tiny", "small", "bench", "long"};
  return presets;
}

namespace {

// The preset's geometry and layer plan; the tokenizer-derived values are filled in by the caller.
ModelConfig preset_geometry(const std::string& preset) {
  ModelConfig c;
  if (preset == "tiny" || preset == "small" || preset == "long") {
    const bool tiny = preset != "small";
    c = tiny ? base_config(1024, 128, 64, 4, 64, 16, 64, 2, 32, 16)
             : base_config(4096, 512, 256, 8, 128, 32, 256, 4, 128, 32);
    // Layer plan: 0-1 SWA only; 2 Full r=2 (+ Reuse 3); 4 a second Full r=2 (+ Reuse 5);
    // 6 Full r=1 and candidate source (+ Reuse 7); 8, 10 Reindex (+ Reuse 9, 11); then DSpark.
    c.n_layers = 12;
    c.n_mtp_layers = 2;
    c.compress_ratios = {0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0};
    c.kv_source_layers = {2, 4, 6};
    c.index_source_layers = {2, 4, 6, 8, 10};
    c.candidate_source_layer = 6;
    c.original_seq_len = 256;
    c.rope_factor = 16;
    c.max_seq_len = 4096;
    c.n_routed_experts = tiny ? 8 : 16;
    c.n_activated_experts = tiny ? 2 : 4;
    c.index_n_heads = tiny ? 2 : 4;
    c.index_head_dim = tiny ? 32 : 64;
    c.index_topk = tiny ? 8 : 32;
    c.candidate_topk_blocks = 4;
    c.candidate_block_size = tiny ? 4 : 8;
    c.engram_layer_ids = {1, 4};
    c.engram_vocab_size = tiny ? 1000 : 10000;
    c.engram_n_heads = tiny ? 2 : 4;
    c.engram_head_dim = tiny ? 32 : 64;
    c.dspark_block_size = tiny ? 4 : 5;
    c.dspark_target_layer_ids = {9, 10, 11};
    c.dspark_markov_rank = tiny ? 32 : 64;
    c.dspark_n_routed_experts = tiny ? 4 : 8;
    c.dspark_n_activated_experts = 2;
    if (preset == "long") {
      // Agent-scale contexts on tiny widths: the released 128-token window and 1M positions, with
      // top-k and the candidate pool scaled so that selection is sparse from a few thousand tokens on
      // (a ratio-1 source has 2048 rows at 2K tokens; the pool keeps 256 blocks of 8, top-k 64).
      c.window_size = 128;
      c.original_seq_len = 65536;
      c.max_seq_len = 1048576;
      c.index_topk = 64;
      c.candidate_topk_blocks = 256;
      c.candidate_block_size = 8;
    }
  } else if (preset == "bench") {
    // Released per-layer widths; 8 backbone layers keeping each role, 16 experts (top-6 as released).
    c = base_config(32768, 5120, 2304, 64, 512, 64, 1280, 8, 1024, 128);
    c.n_layers = 8;
    c.n_mtp_layers = 1;
    c.compress_ratios = {0, 0, 2, 2, 1, 1, 1, 1, 0};
    c.kv_source_layers = {2, 4};
    c.index_source_layers = {2, 4, 6};
    c.candidate_source_layer = 4;
    c.original_seq_len = 65536;
    c.rope_factor = 16;
    c.max_seq_len = 1048576;
    c.n_routed_experts = 16;
    c.n_activated_experts = 6;
    c.index_n_heads = 32;
    c.index_head_dim = 128;
    c.index_topk = 512;
    c.candidate_topk_blocks = 2048;
    c.candidate_block_size = 8;
    c.engram_layer_ids = {1, 3};
    c.engram_vocab_size = 100000;
    c.engram_n_heads = 8;
    c.engram_head_dim = 256;
    c.dspark_block_size = 5;
    c.dspark_target_layer_ids = {5, 6, 7};
    c.dspark_markov_rank = 256;
    c.dspark_n_routed_experts = 8;
    c.dspark_n_activated_experts = 3;
  } else {
    fail("--preset", "unknown preset \"" + preset + "\" (expected tiny, small, bench or long)");
  }
  c.source = "preset " + preset;
  return c;
}

}  // namespace

ModelConfig synthetic_config(const std::string& preset) {
  return synthetic_config(preset, build_tiny_tokenizer(preset_geometry(preset).vocab_size));
}

ModelConfig synthetic_config(const std::string& preset, const json& tokenizer) {
  return complete_synthetic_config(preset_geometry(preset), tokenizer);
}

ModelConfig complete_synthetic_config(ModelConfig c, const json& tokenizer) {
  const Tokenizer tok = Tokenizer::from_json(tokenizer, "tokenizer");
  c.vocab_size = tok.vocab_size();
  const auto noise = tok.token_id("<｜System｜>");  // DSpark's noise token, as in the release (128799)
  if (!noise) fail("tokenizer", "has no <｜System｜> token, which DSpark drafts with");
  c.dspark_noise_token_id = *noise;
  // The ids of the sequence markers are the tokenizer's (0, 1, 2 in the ones this project writes).
  const auto special = [&](const char* token, int64_t& id) {
    const auto found = tok.token_id(token);
    if (!found) fail("tokenizer", std::string("has no ") + token + " token");
    id = *found;
  };
  special("<｜begin▁of▁sentence｜>", c.bos_token_id);
  special("<｜end▁of▁sentence｜>", c.eos_token_id);
  c.engram_compressed_vocab_size = build_engram_token_map(tokenizer, c.vocab_size).size;
  c.engram_num_embeddings.clear();
  for (const auto& layer : engram_layout(c.engram_layer_ids, c.engram_max_ngram_size, c.engram_vocab_size,
                                         c.engram_n_heads, c.engram_compressed_vocab_size)) {
    c.engram_num_embeddings.push_back(layer.rows);
  }
  validate_config(c);
  return c;
}

ModelConfig with_synthetic_vision(ModelConfig c, const json& tokenizer) {
  const Tokenizer tok = Tokenizer::from_json(tokenizer, "tokenizer");
  const auto image = tok.token_id("<｜deepseek_image｜>");
  if (!image) fail("tokenizer", "has no <｜deepseek_image｜> token, which images are placed with");
  VisionConfig& v = c.vision;
  if (c.dim >= 1024) {
    // The released tower (config.json's vision_config): 32 layers of 1024, 16 heads, MLP 2816.
    v.n_layers = 32;
    v.dim = 1024;
    v.n_heads = 16;
    v.inter_dim = 2816;
    v.max_image_tokens = 1024;
    v.min_pixels = 544 * 544;
  } else {
    // The golden tiny-vision tower's geometry: 2 layers of 64, 4 heads, MLP 176.
    v.n_layers = 2;
    v.dim = 64;
    v.n_heads = 4;
    v.inter_dim = 176;
    v.max_image_tokens = 48;
    v.min_pixels = 126 * 126;
  }
  v.patch_size = 14;
  v.rope_theta = 10000;
  v.downsample_ratio = 3;
  v.image_token_id = *image;
  validate_config(c);
  return c;
}

void write_synthetic_checkpoint(const std::string& dir, const std::string& preset, uint64_t seed) {
  write_synthetic_checkpoint(dir, preset, seed, build_tiny_tokenizer(synthetic_config(preset).vocab_size));
}

void write_synthetic_checkpoint(const std::string& dir, const std::string& preset, uint64_t seed,
                                const json& tokenizer) {
  write_synthetic_checkpoint(dir, synthetic_config(preset, tokenizer), seed, tokenizer, synthetic_shard_bytes(preset));
}

uint64_t synthetic_shard_bytes(const std::string& preset) {
  // Shards small enough that even the tiny model has several, as the release does.
  return preset == "tiny" || preset == "long" ? (1u << 20) : preset == "small" ? (64u << 20) : (2ull << 30);
}

void write_synthetic_checkpoint(const std::string& dir, const ModelConfig& c, uint64_t seed, const json& tokenizer,
                                uint64_t shard_bytes) {
  write_checkpoint(dir, c, tokenizer, shard_bytes, [&](const TensorSpec& s, int64_t count) {
    return random_values(s, c, seed, count);
  });
}

}  // namespace dsv41
