// The dsv41 command as a user runs it: inspect and make-tiny, their JSON, and their errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <cmath>
#include <algorithm>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace dsv41 {
namespace {

using nlohmann::json;

// A command line and a phrase its error message must contain.
struct Case {
  std::string args, expect;
};

// Every case fails with a non-zero status and names what is wrong.
void expect_errors(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    auto r = test::run_dsv41(c.args);
    EXPECT_NE(r.status, 0) << c.args;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << "\n" << r.out;
  }
}

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
  expect_errors(cases);
}

}  // namespace
}  // namespace dsv41

namespace dsv41 {
namespace {

using nlohmann::json;

std::string ids_csv(const std::vector<int32_t>& ids, size_t from, size_t to) {
  std::string s;
  for (size_t i = from; i < to; ++i) s += (s.empty() ? "" : ",") + std::to_string(ids[i]);
  return s;
}

std::vector<float> read_dump(const std::string& path, int64_t& vocab, int64_t& rows) {
  std::ifstream in(path, std::ios::binary);
  std::string header;
  std::getline(in, header);
  EXPECT_EQ(std::sscanf(header.c_str(), "dsv41-logits v1 vocab=%ld rows=%ld", &vocab, &rows), 2) << header;
  std::vector<float> v(static_cast<size_t>(vocab * rows));
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
  EXPECT_EQ(in.gcount(), static_cast<std::streamsize>(v.size() * 4));
  EXPECT_EQ(in.peek(), EOF);
  return v;
}

TEST(CliGenerate, StreamsTextFromAPrompt) {
  auto r = test::run_dsv41("generate -m " + test::tiny_model_dir() + " -p 'The engine reads the model' -n 16");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_GT(r.out.size(), 4u);
}

TEST(CliGenerate, JsonReportsTokensTextAndTimings) {
  auto r = test::run_dsv41("generate -m " + test::tiny_model_dir() + " -p 'Hello, world' -n 9 --json --prefill-mode tail");
  ASSERT_EQ(r.status, 0) << r.out;
  json j = json::parse(r.out);
  EXPECT_GE(j["prompt_tokens"].get<int>(), 3);  // BOS + text
  EXPECT_EQ(j["tokens"].size(), 9u);
  EXPECT_TRUE(j["text"].is_string());
  for (const char* k : {"prefill_s", "decode_s", "prefill_tok_s", "decode_tok_s"}) EXPECT_GT(j["timings"][k].get<double>(), 0) << k;
}

// --teacher-ids through the command reproduces the reference's decode rows on the golden checkpoint.
TEST(CliGenerate, TeacherIdsDumpTheReferenceDecodeRows) {
  const std::string dir = test::golden_dir("tiny-dense");
  std::ifstream in(dir + "/golden.json");
  json meta = json::parse(in);
  std::vector<int32_t> ids = meta["input_ids"];
  test::TempDir tmp;
  auto r = test::run_dsv41("generate -m " + dir + " --prompt-ids " + ids_csv(ids, 0, 76) + " --teacher-ids " +
                           ids_csv(ids, 76, 152) + " --dump-logits " + (tmp / "l.bin") + " --json");
  ASSERT_EQ(r.status, 0) << r.out;
  int64_t vocab = 0, rows = 0;
  std::vector<float> ours = read_dump(tmp / "l.bin", vocab, rows);
  ASSERT_EQ(vocab, 512);
  ASSERT_EQ(rows, 76);
  std::ifstream g(dir + "/golden_decode_teacher.f32", std::ios::binary);
  std::vector<float> ref(static_cast<size_t>(76 * 512));
  g.read(reinterpret_cast<char*>(ref.data()), static_cast<std::streamsize>(ref.size() * 4));
  int same = 0;
  double num = 0, den = 0;
  for (int row = 0; row < 76; ++row) {
    const float* a = &ours[row * 512];
    const float* b = &ref[row * 512];
    same += std::max_element(a, a + 512) - a == std::max_element(b, b + 512) - b;
    for (int j = 0; j < 512; ++j) {
      num += (a[j] - b[j]) * (a[j] - b[j]);
      den += b[j] * b[j];
    }
  }
  EXPECT_LE(std::sqrt(num / den), 0.05);  // the thresholds of golden_test.cpp
  EXPECT_GE(same, 69);
}

TEST(CliGenerate, SameSeedSameTokensOtherSeedOtherTokens) {
  const std::string base = "generate -m " + test::tiny_model_dir() + " -p 'Once' -n 24 --temp 0.9 --top-p 0.95 --json --seed ";
  auto a = test::run_dsv41(base + "7"), b = test::run_dsv41(base + "7"), c = test::run_dsv41(base + "8");
  ASSERT_EQ(a.status, 0) << a.out;
  EXPECT_EQ(json::parse(a.out)["tokens"], json::parse(b.out)["tokens"]);
  EXPECT_NE(json::parse(a.out)["tokens"], json::parse(c.out)["tokens"]);
}

// Peak memory of a long prefill grows with the context only through the KV state: activations are
// bounded by the prefill chunk and the indexer scores one query row at a time.
TEST(CliGenerate, PeakMemoryGrowsOnlyWithTheKvState) {
  DSV41_SKIP_UNDER_SANITIZERS("a peak RSS bound");
  std::mt19937 rng(3);
  std::vector<int32_t> ids(4000);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % 1024);
  auto peak = [&](size_t n) {
    auto r = test::run_dsv41("generate -m " + test::tiny_model_dir() + " --prompt-ids " + ids_csv(ids, 0, n) + " -n 1 --json");
    EXPECT_EQ(r.status, 0) << r.out;
    return json::parse(r.out)["peak_rss_mb"].get<double>();
  };
  const double short_ctx = peak(1000), long_ctx = peak(4000);
  // The tiny model's packed global rows take 106 B/token (dsv41 inspect), 0.3 MiB for the 3000 extra
  // tokens; the indexer's score block is capped at 4 MiB whatever the context. Allow 3x the rows (a
  // page list grows by copying), the score cap and 6 MiB of allocator noise.
  const double kv_mb = 3000.0 * 106 / (1 << 20);
  std::printf("[memory] peak RSS %.1f MiB at 1000 tokens, %.1f MiB at 4000 tokens (packed KV growth %.1f MiB)\n",
              short_ctx, long_ctx, kv_mb);
  EXPECT_LT(long_ctx - short_ctx, 3 * kv_mb + 4 + 6);
}

TEST(CliGenerate, BadRequestsGetClearErrors) {
  const std::string m = " -m " + test::tiny_model_dir();
  test::TempDir tmp;
  std::filesystem::copy(test::tiny_model_dir(), tmp / "m", std::filesystem::copy_options::recursive);
  std::filesystem::copy_file(test::golden_dir("tiny-dense") + "/config.json", tmp / "m/config.json",
                             std::filesystem::copy_options::overwrite_existing);
  std::vector<Case> cases = {
      {"generate -p hi", "--model: is required"},
      {"generate -m /nonexistent -p hi", "/nonexistent: no such file or folder"},
      {"generate" + m, "give exactly one of -p TEXT and --prompt-ids"},
      {"generate" + m + " -p hi --prompt-ids 1", "give exactly one"},
      {"generate" + m + " --prompt-ids 1,x,3", "--prompt-ids: expects comma-separated non-negative token ids"},
      {"generate" + m + " --prompt-ids 1,99999", "id 99999 is outside the vocabulary of 1024"},
      {"generate" + m + " -p hi --prefill-mode fast", "--prefill-mode: must be exact or tail"},
      {"generate" + m + " -p hi --temp -1", "temperature: must be a finite number >= 0"},
      {"generate" + m + " -p hi --top-p 0", "top_p: must be in (0, 1]"},
      {"generate" + m + " -p hi -n 5000", "exceeds the model's context of 4096"},
      {"generate -m " + (tmp / "m") + " -p hi", "tensor"},  // weights of another model
  };
  expect_errors(cases);
}

}  // namespace
}  // namespace dsv41

