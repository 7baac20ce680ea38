#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "io/config.h"
#include "io/layer_roles.h"
#include "model/model_stats.h"
#include "numeric/row_codecs.h"
#include "state/state_graph.h"
#include "test_util.h"
#include "util/error.h"

namespace dsv41 {
namespace {

using nlohmann::json;

json released_json() {
  std::ifstream in(test::released_config());
  return json::parse(in);
}

// The message of the Error that parsing `j` throws ("" if none).
std::string parse_error(const json& j) {
  try {
    parse_config(j, "cfg.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// An edit of the released config and a piece of the error it must give.
struct BrokenCase {
  const char* what;
  std::function<void(json&)> edit;
  const char* expect;
};

// Each edit is an error naming the file and the expected problem.
void expect_errors(const std::vector<BrokenCase>& cases) {
  for (const BrokenCase& c : cases) {
    json j = released_json();
    c.edit(j);
    const std::string msg = parse_error(j);
    EXPECT_NE(msg.find("cfg.json"), std::string::npos) << c.what << ": " << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.what << ": " << msg;
  }
}

TEST(Config, ReadsTheReleasedHfConfig) {
  ModelConfig c = load_config(test::released_config());
  EXPECT_EQ(c.dim, 5120);
  EXPECT_EQ(c.n_layers, 40);
  EXPECT_EQ(c.n_mtp_layers, 3);
  EXPECT_EQ(c.compress_ratios.size(), 43u);
  EXPECT_EQ(c.window_size, 128);
  EXPECT_EQ(c.original_seq_len, 65536);
  EXPECT_EQ(c.rope_factor, 16);
  EXPECT_EQ(c.candidate_source_layer, 20);
  EXPECT_EQ(c.engram_pad_id, 2);
  EXPECT_EQ(c.dspark_n_activated_experts, 3);
  EXPECT_EQ(c.max_seq_len, 1048576);
  EXPECT_EQ(c.engram_num_embeddings, (std::vector<int64_t>{384006168, 384016682}));
}

TEST(Config, FlatAndHfFormsOfTheGoldenConfigAgree) {
  for (const char* name : {"tiny-dense", "tiny-sparse"}) {
    ModelConfig hf = load_config(test::golden_dir(name) + "/config.json");
    ModelConfig flat = load_config(test::golden_dir(name) + "/inference/config.json");
    EXPECT_EQ(config_to_inference_json(hf).dump(), config_to_inference_json(flat).dump()) << name;
    EXPECT_EQ(config_fingerprint(hf), config_fingerprint(flat));
  }
  EXPECT_NE(config_fingerprint(load_config(test::golden_dir("tiny-dense"))),
            config_fingerprint(load_config(test::golden_dir("tiny-sparse"))));
}

TEST(Config, WrittenFormsReadBackIdentically) {
  ModelConfig c = load_config(test::released_config());
  ModelConfig from_hf = parse_config(config_to_hf_json(c), "hf");
  ModelConfig from_flat = parse_config(config_to_inference_json(c), "flat");
  EXPECT_EQ(config_fingerprint(from_hf), config_fingerprint(c));
  EXPECT_EQ(config_fingerprint(from_flat), config_fingerprint(c));
}

TEST(Config, RejectsBrokenConfigsNamingTheProblem) {
  const std::vector<BrokenCase> cases = {
      {"missing key", [](json& j) { j["text_config"].erase("hidden_size"); }, "hidden_size / dim\" is missing"},
      {"wrong type", [](json& j) { j["text_config"]["num_hidden_layers"] = "forty"; }, "must be an integer"},
      {"short ratios", [](json& j) { j["text_config"]["compress_ratios"].erase(42); }, "compress_ratios has 42 entries, expected 43"},
      {"dspark ratio", [](json& j) { j["text_config"]["compress_ratios"][41] = 1; }, "belongs to a DSpark block"},
      {"source ratio 0", [](json& j) { j["text_config"]["kv_source_layer_ids"][0] = 1; }, "whose compress ratio is 0"},
      {"unsorted sources", [](json& j) { j["text_config"]["index_source_layer_ids"] = {2, 14, 8, 20}; }, "strictly increasing"},
      {"kv not index", [](json& j) { j["text_config"]["index_source_layer_ids"] = {2, 8, 20}; }, "KV source layer 14 is not in index_source_layers"},
      {"no source before", [](json& j) { j["text_config"]["kv_source_layer_ids"] = {8, 14, 20}; j["text_config"]["index_source_layer_ids"] = {8, 14, 20}; }, "layer 2 compresses but no KV source precedes it"},
      {"ratio mismatch", [](json& j) { j["text_config"]["kv_source_layer_ids"] = {2, 8, 14}; j["text_config"]["index_source_layer_ids"] = {2, 8, 14}; j["text_config"]["candidate_source_layer_id"] = -1; }, "reads KV source 14 with ratio 2"},
      {"small pool", [](json& j) { j["text_config"]["candidate_topk_blocks"] = 32; }, "cannot hold index_topk = 512"},
      {"candidate not index", [](json& j) { j["text_config"]["candidate_source_layer_id"] = 21; }, "candidate_source_layer 21 is not an index source"},
      {"engram rows", [](json& j) { j["text_config"]["engram_num_embeddings"][1] = 384016683; }, "primes sum to 384016682"},
      {"engram count", [](json& j) { j["text_config"]["engram_num_embeddings"] = {384006168}; }, "engram_num_embeddings has 1 entries"},
      {"tap outside", [](json& j) { j["text_config"]["dspark_target_layer_ids"] = {37, 38, 40}; }, "dspark_target_layer_ids names layer 40"},
      {"heads vs groups", [](json& j) { j["text_config"]["o_groups"] = 7; }, "n_heads must be a multiple of o_groups"},
      {"not 32", [](json& j) { j["text_config"]["hidden_size"] = 5000; }, "must be a multiple of 32"},
      {"kv heads", [](json& j) { j["text_config"]["num_key_value_heads"] = 2; }, "num_key_value_heads must be 1"},
      {"model type", [](json& j) { j["model_type"] = "llama"; }, "is not deepseek_v41"},
      {"quant", [](json& j) { j["quantization_config"]["weight_block_size"] = {128, 128}; }, "weight_block_size must be [32, 32]"},
      {"negative", [](json& j) { j["text_config"]["sliding_window"] = -1; }, "window_size must be positive"},
      {"rope type", [](json& j) { j["text_config"]["rope_scaling"]["rope_type"] = "linear"; }, "yarn only"},
      {"too many experts", [](json& j) { j["text_config"]["num_experts_per_tok"] = 500; }, "n_activated_experts exceeds"},
      {"huge int", [](json& j) { j["text_config"]["num_hidden_layers"] = 1e12; }, "out of range"},
  };
  expect_errors(cases);
  EXPECT_EQ(parse_error(released_json()), "");
  EXPECT_NE(parse_error(json::array()).find("must be a JSON object"), std::string::npos);
}

// The integers that size loops and per-sequence buffers, which no tensor's shape checks, have bounds:
// generous multiples of the released values, so that a typo or a hostile file is refused at once
// instead of running for hours (Sinkhorn iterations, the Engram prime search) or allocating without
// end (window rings, top-k and candidate buffers). Each bound itself is accepted.
TEST(Config, IntegersThatSizeLoopsAndBuffersAreBounded) {
  const auto start = std::chrono::steady_clock::now();
  const std::vector<BrokenCase> cases = {
      {"sinkhorn", [](json& j) { j["text_config"]["hc_sinkhorn_iters"] = 2147483647; }, "hc_sinkhorn_iters = 2147483647 is above the bound of 1000"},
      {"hc mult", [](json& j) { j["text_config"]["hc_mult"] = 17; }, "hc_mult = 17 is above the bound of 16"},
      {"window", [](json& j) { j["text_config"]["sliding_window"] = 8193; }, "window_size = 8193 is above the bound of 8192"},
      {"context", [](json& j) { j["text_config"]["max_position_embeddings"] = (int64_t{1} << 24) + 1; }, "max_seq_len = 16777217 is above the bound of 16777216"},
      {"yarn base", [](json& j) { j["text_config"]["rope_scaling"]["original_max_position_embeddings"] = int64_t{1} << 62; }, "original_seq_len = 4611686018427387904 is above the bound of 16777216"},
      {"topk", [](json& j) { j["text_config"]["index_topk"] = 65537; }, "index_topk = 65537 is above the bound of 65536"},
      {"pool", [](json& j) { j["text_config"]["candidate_topk_blocks"] = 1 << 20; }, "candidate pool (candidate_topk_blocks × candidate_block_size) = 8388608 is above the bound of 1048576"},
      {"ngram", [](json& j) { j["text_config"]["engram_max_ngram_size"] = 2147483647; }, "engram_max_ngram_size = 2147483647 is above the bound of 16"},
      {"engram heads", [](json& j) { j["text_config"]["engram_n_heads"] = 2147483647; }, "engram_n_heads = 2147483647 is above the bound of 64"},
      {"engram vocab", [](json& j) { j["text_config"]["engram_vocab_size"] = int64_t{1} << 62; }, "engram_vocab_size = 4611686018427387904 is above the bound of 4294967296"},
      {"image tokens", [](json& j) { j["vision_config"] = {{"num_hidden_layers", 1}, {"max_image_tokens", 16385}}; }, "max_image_tokens = 16385 is above the bound of 16384"},
  };
  expect_errors(cases);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
  json j = released_json();
  j["text_config"]["hc_sinkhorn_iters"] = 1000;
  j["text_config"]["hc_mult"] = 16;
  j["text_config"]["sliding_window"] = 8192;
  j["text_config"]["index_topk"] = 65536;
  j["text_config"]["candidate_topk_blocks"] = 131072;  // × 8 = 1,048,576
  EXPECT_EQ(parse_error(j), "");
}

TEST(Config, KeysThatChangeTheMathUnimplementedAreErrorsNamingThem) {
  const std::vector<BrokenCase> cases = {
      {"biases", [](json& j) { j["text_config"]["attention_bias"] = true; }, "attention_bias = true"},
      {"grouped routing", [](json& j) { j["text_config"]["n_group"] = 8; }, "n_group = 8"},
      {"topk method", [](json& j) { j["text_config"]["topk_method"] = "greedy"; }, "topk_method = \"greedy\""},
      {"dense layers", [](json& j) { j["text_config"]["first_k_dense_replace"] = 3; }, "first_k_dense_replace = 3"},
      {"mscale", [](json& j) { j["text_config"]["rope_scaling"]["mscale"] = 1.0; }, "mscale"},
      {"static scales", [](json& j) { j["quantization_config"]["activation_scheme"] = "static"; }, "activation_scheme = \"static\""},
  };
  expect_errors(cases);
  // Every offending key is named in one error, not only the first.
  json j = released_json();
  j["text_config"]["attention_bias"] = true;
  j["text_config"]["n_group"] = 8;
  std::string msg = parse_error(j);
  EXPECT_NE(msg.find("attention_bias"), std::string::npos) << msg;
  EXPECT_NE(msg.find("n_group"), std::string::npos) << msg;
  // The values the engine implements are accepted when written out.
  j = released_json();
  j["text_config"]["attention_bias"] = false;
  j["text_config"]["n_group"] = 1;
  EXPECT_EQ(parse_error(j), "");
}

TEST(Config, UnknownAndUnusedKeysAreReportedNotSilentlyDropped) {
  ModelConfig released = load_config(test::released_config());
  EXPECT_TRUE(released.unknown_keys.empty()) << released.unknown_keys.front();
  for (const char* key : {"architectures"}) {
    bool listed = false;
    for (const std::string& k : released.unused_keys) listed |= k.find(key) != std::string::npos;
    EXPECT_TRUE(listed) << key;
  }
  json j = released_json();
  j["text_config"]["hidden_sise"] = 5120;
  j["frobnicate"] = 1;
  ModelConfig c = parse_config(j, "cfg.json");
  ASSERT_EQ(c.unknown_keys.size(), 2u);
  std::string all = c.unknown_keys[0] + " " + c.unknown_keys[1];
  EXPECT_NE(all.find("text_config.hidden_sise"), std::string::npos) << all;
  EXPECT_NE(all.find("frobnicate"), std::string::npos) << all;
  // An unknown key changes nothing the engine computes.
  EXPECT_EQ(config_fingerprint(c), config_fingerprint(released));
  // The forms the project writes are read without a leftover key.
  EXPECT_TRUE(parse_config(config_to_hf_json(released), "hf").unknown_keys.empty());
  EXPECT_TRUE(parse_config(config_to_inference_json(released), "flat").unknown_keys.empty());
  EXPECT_TRUE(parse_config(config_to_inference_json(released), "flat").unused_keys.empty());
}

TEST(Config, LoadFailsClearlyOnMissingOrBadFiles) {
  test::TempDir dir;
  try {
    load_config(dir.path());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no config.json"), std::string::npos) << e.what();
  }
  std::ofstream(dir / "config.json") << "{ not json";
  try {
    load_config(dir.path());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.json: is not valid JSON"), std::string::npos) << e.what();
  }
}

TEST(LayerRoles, ReleasedConfigHasTheDocumentedRoles) {
  ModelConfig c = load_config(test::released_config());
  auto roles = derive_layer_roles(c);
  ASSERT_EQ(roles.size(), 43u);
  int count[4] = {};
  for (int l = 0; l < 40; ++l) count[static_cast<int>(roles[l].role)]++;
  EXPECT_EQ(count[static_cast<int>(AttnRole::Swa)], 2);
  EXPECT_EQ(count[static_cast<int>(AttnRole::Full)], 4);
  EXPECT_EQ(count[static_cast<int>(AttnRole::Reindex)], 4);
  EXPECT_EQ(count[static_cast<int>(AttnRole::Reuse)], 30);
  for (int l : {2, 8, 14, 20}) EXPECT_EQ(roles[l].role, AttnRole::Full) << l;
  for (int l : {24, 28, 32, 36}) {
    EXPECT_EQ(roles[l].role, AttnRole::Reindex) << l;
    EXPECT_TRUE(roles[l].candidate_user);
    EXPECT_EQ(roles[l].index_keys_from, 20);
  }
  EXPECT_TRUE(roles[20].candidate_source);
  EXPECT_FALSE(roles[20].candidate_user);
  EXPECT_EQ(roles[5].kv_from, 2);
  EXPECT_EQ(roles[5].topk_from, 2);
  EXPECT_EQ(roles[19].kv_from, 14);
  EXPECT_EQ(roles[23].topk_from, 20);
  EXPECT_EQ(roles[27].topk_from, 24);
  EXPECT_EQ(roles[39].topk_from, 36);
  EXPECT_EQ(roles[39].kv_from, 20);
  EXPECT_TRUE(roles[1].engram && roles[14].engram);
  EXPECT_TRUE(roles[37].dspark_tap && roles[38].dspark_tap && roles[39].dspark_tap);
  EXPECT_EQ(late_layer_start(c), 21);
  EXPECT_TRUE(roles[20].encoder);
  EXPECT_FALSE(roles[21].encoder);
  EXPECT_EQ(roles[0].rope_theta, 10000);
  EXPECT_FALSE(roles[0].yarn);
  EXPECT_EQ(roles[2].rope_theta, 160000);
  EXPECT_TRUE(roles[2].yarn);
  for (int l = 40; l < 43; ++l) {
    EXPECT_TRUE(roles[l].dspark);
    EXPECT_EQ(roles[l].role, AttnRole::Swa);
  }
}

TEST(LayerRoles, GoldenConfigMatchesItsReadme) {
  // "0 SWA-only (+Engram), 1 Full ratio 2 (+Engram), 2 Reuse, 3 Full ratio 1 + candidate source,
  //  4 Reuse, 5 Reindex"
  auto roles = derive_layer_roles(load_config(test::golden_dir("tiny-dense")));
  std::vector<AttnRole> want = {AttnRole::Swa, AttnRole::Full, AttnRole::Reuse,
                                AttnRole::Full, AttnRole::Reuse, AttnRole::Reindex};
  for (int l = 0; l < 6; ++l) EXPECT_EQ(roles[l].role, want[l]) << l;
  EXPECT_TRUE(roles[0].engram && roles[1].engram);
  EXPECT_TRUE(roles[3].candidate_source);
  EXPECT_TRUE(roles[5].candidate_user);
}

TEST(StateGraph, ReleasedConfigNeeds890BytesPerToken) {
  ModelConfig c = load_config(test::released_config());
  StateGraph g = build_state_graph(c, derive_layer_roles(c));
  EXPECT_EQ(main_kv_bytes(c.head_dim), 288);
  EXPECT_EQ(index_key_bytes(c.index_head_dim), 68);
  EXPECT_DOUBLE_EQ(g.global_bytes_per_token(), 890.0);
  const StateClass* kv = g.find("main_kv");
  ASSERT_NE(kv, nullptr);
  EXPECT_EQ(kv->owner_layers(), (std::vector<int>{2, 8, 14, 20}));
  EXPECT_DOUBLE_EQ(kv->bytes_per_token(), 720.0);
  EXPECT_EQ(kv->consumer_layers().size(), 38u);  // every compressed layer
  EXPECT_EQ(kv->owners[3].consumers.size(), 20u);  // layer 20 feeds the whole decoder
  const StateClass* keys = g.find("index_keys");
  ASSERT_NE(keys, nullptr);
  EXPECT_DOUBLE_EQ(keys->bytes_per_token(), 170.0);
  EXPECT_EQ(keys->owners[3].consumers, (std::vector<int>{20, 24, 28, 32, 36}));
  const StateClass* window = g.find("window");
  ASSERT_NE(window, nullptr);
  EXPECT_EQ(window->owners.size(), 40u);
  EXPECT_EQ(window->owners[0].bytes_per_sequence, 128 * 528);  // 67,584 B per layer (model-spec §6.1)
  const StateClass* tails = g.find("compressor_tail");
  ASSERT_NE(tails, nullptr);
  EXPECT_EQ(tails->owner_layers(), (std::vector<int>{2, 8, 14}));
  EXPECT_EQ(tails->owners[0].bytes_per_sequence, 8192);
  EXPECT_EQ(g.find("dspark_window")->owners.size(), 3u);
  EXPECT_EQ(g.find("candidates")->consumer_layers(), (std::vector<int>{24, 28, 32, 36}));
}

TEST(ModelStats, ReleasedParameterCountsAreInThePublishedRange) {
  ParamCounts p = count_params(load_config(test::released_config()));
  // model-spec §6.2: 763.2B in the checkpoint including the 0.4B vision tower we do not count,
  // 196.6B Engram, ~14.2B DSpark, about 8B active per prompt token and 16B per generated token.
  EXPECT_NEAR(static_cast<double>(p.total) / 1e9, 762.8, 1.0);
  EXPECT_NEAR(static_cast<double>(p.engram) / 1e9, 196.6, 0.1);
  EXPECT_NEAR(static_cast<double>(p.dspark) / 1e9, 14.2, 0.3);
  EXPECT_NEAR(static_cast<double>(p.active_prefill) / 1e9, 8.3, 0.5);
  EXPECT_NEAR(static_cast<double>(p.active_decode) / 1e9, 16.1, 0.3);
}

}  // namespace
}  // namespace dsv41
