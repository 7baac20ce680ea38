#include "model/released_layout.h"

#include <filesystem>

#include <nlohmann/json.hpp>

#include "io/safetensors_writer.h"
#include "util/error.h"

namespace dsv41 {

namespace {

int64_t vision_key(const nlohmann::json& hf, const char* key) {
  const auto v = hf.find("vision_config");
  if (v == hf.end() || !v->is_object()) fail("vision_config", "missing from the config (the released one has it)");
  const auto it = v->find(key);
  if (it == v->end() || !it->is_number_integer() || it->get<int64_t>() <= 0) {
    fail(std::string("vision_config.") + key, "must be a positive integer");
  }
  return it->get<int64_t>();
}

uint64_t spec_bytes(const TensorSpec& s) {
  uint64_t n = dtype_size(s.dtype);
  for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
  return n;
}

}  // namespace

std::vector<TensorSpec> released_tensors(const ModelConfig& c, const nlohmann::json& hf) {
  std::vector<TensorSpec> out = checkpoint_tensors(c);
  const auto bf16 = [&](const std::string& name, std::vector<int64_t> shape) {
    out.push_back({name, DType::BF16, std::move(shape), TensorKind::Bf16, 0, -1});
  };
  for (int l = 0; l < c.total_layers(); ++l) {
    const std::string p = l < c.n_layers ? "layers." + std::to_string(l) : "mtp." + std::to_string(l - c.n_layers);
    out.push_back({p + ".ffn.gate.bias_vl", DType::F32, {c.routed_experts(l)}, TensorKind::F32, 0, l});
  }
  // vision-spec §2: the ViT, the aligner and the span vectors, all BF16
  const int64_t h = vision_key(hf, "hidden_size"), inter = vision_key(hf, "intermediate_size");
  const int64_t patch = vision_key(hf, "patch_size"), down = vision_key(hf, "downsample_ratio");
  const int64_t blocks = vision_key(hf, "num_hidden_layers");
  bf16("vision.patch_embed.proj.weight", {h, 3 * patch * patch});
  bf16("vision.patch_embed.proj.bias", {h});
  for (int64_t i = 0; i < blocks; ++i) {
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
  bf16("aligner.w1.weight", {c.dim, h * down * down});
  bf16("aligner.w1.bias", {c.dim});
  bf16("aligner.w2.weight", {c.dim, c.dim});
  bf16("aligner.w2.bias", {c.dim});
  for (const char* span : {"image_start", "image_end", "image_newline"}) bf16(span, {c.dim});
  return out;
}

uint64_t shard_bytes_for(const std::vector<TensorSpec>& tensors, int shards) {
  // ShardedWriter::add's rule: a tensor that would overflow the open shard starts the next one.
  const auto count = [&](uint64_t limit) {
    int n = 0;
    uint64_t open = 0;
    bool empty = true;
    for (const TensorSpec& t : tensors) {
      const uint64_t b = spec_bytes(t);
      if (!empty && open + b > limit) {
        ++n;
        open = 0;
      }
      open += b;
      empty = false;
    }
    return n + (empty ? 0 : 1);
  };
  uint64_t total = 0;
  for (const TensorSpec& t : tensors) total += spec_bytes(t);
  // The count falls as the limit grows; the largest limit still giving `shards` is the most even.
  uint64_t lo = 1, hi = total;
  while (lo < hi) {  // the smallest limit giving at most `shards`
    const uint64_t mid = lo + (hi - lo) / 2;
    if (count(mid) <= shards) hi = mid;
    else lo = mid + 1;
  }
  if (count(lo) != shards) fail("shards", "no shard size splits these tensors into exactly " + std::to_string(shards));
  return lo;
}

void write_sparse_checkpoint(const std::string& dir, const nlohmann::json& hf_config, const nlohmann::json& tokenizer,
                             int shards) {
  namespace fs = std::filesystem;
  const ModelConfig config = parse_config(hf_config, "config.json");
  const std::vector<TensorSpec> tensors = released_tensors(config, hf_config);
  ShardedWriter writer(dir, shard_bytes_for(tensors, shards));
  for (const TensorSpec& t : tensors) writer.add({t.name, t.dtype, t.shape, {}, true});
  writer.finish();
  const std::string hf = hf_config.dump(2) + "\n";
  write_file_atomic((fs::path(dir) / "config.json").string(), hf.data(), hf.size());
  std::error_code ec;
  fs::create_directories(fs::path(dir) / "inference", ec);
  if (ec) fail(dir + "/inference", "cannot create folder: " + ec.message());
  const std::string flat = config_to_inference_json(config).dump(2) + "\n";
  write_file_atomic((fs::path(dir) / "inference" / "config.json").string(), flat.data(), flat.size());
  if (!tokenizer.is_null()) {
    const std::string tok = tokenizer.dump();
    write_file_atomic((fs::path(dir) / "tokenizer.json").string(), tok.data(), tok.size());
  }
}

}  // namespace dsv41
