#include "model/tensor_layout.h"

#include "io/layer_roles.h"

namespace dsv41 {

namespace {

class Builder {
 public:
  explicit Builder(std::vector<TensorSpec>& out) : out_(out) {}
  int layer = -1;

  void fp8(const std::string& name, int64_t n, int64_t k) {
    out_.push_back({name + ".weight", DType::F8_E4M3, {n, k}, TensorKind::Fp8Weight, k, layer});
    out_.push_back({name + ".scale", DType::F8_E8M0, {(n + 31) / 32, (k + 31) / 32}, TensorKind::Scale, 0, layer});
  }
  void fp4(const std::string& name, int64_t n, int64_t k) {
    out_.push_back({name + ".weight", DType::I8, {n, k / 2}, TensorKind::Fp4Weight, k, layer});
    out_.push_back({name + ".scale", DType::F8_E8M0, {n, k / 32}, TensorKind::Scale, 0, layer});
  }
  void engram_table(const std::string& name, int64_t rows, int64_t dim) {
    out_.push_back({name + ".weight", DType::F8_E4M3, {rows, dim}, TensorKind::EngramTable, dim, layer});
    out_.push_back({name + ".scale", DType::F8_E8M0, {rows, dim / 32}, TensorKind::Scale, 0, layer});
  }
  void bf16(const std::string& name, std::vector<int64_t> shape) {
    out_.push_back({name, DType::BF16, std::move(shape), TensorKind::Bf16, 0, layer});
  }
  void f32(const std::string& name, std::vector<int64_t> shape) {
    out_.push_back({name, DType::F32, std::move(shape), TensorKind::F32, 0, layer});
  }