namespace dsv41 {
namespace {

TEST(CliEngram, EveryTierGivesTheSameTokens) {
  std::vector<nlohmann::json> out;
  for (const char* tier : {"mmap", "ram", "pread"}) {
    auto r = test::run_dsv41("generate -m " + test::tiny_model_dir() + " -p 'Hello there' -n 12 --json --engram " + tier);
    ASSERT_EQ(r.status, 0) << r.out;
    out.push_back(nlohmann::json::parse(r.out)["tokens"]);
  }
  EXPECT_EQ(out[0], out[1]);
  EXPECT_EQ(out[0], out[2]);
  auto bad = test::run_dsv41("generate -m " + test::tiny_model_dir() + " -p hi --engram disk");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("--engram: unknown Engram tier 'disk'"), std::string::npos) << bad.out;
}

TEST(CliBench, EngramScenarioReportsEachTier) {
  auto r = test::run_dsv41("bench -m " + test::tiny_model_dir() + " --scenario engram --steps 50 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  auto j = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));  // progress lines go to stderr
  ASSERT_EQ(j["engram"].size(), 3u);
  for (const auto& t : j["engram"]) {
    EXPECT_GT(t["us_per_step"].get<double>(), 0) << t;
    EXPECT_EQ(t["rows_per_step"], 12);  // 2 Engram layers × 3 n-gram orders × 2 heads
  }
  auto bad = test::run_dsv41("bench -m " + test::tiny_model_dir() + " --scenario warp");
  EXPECT_NE(bad.out.find("unknown scenario \"warp\""), std::string::npos) << bad.out;
}

}  // namespace
}  // namespace dsv41

