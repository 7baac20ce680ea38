#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "io/config.h"
#include "io/safetensors.h"
#include "model/checkpoint_check.h"
#include "io/layer_roles.h"
#include "model/model_stats.h"
#include "model/synthetic_checkpoint.h"
#include "numeric/formats.h"
#include "test_util.h"
#include "text/engram_token_map.h"
#include "util/error.h"

namespace dsv41 {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(SyntheticCheckpoint, TinyPresetCoversEveryLayerRole) {
  ModelConfig c = synthetic_config("tiny");
  auto roles = derive_layer_roles(c);
  int swa = 0, full_r2 = 0, reindex = 0, engram = 0, taps = 0;
  bool reuse_after_r2 = false, reuse_after_candidate = false, candidate_r1 = false;
  for (const LayerRole& r : roles) {
    if (r.dspark) continue;
    swa += r.role == AttnRole::Swa;
    full_r2 += r.role == AttnRole::Full && r.compress_ratio == 2;
    reindex += r.role == AttnRole::Reindex;
    engram += r.engram;
    taps += r.dspark_tap;
    candidate_r1 = candidate_r1 || (r.candidate_source && r.role == AttnRole::Full && r.compress_ratio == 1);
    if (r.role == AttnRole::Reuse) {
      reuse_after_r2 = reuse_after_r2 || r.compress_ratio == 2;
      reuse_after_candidate = reuse_after_candidate || r.layer > c.candidate_source_layer;
    }
  }
  EXPECT_EQ(swa, 2);
  EXPECT_GE(full_r2, 2);
  EXPECT_TRUE(candidate_r1);
  EXPECT_TRUE(reuse_after_r2);
  EXPECT_TRUE(reuse_after_candidate);
  EXPECT_GE(reindex, 1);
  EXPECT_EQ(engram, 2);
  EXPECT_EQ(taps, 3);
  EXPECT_TRUE(roles.back().dspark);
  EXPECT_TRUE(roles[c.n_layers - 1].dspark_tap);  // the drafter taps the last layers
  EXPECT_GE(c.n_mtp_layers, 2);  // separate first (main_proj) and last (heads) DSpark stages
}

TEST(SyntheticCheckpoint, BenchPresetHasReleasedWidthsAndFitsInMemory) {
  ModelConfig c = synthetic_config("bench");
  EXPECT_EQ(c.dim, 5120);
  EXPECT_EQ(c.n_heads, 64);
  EXPECT_EQ(c.head_dim, 512);
  EXPECT_EQ(c.q_lora_rank, 1280);
  EXPECT_EQ(c.index_n_heads, 32);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.moe_inter_dim, 2304);
  ParamCounts p = count_params(c);
  EXPECT_LT(p.checkpoint_bytes, int64_t{12} << 30);  // comfortably inside 24 GiB
  EXPECT_GT(p.checkpoint_bytes, int64_t{2} << 30);   // big enough to measure memory bandwidth with
  EXPECT_NO_THROW(synthetic_config("small"));
  EXPECT_THROW(synthetic_config("huge"), Error);
}

// The context's FLOPs, counted by hand on the tiny preset for a 4-token prompt (window 16, ratios
// 0,0,2,2,2,2,1,1,1,1,1,1; index sources 2,4,6 and the candidate users 8,10; top-k 8, pool 4×4;
// 4 heads of 64, 2 index heads of 32). Window rows: 1+2+3+4 = 10 per layer, 120 in all; compressed
// rows visible at positions 0..3: 0,1,1,2 (ratio 2, 4 layers: 16) and 1,2,3,4 (ratio 1, 6 layers:
// 60); attention 4·4·64 = 1024 FLOPs per row. Scored index rows: 4 + 4 (layers 2, 4), 10 (6), 10 +
// 10 (8, 10: inside their 16-row pool); 2·2·32 = 128 FLOPs per row. With 4 tokens inside the window
// tail mode runs every query too. The long preset's candidate users then score at most their pool.
TEST(SyntheticCheckpoint, ContextFlopsAreTheIndexerAndAttentionRows) {
  const ModelConfig c = synthetic_config("tiny");
  const double want = (120 + 16 + 60) * 1024.0 + (4 + 4 + 10 + 10 + 10) * 128.0;
  EXPECT_DOUBLE_EQ(context_flops(c, 4, false), want);
  EXPECT_DOUBLE_EQ(context_flops(c, 4, true), want);
  EXPECT_LT(context_flops(c, 400, true), context_flops(c, 400, false)) << "the late layers skip the early queries";
  // The long preset's query at position 20000 (window 128, top-k 64, pool 256×8 = 2048): attention
  // over 128 window rows in the 2 SWA layers and 128 + 64 in the 10 compressed ones (2176 rows);
  // scores over 20001/2 = 10000 rows in each ratio-2 source, 20001 in the ratio-1 source and only the
  // 2048-row pool in each candidate user (44097 rows), not the 20001 rows of the history.
  const ModelConfig l = synthetic_config("long");
  EXPECT_DOUBLE_EQ(context_flops(l, 20001, false) - context_flops(l, 20000, false), 2176 * 1024.0 + 44097 * 128.0);
}

