// The dsv41 command as a user runs it: inspect and make-tiny, their JSON, and their errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace dsv41 {
namespace {

using nlohmann::json;

TEST(CliInspect, ReleasedConfigTextReport) {
  auto r = test::run_dsv41("inspect " + test::released_config());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("backbone: 2 SWA-only, 4 Full, 4 Reindex, 30 Reuse"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("global KV: 890 bytes/token"), std::string::npos);
  EXPECT_NE(r.out.find("layer 1: 384006168 rows"), std::string::npos);
  EXPECT_NE(r.out.find("layer 14: 384016682 rows"), std::string::npos);
  EXPECT_NE(r.out.find("multipliers"), std::string::npos);
}

TEST(CliInspect, ReleasedConfigJson) {
  auto r = test::run_dsv41("inspect --json " + test::released_config());
  ASSERT_EQ(r.status, 0) << r.out;
  json j = json::parse(r.out);
  EXPECT_DOUBLE_EQ(j["global_kv_bytes_per_token"].get<double>(), 890.0);
  ASSERT_EQ(j["layers"].size(), 43u);
  int counts[4] = {};
  for (const json& l : j["layers"]) {
    for (const char* key : {"index", "role", "compress_ratio", "engram", "candidate_source"}) {
      EXPECT_TRUE(l.contains(key)) << key;
    }
    if (l["dspark"]) continue;
    const std::string role = l["role"];
    counts[role == "swa" ? 0 : role == "full" ? 1 : role == "reindex" ? 2 : 3]++;
  }
  EXPECT_EQ(counts[0], 2);
  EXPECT_EQ(counts[1], 4);
  EXPECT_EQ(counts[2], 4);
  EXPECT_EQ(counts[3], 30);
  double global = 0;
  for (const json& s : j["state_classes"]) {
    EXPECT_TRUE(s.contains("name") && s.contains("owner_layers") && s.contains("consumer_layers"));
    EXPECT_TRUE(s.contains("bytes_per_token") || s.contains("bytes_per_sequence") || s.contains("bytes_per_query"));
    if (s["lifetime"] == "global") global += s["bytes_per_token"].get<double>();
  }
  EXPECT_DOUBLE_EQ(global, 890.0);
  for (const char* key : {"total", "engram", "dspark", "active_prefill", "active_decode"}) {
    EXPECT_GT(j["params"][key].get<int64_t>(), 0) << key;
  }
  ASSERT_EQ(j["engram"].size(), 2u);
  EXPECT_EQ(j["engram"][0]["layer"], 1);
  EXPECT_EQ(j["engram"][0]["primes"].size(), 24u);
  EXPECT_EQ(j["engram"][0]["offsets"].size(), 24u);
  EXPECT_EQ(j["engram"][0]["multipliers"].size(), 4u);
  EXPECT_EQ(j["engram"][1]["rows"], 384016682);
}

TEST(CliMakeTiny, WritesACheckpointThatInspectAccepts) {
  test::TempDir dir;
  auto made = test::run_dsv41("make-tiny --out " + dir.path() + "/m --seed 3");
  ASSERT_EQ(made.status, 0) << made.out;
  auto r = test::run_dsv41("inspect --json " + dir.path() + "/m");
  ASSERT_EQ(r.status, 0) << r.out;
  json j = json::parse(r.out);
  EXPECT_TRUE(j["checkpoint"]["valid"].get<bool>());
  EXPECT_GT(j["checkpoint"]["tensors"].get<int>(), 1000);
}

TEST(CliInspect, CorruptCheckpointIsRefusedNamingTheFile) {
  test::TempDir dir;
  std::filesystem::copy(test::tiny_model_dir(), dir.path(), std::filesystem::copy_options::recursive);
  const std::string shard = dir / "model-00003-of-00006.safetensors";
  std::filesystem::resize_file(shard, std::filesystem::file_size(shard) - 100);
  auto r = test::run_dsv41("inspect " + dir.path());
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("model-00003-of-00006.safetensors"), std::string::npos) << r.out;
}

TEST(CliErrors, BadFlagsAndPathsGetClearErrors) {
  struct Case {
    std::string args, expect;
  };
  std::vector<Case> cases = {
      {"inspect", "expects exactly one PATH"},
      {"inspect /nonexistent/model", "/nonexistent/model: no such file or folder"},
      {"inspect --frobnicate " + test::released_config(), "--frobnicate: unknown flag for 'dsv41 inspect'"},
      {"make-tiny", "--out: is required"},
      {"make-tiny --out /tmp/x --preset huge", "unknown preset \"huge\""},
      {"make-tiny --out /tmp/x --seed -4", "--seed: expects a non-negative integer"},
      {"make-tiny --out", "--out: needs a value"},
      {"make-tiny --out /proc/dsv41-cannot-write", "/proc/dsv41-cannot-write"},
      {"frobnicate", "unknown command 'frobnicate'"},
  };
  for (const Case& c : cases) {
    auto r = test::run_dsv41(c.args);
    EXPECT_NE(r.status, 0) << c.args;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << "\n" << r.out;
  }
}

}  // namespace
}  // namespace dsv41