namespace dsv41 {
namespace {

TEST(CliBench, AllScenariosReportAgainstTheMeasuredLimits) {
  test::TempDir dir;
  auto r = test::run_dsv41("bench -m " + test::tiny_model_dir() +
                           " --scenario cold-prefill,prefix-hit,decode,concurrency --lengths 64,140 --steps 2 --json --plot " +
                           (dir / "p.svg"));
  ASSERT_EQ(r.status, 0) << r.out;
  auto j = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));
  EXPECT_GT(j["machine"]["bandwidth_gbs"].get<double>(), 0.1);
  EXPECT_GT(j["machine"]["peak_gflops"].get<double>(), 0.1);
  EXPECT_GE(j["machine"]["cores"].get<int>(), 1);
  EXPECT_EQ(j["decode"].size(), 2u);
  for (const auto& d : j["decode"]) {
    EXPECT_GT(d["tok_s"].get<double>(), 0);
    EXPECT_GT(d["active_bytes_per_token"].get<double>(), 1e6);  // the tiny model reads ~3 MB per token
    EXPECT_GT(d["bandwidth_efficiency"].get<double>(), 0);
  }
  EXPECT_EQ(j["cold_prefill"].size(), 4u);  // two lengths × exact, tail
  for (const auto& d : j["cold_prefill"]) EXPECT_GT(d["flops_efficiency"].get<double>(), 0);
  EXPECT_EQ(j["prefix_hit"].size(), 4u);  // ram/disk × exact/replay
  for (const auto& d : j["prefix_hit"]) {
    EXPECT_EQ(d["cached_tokens"], 64);  // 90% of 140 = 126 -> one whole 64-token block
    EXPECT_GT(d["speedup"].get<double>(), 0);
  }
  EXPECT_EQ(j["concurrency"].size(), 4u);
  std::ifstream svg(dir / "p.svg");
  std::string text((std::istreambuf_iterator<char>(svg)), {});
  EXPECT_NE(text.find("<svg"), std::string::npos);
  EXPECT_NE(text.find("roofline"), std::string::npos);
}

}  // namespace
}  // namespace dsv41