TEST(SyntheticCheckpoint, ReadsBackAndMatchesItsConfig) {
  const std::string& dir = test::tiny_model_dir();
  ModelConfig c = load_config(dir);
  EXPECT_EQ(config_fingerprint(c), config_fingerprint(synthetic_config("tiny")));
  EXPECT_EQ(config_fingerprint(load_config(dir + "/inference/config.json")), config_fingerprint(c));
  Checkpoint ckpt(dir);
  EXPECT_NO_THROW(check_checkpoint(ckpt, c));
  auto index = nlohmann::json::parse(read_file(dir + "/model.safetensors.index.json"));
  std::set<std::string> shards;
  for (auto& [name, file] : index["weight_map"].items()) shards.insert(file.get<std::string>());
  EXPECT_GE(shards.size(), 2u);  // sharded, as the release is
  EXPECT_EQ(ckpt.find("model.embed.weight"), nullptr);  // names carry no "model." prefix
  EXPECT_NE(ckpt.find("mtp.0.main_proj.weight"), nullptr);
  EXPECT_NE(ckpt.find("mtp.1.markov_head.embed.weight"), nullptr);
  EXPECT_EQ(ckpt.find("mtp.1.main_proj.weight"), nullptr);  // only the first stage projects the taps
  EXPECT_NE(ckpt.find("layers.2.attn.compressor.wgate.weight"), nullptr);
  EXPECT_EQ(ckpt.find("layers.6.attn.compressor.wgate.weight"), nullptr);  // ratio 1: no gate
  EXPECT_EQ(ckpt.find("layers.7.attn.indexer.wq_b.weight"), nullptr);      // Reuse: no indexer
}

TEST(SyntheticCheckpoint, EngramVocabularyComesFromItsTokenizer) {
  const std::string& dir = test::tiny_model_dir();
  ModelConfig c = load_config(dir);
  auto tok = nlohmann::json::parse(read_file(dir + "/tokenizer.json"));
  EngramTokenMap map = build_engram_token_map(tok, c.vocab_size);
  EXPECT_EQ(map.size, c.engram_compressed_vocab_size);
  EXPECT_LT(map.size, c.vocab_size);  // case and leading spaces collapse
  EXPECT_EQ(tok["added_tokens"][0]["content"], "<｜begin▁of▁sentence｜>");
  EXPECT_EQ(tok["model"]["vocab"].size(), static_cast<size_t>(c.vocab_size));
}

// The quantized tensors hold real packed data: every FP8 tile's largest code is in the top binade of
// e4m3 (the scale is the smallest power of two that fits), and every FP4 block reaches |code| >= 3.
TEST(SyntheticCheckpoint, WeightsArePackedWithTightPowerOfTwoScales) {
  Checkpoint ckpt(test::tiny_model_dir());
  const TensorView& w = ckpt.get("layers.3.attn.wq_b.weight");
  const TensorView& s = ckpt.get("layers.3.attn.wq_b.scale");
  const int64_t n = w.shape()[0], k = w.shape()[1];
  for (int64_t r0 = 0; r0 < n; r0 += 32) {
    for (int64_t c0 = 0; c0 < k; c0 += 32) {
      float amax = 0;
      for (int64_t r = r0; r < r0 + 32; ++r)
        for (int64_t col = c0; col < c0 + 32; ++col) {
          float v = e4m3_to_f32(w.data[r * k + col]);
          ASSERT_FALSE(std::isnan(v));
          amax = std::max(amax, std::fabs(v));
        }
      EXPECT_GT(amax, 224.0f);
      EXPECT_LE(amax, 448.0f);
      float scale = e8m0_to_f32(s.data[(r0 / 32) * (k / 32) + c0 / 32]);
      EXPECT_GT(amax * scale, 0.01f);  // dequantized weights ~ 1/sqrt(K) in size
      EXPECT_LT(amax * scale, 2.0f);
    }
  }
  const TensorView& e = ckpt.get("layers.5.ffn.experts.3.w2.weight");
  const int64_t rows = e.shape()[0], bytes = e.shape()[1];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b0 = 0; b0 < bytes; b0 += 16) {  // 16 bytes = one 32-value block
      float amax = 0;
      for (int64_t b = b0; b < b0 + 16; ++b) {
        uint8_t byte = e.data[r * bytes + b];
        amax = std::max({amax, std::fabs(e2m1_to_f32(byte & 0xF)), std::fabs(e2m1_to_f32(byte >> 4))});
      }
      EXPECT_GE(amax, 3.0f);  // amax/scale is in (3, 6], which rounds to 3, 4 or 6
    }
  }
}

TEST(SyntheticCheckpoint, SameSeedSameBytesOtherSeedOtherWeights) {
  test::TempDir a, b, c;
  write_synthetic_checkpoint(a.path(), "tiny", 7);
  write_synthetic_checkpoint(b.path(), "tiny", 7);
  write_synthetic_checkpoint(c.path(), "tiny", 8);
  for (const char* f : {"config.json", "tokenizer.json", "model.safetensors.index.json",
                        "model-00001-of-00006.safetensors", "model-00006-of-00006.safetensors"}) {
    EXPECT_EQ(read_file(a / f), read_file(b / f)) << f;
  }
  EXPECT_EQ(read_file(a / "config.json"), read_file(c / "config.json"));
  EXPECT_NE(read_file(a / "model-00002-of-00006.safetensors"), read_file(c / "model-00002-of-00006.safetensors"));
}

// The official goldens were written by DeepSeek's reference layout: our expectation of the tensor
// list must accept them exactly, and reject them under a config that implies other tensors.
TEST(SyntheticCheckpoint, LayoutMatchesTheOfficialGoldenCheckpoints) {
  for (const char* name : {"tiny-dense", "tiny-sparse"}) {
    Checkpoint ckpt(test::golden_dir(name));
    EXPECT_NO_THROW(check_checkpoint(ckpt, load_config(test::golden_dir(name)))) << name;
  }
  Checkpoint golden(test::golden_dir("tiny-dense"));
  try {
    check_checkpoint(golden, synthetic_config("tiny"));
    FAIL() << "a foreign config was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dsv41
