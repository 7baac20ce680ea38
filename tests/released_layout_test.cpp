// The released layout at full size (model/released_layout.h) against the release's own figures
// (model-spec §2.1: 48 shards, 96,085 tensors, total_size 510,286,023,000 B, bytes by dtype), written
// as sparse files and read back by the checkpoint reader, `inspect` and `plan`.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "io/config.h"
#include "io/safetensors.h"
#include "model/checkpoint_check.h"
#include "model/engram.h"
#include "model/released_layout.h"
#include "text/engram_token_map.h"
#include "text/tiny_tokenizer.h"
#include "test_util.h"
#include "util/error.h"

namespace dsv41 {
namespace {

nlohmann::json released_hf_config() {
  std::ifstream in(test::released_config());
  return nlohmann::json::parse(in);
}

uint64_t bytes_of(const TensorSpec& s) {
  uint64_t n = dtype_size(s.dtype);
  for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
  return n;
}

TEST(ReleasedLayout, TensorsAndBytesAreTheReleases) {
  const nlohmann::json hf = released_hf_config();
  const std::vector<TensorSpec> tensors = released_tensors(parse_config(hf, "released"));
  EXPECT_EQ(tensors.size(), 96085u);
  std::map<std::string, int64_t> by_prefix;
  std::map<DType, uint64_t> by_dtype;
  uint64_t total = 0;
  for (const TensorSpec& t : tensors) {
    const std::string first = t.name.substr(0, t.name.find('.'));
    const bool nested = first == "layers" || first == "mtp" || first == "vision" || first == "aligner";
    by_prefix[nested ? first : "top"] += 1;
    by_dtype[t.dtype] += bytes_of(t);
    total += bytes_of(t);
  }
  EXPECT_EQ(by_prefix["layers"], 93415);
  EXPECT_EQ(by_prefix["mtp"], 2401);
  EXPECT_EQ(by_prefix["vision"], 259);
  EXPECT_EQ(by_prefix["aligner"], 4);
  EXPECT_EQ(by_prefix["top"], 6);
  EXPECT_EQ(total, 510286023000u);
  EXPECT_NEAR(static_cast<double>(by_dtype[DType::I8]) / 1e9, 278.6, 0.05);
  EXPECT_NEAR(static_cast<double>(by_dtype[DType::F8_E4M3]) / 1e9, 204.0, 0.05);
  EXPECT_NEAR(static_cast<double>(by_dtype[DType::F8_E8M0]) / 1e9, 23.6, 0.05);
  EXPECT_NEAR(static_cast<double>(by_dtype[DType::BF16]) / 1e9, 3.95, 0.005);
  EXPECT_NEAR(static_cast<double>(by_dtype[DType::F32]) / 1e9, 0.17, 0.005);
  EXPECT_GT(shard_bytes_for(tensors, 48), 0u);
  EXPECT_THROW(shard_bytes_for(tensors, 100000), Error) << "more shards than tensors";
}

TEST(ReleasedLayout, SparseCheckpointReadsAsTheRelease) {
  test::TempDir dir;
  const nlohmann::json hf = released_hf_config();
  const ModelConfig released = parse_config(hf, "released");
  const nlohmann::json tokenizer = build_tiny_tokenizer_for_engram(released.vocab_size, released.engram_compressed_vocab_size);
  write_sparse_checkpoint(dir.path(), hf, tokenizer, 48);

  int shards = 0;
  uint64_t apparent = 0, allocated = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    struct stat st {};
    ASSERT_EQ(::stat(entry.path().c_str(), &st), 0);
    if (entry.path().extension() == ".safetensors") ++shards;
    apparent += static_cast<uint64_t>(st.st_size);
    allocated += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  EXPECT_EQ(shards, 48);
  EXPECT_GT(apparent, 510286023000u);  // the data and 48 headers
  EXPECT_LT(allocated, uint64_t{256} << 20) << "the data must be holes";

  std::ifstream index_file(dir / "model.safetensors.index.json");
  const nlohmann::json index = nlohmann::json::parse(index_file);
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), 510286023000u);
  EXPECT_EQ(index["weight_map"].size(), 96085u);

  const ModelConfig config = load_config(dir.path());
  std::ifstream tok_file(dir / "tokenizer.json");
  const EngramTokenMap map = build_engram_token_map(nlohmann::json::parse(tok_file), config.vocab_size);
  EXPECT_EQ(map.size, 99092) << "the generated tokenizer folds to the release's Engram vocabulary";
  EXPECT_NO_THROW(check_engram_token_map(config, map));
  const Checkpoint checkpoint(dir.path());
  EXPECT_EQ(checkpoint.tensor_count(), 96085u);
  EXPECT_NO_THROW(check_checkpoint(checkpoint, config));
  const TensorView& table = checkpoint.get("layers.14.engram.embed.weight");
  EXPECT_EQ(table.nbytes(), static_cast<size_t>(table.shape()[0] * table.shape()[1]));
  EXPECT_EQ(table.data[table.nbytes() - 1], 0) << "a hole reads as zeros";

  const auto inspect = test::run_dsv41("inspect " + dir.path());
  ASSERT_EQ(inspect.status, 0) << inspect.out;
  EXPECT_NE(inspect.out.find("96085 tensors, all present"), std::string::npos) << inspect.out;
  const auto plan = test::run_dsv41("plan " + dir.path() + " --ram 16G --json");
  ASSERT_EQ(plan.status, 0) << plan.out;
  EXPECT_FALSE(nlohmann::json::parse(plan.out)["pack_experts"].get<bool>());
}

}  // namespace
}  // namespace dsv41