 private:
  std::vector<TensorSpec>& out_;
};

void add_block(Builder& b, const ModelConfig& c, const LayerRole& r, const std::string& p) {
  const int64_t d = c.dim, hc = c.hc_mult, mix = (2 + hc) * hc;
  b.f32(p + "hc_attn_fn", {mix, hc * d});
  b.f32(p + "hc_ffn_fn", {mix, hc * d});
  b.f32(p + "hc_attn_base", {mix});
  b.f32(p + "hc_ffn_base", {mix});
  b.f32(p + "hc_attn_scale", {3});
  b.f32(p + "hc_ffn_scale", {3});
  b.bf16(p + "attn_norm.weight", {d});
  b.bf16(p + "ffn_norm.weight", {d});

  const std::string a = p + "attn.";
  b.f32(a + "attn_sink", {c.n_heads});
  b.fp8(a + "wq_a", c.q_lora_rank, d);
  b.bf16(a + "q_norm.weight", {c.q_lora_rank});
  b.fp8(a + "wq_b", c.n_heads * c.head_dim, c.q_lora_rank);
  b.fp8(a + "wkv", c.head_dim, d);
  b.bf16(a + "kv_norm.weight", {c.head_dim});
  // wo_a is FP8 on disk although the model runs it in bf16 (the reference's convert.py dequantizes it).
  b.fp8(a + "wo_a", c.o_groups * c.o_lora_rank, c.n_heads * c.head_dim / c.o_groups);
  b.fp8(a + "wo_b", d, c.o_groups * c.o_lora_rank);
  if (r.kv_source) {
    b.bf16(a + "compressor.wkv.weight", {c.head_dim, d});
    if (r.compress_ratio > 1) b.bf16(a + "compressor.wgate.weight", {c.head_dim, d});
    b.bf16(a + "compressor.norm.weight", {c.head_dim});
    b.bf16(a + "indexer.wk.weight", {c.index_head_dim, c.head_dim});
    b.bf16(a + "indexer.k_norm.weight", {c.index_head_dim});
  }
  if (r.index_source) {
    b.fp8(a + "indexer.wq_b", int64_t{c.index_n_heads} * c.index_head_dim, c.q_lora_rank);
    b.bf16(a + "indexer.weights_proj.weight", {c.index_n_heads, d});
  }

  if (r.engram) {
    int slot = 0;
    for (size_t i = 0; i < c.engram_layer_ids.size(); ++i) {
      if (c.engram_layer_ids[i] == r.layer) slot = static_cast<int>(i);
    }
    const std::string e = p + "engram.";
    b.engram_table(e + "embed", c.engram_num_embeddings[slot], c.engram_head_dim);
    b.fp8(e + "wkv", d * (hc + 1), c.engram_hash_columns() * c.engram_head_dim);
    b.bf16(e + "q_weight", {hc, d});
    b.bf16(e + "k_weight", {hc, d});
  }

  const std::string f = p + "ffn.";
  const int experts = c.routed_experts(r.layer);
  b.bf16(f + "gate.weight", {experts, d});
  b.f32(f + "gate.bias", {experts});
  b.fp8(f + "shared_experts.w1", c.moe_inter_dim, d);
  b.fp8(f + "shared_experts.w2", d, c.moe_inter_dim);
  b.fp8(f + "shared_experts.w3", c.moe_inter_dim, d);
  for (int e = 0; e < experts; ++e) {
    const std::string x = f + "experts." + std::to_string(e) + ".";
    b.fp4(x + "w1", c.moe_inter_dim, d);
    b.fp4(x + "w2", d, c.moe_inter_dim);
    b.fp4(x + "w3", c.moe_inter_dim, d);
  }
}

}  // namespace

std::vector<TensorSpec> checkpoint_tensors(const ModelConfig& c) {
  std::vector<TensorSpec> out;
  Builder b(out);
  b.bf16("embed.weight", {c.vocab_size, c.dim});
  b.bf16("head.weight", {c.vocab_size, c.dim});
  b.bf16("norm.weight", {c.dim});
  auto roles = derive_layer_roles(c);
  for (const LayerRole& r : roles) {
    b.layer = r.layer;
    if (!r.dspark) {
      add_block(b, c, r, "layers." + std::to_string(r.layer) + ".");
      continue;
    }
    if (!c.has_dspark()) continue;
    const int stage = r.layer - c.n_layers;
    const std::string p = "mtp." + std::to_string(stage) + ".";
    add_block(b, c, r, p);
    if (stage == 0) {
      b.fp8(p + "main_proj", c.dim, c.dim * static_cast<int64_t>(c.dspark_target_layer_ids.size()));
      b.bf16(p + "main_norm.weight", {c.dim});
    }
    if (stage == c.n_mtp_layers - 1) {
      b.bf16(p + "norm.weight", {c.dim});
      b.bf16(p + "markov_head.embed.weight", {c.vocab_size, c.dspark_markov_rank});
      b.bf16(p + "markov_head.head.weight", {c.vocab_size, c.dspark_markov_rank});
      b.bf16(p + "confidence_head.proj.weight", {1, c.dim + c.dspark_markov_rank});
    }
  }
  return out;
}

int64_t tensor_params(const TensorSpec& s) {
  if (s.kind == TensorKind::Scale) return 0;
  int64_t n = 1;
  for (int64_t d : s.shape) n *= d;
  return s.kind == TensorKind::Fp4Weight ? n * 2 : n;
}

std::vector<TensorSpec> vision_tensors(const ModelConfig& c) {
  std::vector<TensorSpec> out;
  if (!c.vision.enabled()) return out;
  const auto bf16 = [&](const std::string& name, std::vector<int64_t> shape) {
    out.push_back({name, DType::BF16, std::move(shape), TensorKind::Bf16, 0, -1});
  };
  const VisionConfig& v = c.vision;
  const int64_t h = v.dim, inter = v.inter_dim, r = v.downsample_ratio;
  bf16("vision.patch_embed.proj.weight", {h, v.patch_values()});
  bf16("vision.patch_embed.proj.bias", {h});
  for (int i = 0; i < v.n_layers; ++i) {
    const std::string b = "vision.blocks." + std::to_string(i) + ".";
    bf16(b + "norm1.weight", {h});
    bf16(b + "norm2.weight", {h});
    bf16(b + "attn.wqkv.weight", {3 * h, h});
    bf16(b + "attn.wqkv.bias", {3 * h});
    bf16(b + "attn.wo.weight", {h, h});
    bf16(b + "attn.wo.bias", {h});
    bf16(b + "mlp.w1.weight", {2 * inter, h});  // gate rows, then up rows
    bf16(b + "mlp.w2.weight", {h, inter});
  }
  bf16("vision.norm.weight", {h});
  bf16("aligner.w1.weight", {c.dim, h * r * r});
  bf16("aligner.w1.bias", {c.dim});
  bf16("aligner.w2.weight", {c.dim, c.dim});
  bf16("aligner.w2.bias", {c.dim});
  for (const char* span : {"image_start", "image_end", "image_newline"}) bf16(span, {c.dim});
  return out;
}

std::vector<TensorSpec> image_routing_biases(const ModelConfig& c) {
  std::vector<TensorSpec> out;
  if (!c.vision.enabled()) return out;
  for (int l = 0; l < c.total_layers(); ++l) {
    const std::string p = l < c.n_layers ? "layers." + std::to_string(l) : "mtp." + std::to_string(l - c.n_layers);
    out.push_back({p + ".ffn.gate.bias_vl", DType::F32, {c.routed_experts(l)}, TensorKind::F32, 0, l});
  }
  return out;
}

bool is_optional_tensor(const std::string& name) {
  auto starts = [&](const char* p) { return name.rfind(p, 0) == 0; };
  auto ends = [&](const char* sfx) {
    std::string s(sfx);
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return starts("vision.") || starts("aligner.") || name == "image_start" || name == "image_end" ||
         name == "image_newline" || ends(".ffn.gate.bias_vl");
}

}  // namespace dsv41
