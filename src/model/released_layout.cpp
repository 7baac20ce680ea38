#include "model/released_layout.h"

#include <filesystem>

#include <nlohmann/json.hpp>

#include "io/safetensors_writer.h"
#include "util/error.h"

namespace dsv41 {

namespace {

uint64_t spec_bytes(const TensorSpec& s) {
  uint64_t n = dtype_size(s.dtype);
  for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
  return n;
}

}  // namespace

std::vector<TensorSpec> released_tensors(const ModelConfig& c) {
  if (!c.vision.enabled()) fail("vision_config", "missing from the config (the released one has it)");
  std::vector<TensorSpec> out = checkpoint_tensors(c);
  for (const auto& extra : {image_routing_biases(c), vision_tensors(c)}) out.insert(out.end(), extra.begin(), extra.end());
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
  const std::vector<TensorSpec> tensors = released_tensors(config);
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
