// The dsv41 command as a user runs it: inspect and make-tiny, their JSON, and their errors.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <cmath>
#include <algorithm>
#include <array>
#include <map>
#include <nlohmann/json.hpp>

#include "kernels/backend.h"
#include "model/model_stats.h"
#include "kernels/cpu_features.h"
#include "runtime/sampler.h"
#include "runtime/session.h"
#include "test_util.h"
#include "text/tokenizer.h"

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
  // vision-spec §2's counts at the released shapes: the ViT 411,842,560, the aligner 73,410,560, the
  // span vectors 15,360, and bias_vl (40 layers of 384, 3 DSpark blocks of 128)
  EXPECT_EQ(j["params"]["vision"].get<int64_t>(), 411842560 + 73410560 + 15360 + 40 * 384 + 3 * 128);
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

// Without --json the command streams exactly the text of the tokens it generates, then a newline;
// the tokens are the model's greedy continuation of BOS + the tokenized prompt.
TEST(CliGenerate, StreamsTextFromAPrompt) {
  const std::string text = "The engine reads the model";
  const std::string args = "generate -m " + test::tiny_model_dir() + " -p '" + text + "' -n 16";
  auto streamed = test::run_dsv41(args);
  auto reported = test::run_dsv41(args + " --json");
  ASSERT_EQ(streamed.status, 0) << streamed.out;
  ASSERT_EQ(reported.status, 0) << reported.out;
  const json j = json::parse(reported.out);
  const std::vector<int32_t> tokens = j["tokens"];

  const Model& m = test::tiny_model();
  const Tokenizer tok = Tokenizer::from_file(test::tiny_model_dir() + "/tokenizer.json");
  std::vector<int32_t> prompt = {static_cast<int32_t>(m.config().bos_token_id)};
  for (int32_t id : tok.encode(text)) prompt.push_back(id);
  EXPECT_EQ(j["prompt_tokens"].get<size_t>(), prompt.size());
  Session s(m, test::pools_for(m), {});
  std::vector<float> logits = s.prefill(prompt);
  std::vector<int32_t> greedy;
  while (greedy.size() < 16) {
    greedy.push_back(argmax(logits.data(), m.config().vocab_size));
    if (greedy.back() == m.config().eos_token_id) break;
    if (greedy.size() < 16) logits = s.decode(greedy.back());
  }
  EXPECT_EQ(tokens, greedy);

  const std::string want = tok.decode(tokens);
  EXPECT_FALSE(want.empty());
  EXPECT_EQ(streamed.out, want + "\n");
  EXPECT_EQ(j["text"].get<std::string>(), want);

  // -f FILE is -p with the file's text (for prompts longer than an argument may be)
  test::TempDir tmp;
  const std::string file = tmp / "prompt.txt";
  std::ofstream(file, std::ios::binary) << text;
  auto from_file = test::run_dsv41("generate -m " + test::tiny_model_dir() + " -f " + file + " -n 16 --json");
  ASSERT_EQ(from_file.status, 0) << from_file.out;
  EXPECT_EQ(json::parse(from_file.out)["prompt_tokens"], j["prompt_tokens"]);
  EXPECT_EQ(json::parse(from_file.out)["tokens"], j["tokens"]);
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

// ppl through the engine gives the perplexity an independent teacher-forced run computes: window w
// is BOS + ctx-1 text tokens from token w*stride, its last `stride` tokens scored with the
// log-softmax of the logits before each, the rest prefilled as their context (tail mode too).
TEST(CliPpl, ScoresTheLastStrideOfEveryWindow) {
  test::TempDir tmp;
  const std::string file = tmp / "text.txt";
  {
    std::ofstream out(file);
    for (int i = 0; i < 20; ++i) out << "The harbor was quiet at dawn, and the boats rocked on the tide. ";
  }
  const int ctx = 40, stride = 15, chunks = 3;
  for (PrefillMode mode : {PrefillMode::Exact, PrefillMode::Tail}) {
    const std::string mode_name = mode == PrefillMode::Tail ? "tail" : "exact";
    SCOPED_TRACE(mode_name);
    auto r = test::run_dsv41("ppl -m " + test::tiny_model_dir() + " -f " + file + " --ctx " + std::to_string(ctx) +
                             " --stride " + std::to_string(stride) + " --chunks " + std::to_string(chunks) +
                             " --prefill-mode " + mode_name + " --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const json j = json::parse(r.out.substr(r.out.find('{')));
    EXPECT_EQ(j["chunks"], chunks);
    EXPECT_EQ(j["tokens_scored"], chunks * stride);

    const Model& m = test::tiny_model();
    const int64_t V = m.config().vocab_size;
    std::ifstream in(file);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::vector<int32_t> tokens = Tokenizer::from_file(test::tiny_model_dir() + "/tokenizer.json").encode(text);
    double nll = 0;
    int scored = 0;
    for (int c = 0; c < chunks; ++c) {
      std::vector<int32_t> chunk = {static_cast<int32_t>(m.config().bos_token_id)};
      chunk.insert(chunk.end(), tokens.begin() + c * stride, tokens.begin() + c * stride + ctx - 1);
      SessionOptions so;
      so.prefill_mode = mode;
      Session s(m, test::pools_for(m), so);
      std::vector<float> logits = s.prefill({chunk.begin(), chunk.begin() + (ctx - stride)});
      for (int i = ctx - stride; i < ctx; ++i) {
        double mx = *std::max_element(logits.begin(), logits.end()), z = 0;
        for (float v : logits) z += std::exp(v - mx);
        nll -= logits[static_cast<size_t>(chunk[i])] - mx - std::log(z);
        ++scored;
        if (i + 1 < ctx) logits = s.decode(chunk[i]);
      }
      ASSERT_EQ(logits.size(), static_cast<size_t>(V));
    }
    EXPECT_NEAR(j["mean_nll"].get<double>(), nll / scored, 1e-9);
    EXPECT_NEAR(j["ppl"].get<double>(), std::exp(nll / scored), 1e-6 * std::exp(nll / scored));
    EXPECT_GT(j["ppl_stderr"].get<double>(), 0);
  }

  const std::string m_arg = " -m " + test::tiny_model_dir();
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"ppl" + m_arg + " -f " + (tmp / "missing.txt"), "missing.txt: cannot be opened"},
           {"ppl" + m_arg + " -f " + file + " --ctx 2", "--ctx"},
           {"ppl" + m_arg + " -f " + file + " --ctx 40 --stride 39", "--stride"},
           {"ppl" + m_arg + " -f " + file + " --prefill-mode fast", "--prefill-mode: must be exact or tail"},
           {"ppl" + m_arg + " -f " + file + " --ctx 9999999", "--ctx: must be at most the model's context"},
           {"ppl" + m_arg, "--file: is required"}}) {
    auto bad = test::run_dsv41(args);
    EXPECT_NE(bad.status, 0) << args;
    EXPECT_NE(bad.out.find(want), std::string::npos) << args << "\n" << bad.out;
  }
  std::ofstream(tmp / "short.txt") << "Too short.";
  auto few = test::run_dsv41("ppl" + m_arg + " -f " + (tmp / "short.txt"));
  EXPECT_NE(few.out.find("fewer than one chunk"), std::string::npos) << few.out;
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
  // another model's config and tokenizer over these weights
  std::filesystem::copy(test::tiny_model_dir(), tmp / "t", std::filesystem::copy_options::recursive);
  for (const char* f : {"/config.json", "/tokenizer.json"}) {
    std::filesystem::copy_file(test::golden_dir("tiny-dense") + f, tmp / "t" + f, std::filesystem::copy_options::overwrite_existing);
  }
  std::vector<Case> cases = {
      {"generate -p hi", "--model: is required"},
      {"generate -m /nonexistent -p hi", "/nonexistent: no such file or folder"},
      {"generate" + m, "give exactly one of -p TEXT, -f FILE and --prompt-ids"},
      {"generate" + m + " -p hi --prompt-ids 1", "give exactly one"},
      {"generate" + m + " -p hi -f /dev/null", "give exactly one"},
      {"generate" + m + " -f /nonexistent/prompt.txt", "/nonexistent/prompt.txt: cannot be opened"},
      {"generate" + m + " --prompt-ids 1,x,3", "--prompt-ids: expects comma-separated non-negative token ids"},
      {"generate" + m + " --prompt-ids 1,99999", "id 99999 is outside the vocabulary of 1024"},
      {"generate" + m + " -p hi --prefill-mode fast", "--prefill-mode: must be exact or tail"},
      {"generate" + m + " -p hi --temp -1", "temperature: must be a finite number >= 0"},
      {"generate" + m + " -p hi --top-p 0", "top_p: must be in (0, 1]"},
      {"generate" + m + " -p hi -n 5000", "exceeds the model's context of 4096"},
      // another model's config: its tokenizer is refused before the weights are read
      {"generate -m " + (tmp / "m") + " -p hi", "tokenizer.json: gives an Engram compressed vocabulary"},
      {"generate -m " + (tmp / "t") + " -p hi", "tensor"},  // weights of another model
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

// Every scenario reports the lengths asked for, and each efficiency is its measured rate over the
// machine limit measured in the same run: decode's achieved bandwidth (active bytes per token × tok/s)
// over the measured bandwidth, prefill's FLOP rate over the best unit's register-only peak (tail mode does fewer
// FLOPs per prompt than exact mode), the prefix hit's speedup is cold over warm time to first token.
// Two agent sessions of three turns: each later turn finds its history in the prompt cache (all but
// the tool output and the answer before it, to the last 64-token block), and the report has both runs.
TEST(CliBench, AgentFleetReportsTheSessionsAndTheirCacheHits) {
  auto r = test::run_dsv41("bench -m " + test::tiny_model_dir() +
                           " --scenario agent-fleet --fleet-sessions 2 --fleet-turns 3 --fleet-lengths 256,40,80,12 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.find("{\n")))["agent_fleet"];
  EXPECT_EQ(j["sessions"], 2);
  for (const char* run : {"fleet", "one_at_a_time"}) {
    SCOPED_TRACE(run);
    const auto& x = j[run];
    EXPECT_GT(x["wall_seconds"].get<double>(), 0);
    EXPECT_GE(x["generated_tokens"].get<int64_t>(), 2 * 3 * 6);  // each answer at least half of 12
    EXPECT_GT(x["cached_share_after_first_turn"].get<double>(), 0.6) << x;
    EXPECT_GT(x["ttft_ms"]["p99"].get<double>(), 0);
    EXPECT_GE(x["gap_ms"]["max"].get<double>(), x["gap_ms"]["p50"].get<double>());
  }
  // the second session's first turn finds the shared system prompt (256 tokens) in the cache
  EXPECT_EQ(j["one_at_a_time"]["first_turn_cached_tokens"], 256);
  auto bad = test::run_dsv41("bench -m " + test::tiny_model_dir() + " --scenario agent-fleet --fleet-lengths 256,80,40,12");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("--fleet-lengths"), std::string::npos) << bad.out;
}

TEST(CliBench, AllScenariosReportAgainstTheMeasuredLimits) {
  test::TempDir dir;
  auto r = test::run_dsv41("bench -m " + test::tiny_model_dir() +
                           " --scenario cold-prefill,prefix-hit,decode,concurrency --lengths 64,140 --steps 2 --json --plot " +
                           (dir / "p.svg"));
  ASSERT_EQ(r.status, 0) << r.out;
  auto j = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));
  const double bandwidth = j["machine"]["bandwidth_gbs"].get<double>() * 1e9;
  const double peak = j["machine"]["peak_gflops"].get<double>() * 1e9;
  EXPECT_GT(bandwidth, 0.1e9);
  EXPECT_GT(peak, 0.1e9);
  EXPECT_GE(j["machine"]["cores"].get<int>(), 1);
  EXPECT_FALSE(j["machine"]["isa"].get<std::string>().empty());
  // the indexer's unit: integers wherever an AVX-512 level runs on a CPU with VNNI
  const Isa level = parse_isa(j["machine"]["isa"].get<std::string>(), "report");
  EXPECT_EQ(j["machine"]["index_score_unit"],
            cpu_features().avx512_vnni && level >= Isa::avx512 ? "avx512_vnni_int8" : "fp32");
  const auto near = [](double a, double b) { return std::fabs(a - b) <= 1e-9 * std::fabs(b); };

  // the tiny checkpoint's weight bytes: one decode token reads less than all of them (top-2 of the
  // routed experts, a few Engram rows) and more than 1 MB
  double checkpoint_bytes = 0;
  for (const auto& e : std::filesystem::directory_iterator(test::tiny_model_dir())) {
    if (e.path().extension() == ".safetensors") checkpoint_bytes += static_cast<double>(e.file_size());
  }
  ASSERT_EQ(j["decode"].size(), 2u);
  const double active = j["decode"][0]["active_bytes_per_token"].get<double>();
  EXPECT_GT(active, 1e6);
  EXPECT_LT(active, checkpoint_bytes);
  for (size_t i = 0; i < 2; ++i) {
    const auto& d = j["decode"][i];
    EXPECT_EQ(d["context"], i == 0 ? 64 : 140);
    EXPECT_EQ(d["active_bytes_per_token"].get<double>(), active);  // a property of the model, not the context
    EXPECT_GT(d["tok_s"].get<double>(), 0);
    EXPECT_TRUE(near(d["bandwidth_efficiency"].get<double>(), active * d["tok_s"].get<double>() / bandwidth)) << d;
  }

  ASSERT_EQ(j["cold_prefill"].size(), 4u);  // two lengths × exact, tail
  // FLOPs of a prompt = efficiency × peak × seconds, and seconds = prompt tokens / tok_s
  const auto flops = [&](const nlohmann::json& d) {
    return d["flops_efficiency"].get<double>() * peak * d["prompt_tokens"].get<double>() / d["tok_s"].get<double>();
  };
  for (size_t i = 0; i < 4; i += 2) {
    const auto &exact = j["cold_prefill"][i], &tail = j["cold_prefill"][i + 1];
    EXPECT_EQ(exact["prompt_tokens"], i == 0 ? 64 : 140);
    EXPECT_EQ(tail["prompt_tokens"], exact["prompt_tokens"]);
    EXPECT_EQ(exact["mode"], "exact");
    EXPECT_EQ(tail["mode"], "tail");
    // tail mode runs the late layers on the window only: measured 0.73 (64 tokens) and 0.68 (140)
    // of exact mode's FLOPs on the tiny model
    EXPECT_GT(flops(exact), 0);
    EXPECT_LT(flops(tail), 0.9 * flops(exact)) << "the late layers run on the window only";
  }
  // The FLOPs include the indexer's and the attention's, which grow with the context (context_flops,
  // counted by hand in synthetic_checkpoint_test.cpp); the weights' part is the rest ...
  const ModelConfig& config = test::tiny_model().config();
  const auto& cp = j["cold_prefill"];
  for (const auto& d : cp) {
    EXPECT_TRUE(near(d["flops"].get<double>(), flops(d))) << d;
    const double share = d["context_flops_share"].get<double>();
    EXPECT_DOUBLE_EQ(share * d["flops"].get<double>(),
                     context_flops(config, d["prompt_tokens"].get<int64_t>(), d["mode"] == "tail")) << d;
  }
  const auto weight_flops = [&](const nlohmann::json& d) {
    return d["flops"].get<double>() * (1 - d["context_flops_share"].get<double>());
  };
  // ... and what tail mode saves of it grows with the rows past the window: (140 − W) / (64 − W)
  const double W = static_cast<double>(config.window_size);
  EXPECT_NEAR((weight_flops(cp[2]) - weight_flops(cp[3])) / (weight_flops(cp[0]) - weight_flops(cp[1])),
              (140 - W) / (64 - W), 1e-6);

  ASSERT_EQ(j["prefix_hit"].size(), 4u);  // ram/disk × exact/replay
  for (size_t i = 0; i < 4; ++i) {
    const auto& d = j["prefix_hit"][i];
    EXPECT_EQ(d["tier"], i < 2 ? "ram" : "disk");
    EXPECT_EQ(d["mode"], i % 2 == 0 ? "exact" : "replay");
    EXPECT_EQ(d["prompt_tokens"], 140);
    EXPECT_EQ(d["cached_tokens"], 64);  // 90% of 140 = 126 -> one whole 64-token block
    EXPECT_GT(d["ttft_s"].get<double>(), 0);
    EXPECT_TRUE(near(d["speedup"].get<double>(), d["cold_ttft_s"].get<double>() / d["ttft_s"].get<double>())) << d;
  }

  ASSERT_EQ(j["concurrency"].size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(j["concurrency"][i]["streams"], 1 << i);
    EXPECT_GT(j["concurrency"][i]["aggregate_tok_s"].get<double>(), 0);
  }

  // the plot: decode and both prefill modes as lines, and the decode roofline
  std::ifstream svg(dir / "p.svg");
  std::string text((std::istreambuf_iterator<char>(svg)), {});
  EXPECT_NE(text.find("<svg"), std::string::npos);
  size_t lines = 0;
  for (size_t at = text.find("<polyline"); at != std::string::npos; at = text.find("<polyline", at + 1)) ++lines;
  EXPECT_EQ(lines, 3u);
  EXPECT_NE(text.find("decode roofline"), std::string::npos);
}

// The long-context scenario on the long preset at lengths CI can afford: every length asked for, in
// the JSON layout documented in `bench --help`; the prefix hit restores the whole history asked for
// (a multiple of the cache block) and computes only the new tokens, so it beats the cold prefill of
// the same prompt on every tier and mode; the plot is cost per token with decode's floor. A model
// without the positions is refused before anything runs, naming what it has.
TEST(CliBench, LongContextReportsTheAgentsShape) {
  test::TempDir dir;
  auto r = test::run_dsv41("bench -m " + test::long_model_dir() +
                           " --scenario long-context --long-prefill 512,2048 --long-decode 256,2048 --long-cached 2048"
                           " --long-new 64 --steps 4 --json --plot " + (dir / "lc.svg"));
  ASSERT_EQ(r.status, 0) << r.out;
  auto j = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));
  const auto& lc = j["long_context"];
  ASSERT_EQ(lc["prefill"].size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const auto& p = lc["prefill"][i];
    EXPECT_EQ(p["prompt_tokens"], i < 2 ? 512 : 2048) << p;
    EXPECT_EQ(p["mode"], i % 2 == 0 ? "exact" : "tail") << p;
    EXPECT_GT(p["tok_s"].get<double>(), 0) << p;
    EXPECT_GT(p["flops_efficiency"].get<double>(), 0) << p;
    EXPECT_LT(p["flops_efficiency"].get<double>(), 1.1) << "above the register-only peak: a miscount " << p;
  }
  ASSERT_EQ(lc["decode"].size(), 2u);
  EXPECT_EQ(lc["decode"][0]["context"], 256);
  EXPECT_EQ(lc["decode"][1]["context"], 2048);
  for (const auto& d : lc["decode"]) EXPECT_GT(d["tok_s"].get<double>(), 0) << d;
  ASSERT_EQ(lc["prefix_hit"].size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const auto& h = lc["prefix_hit"][i];
    EXPECT_EQ(h["tier"], i < 2 ? "ram" : "disk") << h;
    EXPECT_EQ(h["mode"], i % 2 == 0 ? "exact" : "replay") << h;
    EXPECT_EQ(h["cached_tokens"], 2048) << h;
    EXPECT_EQ(h["new_tokens"], 64) << h;
    // 64 new tokens (and a replay of the window) against 2112 cold ones: measured 10-30x here
    EXPECT_GT(h["speedup"].get<double>(), 2) << h;
    EXPECT_DOUBLE_EQ(h["speedup"].get<double>(), h["cold_ttft_s"].get<double>() / h["ttft_s"].get<double>()) << h;
  }
  std::ifstream svg(dir / "lc.svg");
  const std::string text((std::istreambuf_iterator<char>(svg)), {});
  size_t lines = 0;
  for (size_t at = text.find("<polyline"); at != std::string::npos; at = text.find("<polyline", at + 1)) ++lines;
  EXPECT_EQ(lines, 3u) << text;
  EXPECT_NE(text.find("ms per token"), std::string::npos);
  EXPECT_NE(text.find("decode floor"), std::string::npos);

  // the saved report redraws the run's own plot, byte for byte (--from-report measures nothing)
  {
    std::ofstream(dir / "lc.json") << r.out.substr(r.out.find("{\n"));
  }
  auto redrawn = test::run_dsv41("bench --from-report " + (dir / "lc.json") + " --plot " + (dir / "again.svg"));
  ASSERT_EQ(redrawn.status, 0) << redrawn.out;
  std::ifstream again(dir / "again.svg");
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(again)), {}), text);

  auto short_model = test::run_dsv41("bench -m " + test::tiny_model_dir() + " --scenario long-context");
  EXPECT_NE(short_model.status, 0);
  EXPECT_NE(short_model.out.find("needs 33024 positions but the model has 4096"), std::string::npos) << short_model.out;

  // --long-parts runs the parts named, alone (a large checkpoint's scenario split over runs); the
  // positions asked of the model are those of the parts that run
  auto decode_only = test::run_dsv41("bench -m " + test::tiny_model_dir() +
                                     " --scenario long-context --long-parts decode --long-decode 256,1024 --steps 2 --json");
  ASSERT_EQ(decode_only.status, 0) << decode_only.out;
  const auto d = nlohmann::json::parse(decode_only.out.substr(decode_only.out.find("{\n")))["long_context"];
  EXPECT_FALSE(d.contains("prefill")) << d;
  EXPECT_FALSE(d.contains("prefix_hit")) << d;
  ASSERT_EQ(d["decode"].size(), 2u) << d;
  EXPECT_EQ(d["decode"][1]["context"], 1024);
  for (const char* bad : {"decode,nothing", ","}) {
    auto refused = test::run_dsv41("bench -m " + test::tiny_model_dir() + " --scenario long-context --long-parts '" + bad + "'");
    EXPECT_NE(refused.status, 0) << bad;
    EXPECT_NE(refused.out.find("--long-parts"), std::string::npos) << refused.out;
  }

  // --long-hits measures only the tier/mode pairs named (each one prefills the cached history)
  auto one_hit = test::run_dsv41("bench -m " + test::tiny_model_dir() +
                                 " --scenario long-context --long-parts prefix-hit --long-cached 512 --long-new 32"
                                 " --long-hits disk/replay --json");
  ASSERT_EQ(one_hit.status, 0) << one_hit.out;
  const auto p = nlohmann::json::parse(one_hit.out.substr(one_hit.out.find("{\n")))["long_context"];
  EXPECT_FALSE(p.contains("decode")) << p;
  ASSERT_EQ(p["prefix_hit"].size(), 1u) << p;
  EXPECT_EQ(p["prefix_hit"][0]["tier"], "disk");
  EXPECT_EQ(p["prefix_hit"][0]["mode"], "replay");
  EXPECT_GT(p["prefix_hit"][0]["cached_tokens"].get<int64_t>(), 0) << p;
  for (const char* bad : {"ram", "ram/fast", "gpu/exact", ","}) {
    auto refused = test::run_dsv41("bench -m " + test::tiny_model_dir() +
                                   " --scenario long-context --long-parts prefix-hit --long-hits '" + bad + "'");
    EXPECT_NE(refused.status, 0) << bad;
    EXPECT_NE(refused.out.find("--long-hits"), std::string::npos) << bad << ": " << refused.out;
  }
}

// A report's plot, drawn from a saved report with known figures: every measured point marked on its
// line, ticks labelled where the axes cross 1, 2 and 5 times a power of ten, the decode floor at
// active bytes over bandwidth (1e8 B / 1e10 B/s = 10 ms). What cannot be plotted is refused, naming
// the flag or the file, and a scenario with nothing to plot is refused before anything is measured.
TEST(CliBench, PlotFromASavedReport) {
  test::TempDir dir;
  nlohmann::json report = {{"machine", {{"bandwidth_gbs", 10.0}}}, {"long_context", nlohmann::json::object()}};
  for (int64_t n : {2048, 8192, 32768}) {
    report["long_context"]["prefill"].push_back({{"prompt_tokens", n}, {"mode", "exact"}, {"tok_s", 40.0}});
    report["long_context"]["prefill"].push_back({{"prompt_tokens", n}, {"mode", "tail"}, {"tok_s", 50.0}});
  }
  for (int64_t c : {1024, 8192, 32768}) {
    report["long_context"]["decode"].push_back({{"context", c}, {"tok_s", 5.0}, {"active_bytes_per_token", 1e8}});
  }
  std::ofstream(dir / "report.json") << report.dump(2);
  auto r = test::run_dsv41("bench --from-report " + (dir / "report.json") + " --plot " + (dir / "p.svg"));
  ASSERT_EQ(r.status, 0) << r.out;
  std::ifstream svg(dir / "p.svg");
  const std::string text((std::istreambuf_iterator<char>(svg)), {});
  auto count = [&](const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("<polyline"), 3u) << text;
  EXPECT_EQ(count("<circle"), 9u) << text;
  // x spans 1024 / 1.5 to 32768 * 1.5: ticks at 1k, 2k, 5k, 10k, 20k; y spans 10 / 3 to 200 * 3 ms
  for (const char* tick : {">1k<", ">2k<", ">5k<", ">10k<", ">20k<", ">10<", ">100<"}) {
    EXPECT_EQ(count(tick), 1u) << tick << "\n" << text;
  }
  EXPECT_EQ(count(">50k<"), 0u) << text;
  EXPECT_NE(text.find("decode floor"), std::string::npos) << text;

  const std::string svg_out = " --plot " + (dir / "bad.svg");
  report["long_context"]["decode"][1]["tok_s"] = 0.0;
  std::ofstream(dir / "zero.json") << report.dump();
  std::ofstream(dir / "text.json") << "measured: 5 tok/s";
  std::ofstream(dir / "other.json") << R"({"machine": {"cores": 2}})";
  const std::pair<std::string, std::string> refused[] = {
      {"bench --from-report " + (dir / "report.json"), "--plot"},
      {"bench --from-report " + (dir / "report.json") + " -m /nowhere" + svg_out, "takes no --model"},
      {"bench --from-report " + (dir / "missing.json") + svg_out, "missing.json"},
      {"bench --from-report " + (dir / "text.json") + svg_out, "text.json: is not valid JSON"},
      {"bench --from-report " + (dir / "other.json") + svg_out, "other.json: is not a report of bench --json"},
      {"bench --from-report " + (dir / "zero.json") + svg_out, "cannot place the point"},
      {"bench --from-report " + (dir / "report.json") + " --plot " + (dir / "no/such/folder/p.svg"), "no/such/folder"},
      {"bench -m " + test::tiny_model_dir() + " --scenario long-context --long-parts prefix-hit" + svg_out,
       "--plot: draws prefill and decode"},
      {"bench -m " + test::tiny_model_dir() + " --scenario gemm" + svg_out, "--plot: draws prefill and decode"},
  };
  for (const auto& [command, named] : refused) {
    auto bad = test::run_dsv41(command);
    EXPECT_NE(bad.status, 0) << command;
    EXPECT_NE(bad.out.find(named), std::string::npos) << command << ": " << bad.out;
    EXPECT_EQ(bad.out.find("measuring the machine"), std::string::npos) << command << ": refused after measuring";
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "bad.svg"));
}

// vision-encode dumps each stage of one image in the golden's files: the pixels and patches are the
// reference's bytes, the ViT and aligner rows within the 1.5% the goldens allow; its plan is the
// reference's. generate --image fills the prompt's placeholders in order and reports the expanded
// length; the reference's greedy tokens of tiny-vision's p3 come out. Mismatched placeholders and
// unreadable images are errors naming what is wrong.
TEST(CliVision, VisionEncodeDumpsTheReferencesStagesAndGenerateTakesImages) {
  const std::string model = test::golden_dir("tiny-vision");
  const nlohmann::json meta = nlohmann::json::parse(std::ifstream(model + "/golden.json"));
  const auto read_bytes = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  const auto floats = [&](const std::string& path) {
    const std::string b = read_bytes(path);
    std::vector<float> v(b.size() / sizeof(float));
    std::memcpy(v.data(), b.data(), v.size() * sizeof(float));
    return v;
  };
  const auto rel_l2 = [](const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < b.size(); ++i) {
      num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
      den += static_cast<double>(b[i]) * b[i];
    }
    return std::sqrt(num / den);
  };
  test::TempDir dir;
  for (const std::string name : {"b", "c"}) {
    const nlohmann::json& image = meta["images"][name];
    const std::string out = dir / name;
    auto r = test::run_dsv41("vision-encode -m " + model + " --image " + model + "/" + image["png"].get<std::string>() +
                             " --dump " + out + " --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const auto plan = nlohmann::json::parse(r.out.substr(r.out.find("{")));
    EXPECT_EQ(plan["n_vit_hw"], image["n_vit_hw"]) << plan;
    EXPECT_EQ(plan["num_tokens"], image["num_tokens"]) << plan;
    EXPECT_EQ(read_bytes(out + "/resized.u8"), read_bytes(model + "/" + image["resized_u8"]["file"].get<std::string>()));
    EXPECT_EQ(read_bytes(out + "/patches.f32"), read_bytes(model + "/" + image["patches"]["file"].get<std::string>()));
    for (const auto& [file, golden] : {std::pair{"vit.f32", "vit"}, std::pair{"aligner.f32", "aligner"}}) {
      const std::vector<float> ours = floats(out + "/" + file), want = floats(model + "/" + image[golden]["file"].get<std::string>());
      ASSERT_EQ(ours.size(), want.size()) << file;
      EXPECT_LE(rel_l2(ours, want), 0.015) << name << " " << file;
    }
  }
  const nlohmann::json& p3 = meta["prompts"]["p3"];
  std::string ids;
  for (const auto& id : p3["prompt_ids"]) ids += (ids.empty() ? "" : ",") + std::to_string(id.get<int>());
  const std::string image_a = model + "/" + meta["images"]["a"]["png"].get<std::string>();
  auto gen = test::run_dsv41("generate -m " + model + " --prompt-ids " + ids + " --image " + image_a +
                             " -n 8 --temp 0 --ignore-eos --json");
  ASSERT_EQ(gen.status, 0) << gen.out;
  const auto g = nlohmann::json::parse(gen.out.substr(gen.out.find("{")));
  EXPECT_EQ(g["prompt_tokens"], p3["length"]) << g;
  EXPECT_EQ(g["tokens"], p3["greedy"]["tokens"]) << g;
  expect_errors({{"generate -m " + model + " --prompt-ids " + ids + " -n 1", "image"},
                 {"generate -m " + model + " --prompt-ids " + ids + " --image " + image_a + " --image " + image_a + " -n 1",
                  "image"},
                 {"generate -m " + model + " --prompt-ids " + ids + " --image " + (dir / "missing.png") + " -n 1",
                  "missing.png"},
                 {"vision-encode -m " + test::tiny_model_dir() + " --image " + image_a + " --dump " + (dir / "x"),
                  "no vision tower"}});
}

// make-tiny --vision writes a tower (tiny-vision's geometry on the tiny preset, every layer's bias_vl)
// that the engine loads and feeds an image through; the vision scenario plans each image as the
// reference does (tiny-vision's README: pixel size, ViT patches, span tokens of its three images) and
// reports the tower's rate against the register-only peak, never above it. A checkpoint without a
// tower is refused by name.
TEST(CliBench, VisionScenarioRunsAMadeTower) {
  test::TempDir dir;
  const std::string model = dir / "vision";
  auto made = test::run_dsv41("make-tiny --out " + model + " --vision");
  ASSERT_EQ(made.status, 0) << made.out;
  auto gen = test::run_dsv41("generate -m " + model + " -p '<｜deepseek_image｜>\n\nWhat is it?' --image " +
                             test::golden_dir("tiny-vision") + "/images/a_gradient_100x60.png -n 3 --temp 0 --json");
  ASSERT_EQ(gen.status, 0) << gen.out;
  const auto g = nlohmann::json::parse(gen.out.substr(gen.out.find("{")));
  EXPECT_EQ(g["images"], 1) << g;
  EXPECT_GT(g["prompt_tokens"].get<int64_t>(), 17) << "the placeholder became a 17-position span" << g;

  auto r = test::run_dsv41("bench -m " + model + " --scenario vision --image-sizes 100x60,200x260,400x300 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));
  const auto& v = j["vision"];
  ASSERT_EQ(v.size(), 3u) << j;
  const std::array<std::tuple<const char*, int, int>, 3> plans = {
      std::tuple{"168x98", 84, 17}, std::tuple{"210x266", 285, 44}, std::tuple{"280x210", 300, 42}};
  for (size_t i = 0; i < 3; ++i) {
    const auto& [resized, patches, tokens] = plans[i];
    EXPECT_EQ(v[i]["resized"], resized) << v[i];
    EXPECT_EQ(v[i]["vit_patches"], patches) << v[i];
    EXPECT_EQ(v[i]["image_tokens"], tokens) << v[i];
    EXPECT_GT(v[i]["image_tokens_s"].get<double>(), 0) << v[i];
    EXPECT_DOUBLE_EQ(v[i]["image_tokens_s"].get<double>(), tokens / v[i]["seconds"].get<double>()) << v[i];
    EXPECT_GT(v[i]["flops_efficiency"].get<double>(), 0) << v[i];
    EXPECT_LT(v[i]["flops_efficiency"].get<double>(), 1.1) << "above the register-only peak: a miscount " << v[i];
  }
  expect_errors({{"bench -m " + test::tiny_model_dir() + " --scenario vision", "has no vision tower"},
                 {"bench -m " + model + " --scenario vision --image-sizes 10x", "expects comma-separated WxH"},
                 {"make-tiny --out " + (dir / "x") + " --preset stream --vision", "--vision"}});
}

// The peaks are the hardware's, one per unit the CPU has, and consistent with themselves: all cores
// at least one core, at most cores × one core; the GEMM rows are the kernels' measured rates at the
// released shapes, at every SIMD level the machine runs, over the best peak and over the peak of the
// unit each level computes on, and never above either.
TEST(CliBench, GemmIsReportedAgainstTheRegisterOnlyPeaks) {
  auto r = test::run_dsv41("bench -m " + test::tiny_model_dir() + " --scenario gemm --gemm-rows 1,16 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  auto j = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));
  const auto& machine = j["machine"];
  const auto& peaks = machine["peaks"];
  ASSERT_TRUE(peaks.is_object() && !peaks.empty()) << machine;
  const CpuFeatures& f = cpu_features();
  EXPECT_EQ(peaks.contains("avx2_fp32_fma"), f.avx2) << peaks;
  EXPECT_EQ(peaks.contains("avx512_fp32_fma"), f.avx512) << peaks;
  EXPECT_EQ(peaks.contains("avx512_bf16"), f.avx512_bf16) << peaks;
  if (peaks.contains("amx_bf16")) {
    EXPECT_TRUE(f.amx_bf16);  // present only where Linux granted the tiles
  }
  const int cores = machine["cores"].get<int>();
  double best = 0;
  std::string best_unit;
  for (const auto& [unit, g] : peaks.items()) {
    const double all = g.get<double>(), one = machine["peaks_per_core"][unit].get<double>();
    EXPECT_GT(one, 0.5) << unit;  // any vector unit does far more than 0.5 GFLOP/s per core
    EXPECT_GE(all, 0.8 * one) << unit;
    EXPECT_LE(all, 1.25 * one * cores) << unit;
    if (all > best) best = all, best_unit = unit;
  }
  EXPECT_EQ(machine["peak_gflops"].get<double>(), best);
  EXPECT_EQ(machine["peak_unit"], best_unit);

  // every SIMD level the machine runs, the engine's own first, then the others lowest first
  std::vector<std::string> levels{isa_name(default_isa())};
  for (const Isa l : available_backend_levels()) {
    if (l != Isa::scalar && l != default_isa()) levels.push_back(isa_name(l));
  }
  const auto& gemm = j["gemm"];
  ASSERT_EQ(gemm.size(), 6u * levels.size());  // three released shapes × two row counts per level
  const std::pair<std::string, std::array<int64_t, 2>> shapes[] = {
      {"linear_fp8", {2304, 5120}}, {"linear_fp4", {2304, 5120}}, {"linear_fp4", {5120, 2304}}};
  const std::map<std::string, std::string> unit_of = {
      {"avx2", "avx2_fp32_fma"}, {"avx512", "avx512_fp32_fma"}, {"avx512_bf16", "avx512_bf16"}, {"amx_bf16", "amx_bf16"}};
  for (size_t i = 0; i < gemm.size(); ++i) {
    const auto& g = gemm[i];
    EXPECT_EQ(g["level"], levels[i / 6]) << g;
    EXPECT_EQ(g["kernel"], shapes[(i % 6) / 2].first);
    EXPECT_EQ(g["n"], shapes[(i % 6) / 2].second[0]);
    EXPECT_EQ(g["k"], shapes[(i % 6) / 2].second[1]);
    EXPECT_EQ(g["m"], i % 2 == 0 ? 1 : 16);
    EXPECT_GT(g["gflops"].get<double>(), 0) << g;
    EXPECT_DOUBLE_EQ(g["efficiency"].get<double>(), g["gflops"].get<double>() / best) << g;
    const std::string unit = unit_of.at(g["level"].get<std::string>());
    ASSERT_EQ(g["unit"], unit) << g;
    EXPECT_DOUBLE_EQ(g["unit_efficiency"].get<double>(), g["gflops"].get<double>() / peaks[unit].get<double>()) << g;
    // No kernel runs above its unit's peak. The bound is the one-core peak times the cores: an
    // all-core figure measured while other tests share the cores can be far below the machine's (a
    // GEMM at 1.19 and 1.30 of one was seen under ctest -j2 with other jobs running).
    EXPECT_LT(g["gflops"].get<double>(), 1.1 * cores * machine["peaks_per_core"][unit].get<double>())
        << "a kernel above the register-only peak of the unit it computes on means a miscounted peak: " << g;
    // Where the build has a library (oneDNN), every row sets the library's rate at its shape beside ours.
    ASSERT_EQ(g.contains("library"), gemm[0].contains("library")) << g;
    if (g.contains("library")) {
      EXPECT_EQ(g["library"].get<std::string>().rfind("oneDNN ", 0), 0u) << g;
      EXPECT_GT(g["library_gflops"].get<double>(), 0) << g;
      EXPECT_DOUBLE_EQ(g["over_library"].get<double>(), g["gflops"].get<double>() / g["library_gflops"].get<double>());
      if (i >= 6) {  // one library figure per shape and row count, the same for every level
        EXPECT_EQ(g["library_gflops"], gemm[i % 6]["library_gflops"]) << g;
      }
    }
  }
  auto bad = test::run_dsv41("bench -m " + test::tiny_model_dir() + " --scenario gemm --gemm-rows 16,x");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("--gemm-rows: expects comma-separated counts, got \"x\""), std::string::npos) << bad.out;
}

// dsv41 chat: each turn renders the whole history, so the second turn finds the first turn's prompt
// in the prefix cache; /reset starts over; Ctrl-C stops the answer being written (twice here) and
// the program takes the next message, then leaves cleanly.
TEST(CliChat, TurnsReuseTheCacheAndCtrlCStopsOnlyTheAnswer) {
  const std::string first =
      "Hello there, this is a long first message that takes more than sixty four tokens once the chat template "
      "has rendered it and the tiny tokenizer has split it, so the prefix cache keeps at least one block of it.";
  test::TempDir dir;
  const std::string turns = dir / "turns.txt";
  std::ofstream(turns) << first << "\nsecond\n/reset\n/bogus\nthird\n";
  const auto r = test::run_dsv41("chat -m " + test::tiny_model_dir() + " --max-tokens 4 < '" + turns + "'");
  ASSERT_EQ(r.status, 0) << r.out;
  std::vector<long> cached;
  for (size_t at = r.out.find(" cached, "); at != std::string::npos; at = r.out.find(" cached, ", at + 1)) {
    const size_t comma = r.out.rfind(", ", at - 1);
    cached.push_back(std::stol(r.out.substr(comma + 2, at - comma - 2)));
  }
  ASSERT_EQ(cached.size(), 3u) << r.out;
  EXPECT_EQ(cached[0], 0);
  EXPECT_GE(cached[1], 64) << "the second turn did not reuse the first turn's prompt";
  EXPECT_NE(r.out.find("[new conversation]"), std::string::npos);
  EXPECT_NE(r.out.find("[unknown command /bogus"), std::string::npos);

  // Ctrl-C during a long answer: that answer stops, the next message is answered, the exit is clean
  const std::string fifo = dir / "in", out = dir / "out";
  // (the script goes to popen's shell inside double quotes: its own $ must be escaped)
  const std::string script = "mkfifo '" + fifo + "'; '" + test::dsv41_binary() + "' chat -m '" + test::tiny_model_dir() +
                             "' --max-tokens 3000 --ignore-eos --thinking off < '" + fifo + "' > '" + out +
                             "' 2>&1 & p=\\$!; exec 3>'" + fifo + "'; echo first >&3; while [ ! -s '" + out + "' ]; do sleep 0.05; done; "
                             "sleep 0.3; kill -INT \\$p; sleep 0.3; echo second >&3; sleep 0.8; kill -INT \\$p; sleep 0.3; "
                             "echo /exit >&3; wait \\$p; echo rc=\\$?";
  FILE* sh = popen(("/bin/sh -c \"" + script + "\"").c_str(), "r");
  ASSERT_NE(sh, nullptr);
  std::string rc;
  char buf[256];
  while (std::fgets(buf, sizeof buf, sh) != nullptr) rc += buf;
  pclose(sh);
  std::ifstream f(out);
  const std::string text((std::istreambuf_iterator<char>(f)), {});
  EXPECT_NE(rc.find("rc=0"), std::string::npos) << rc << text;
  std::vector<long> generated;
  for (size_t at = text.find(" generated, "); at != std::string::npos; at = text.find(" generated, ", at + 1)) {
    const size_t comma = text.rfind(", ", at - 1);
    generated.push_back(std::stol(text.substr(comma + 2, at - comma - 2)));
  }
  ASSERT_EQ(generated.size(), 2u) << "both messages were answered: " << text.substr(text.size() > 2000 ? text.size() - 2000 : 0);
  size_t stopped = 0;
  for (size_t at = text.find("[stopped]"); at != std::string::npos; at = text.find("[stopped]", at + 1)) ++stopped;
  EXPECT_EQ(stopped, 2u) << "each Ctrl-C stopped the answer being written";
  for (long g : generated) {
    EXPECT_GT(g, 0);
    EXPECT_LT(g, 3000) << "an answer ran to its end through a Ctrl-C";
  }
}

// serve's access flags are checked before the model loads, each error naming its flag.
TEST(CliServe, AccessFlagsAreValidated) {
  test::TempDir dir;
  const std::string m = "serve -m " + test::tiny_model_dir() + " --port 0 ";
  const std::string empty_key = dir / "empty.key";
  std::ofstream(empty_key) << "  \n";
  const std::pair<std::string, std::string> cases[] = {
      {"--served-model-name ''", "--served-model-name: needs at least one name"},
      {"--served-model-name 'a,,b'", "--served-model-name: has an empty name"},
      {"--served-model-name 'a b'", "--served-model-name: names must be printable ASCII without spaces"},
      {"--cors-origins ','", "--cors-origins: has an empty name"},
      {"--api-key-file '" + (dir / "missing.key") + "'", "cannot read the API key file"},
      {"--api-key-file '" + empty_key + "'", "the API key file's first line is empty"},
      {"--api-key k --api-key-file '" + empty_key + "'", "--api-key-file: give --api-key or --api-key-file, not both"},
      {"--api-key ''", "--api-key: the key is empty"},
      {"--max-connections 0", "--max-connections"},
      {"--request-timeout -1", "--request-timeout"},
      {"--special-tokens-in bot", "--special-tokens-in: unknown role \"bot\""},
      {"--special-tokens-in system,", "--special-tokens-in: unknown role \"\""},
  };
  for (const auto& [flags, message] : cases) {
    const auto r = test::run_dsv41(m + flags);
    EXPECT_EQ(r.status, 1) << flags << ": " << r.out;
    EXPECT_NE(r.out.find(message), std::string::npos) << flags << ": " << r.out;
  }
}

}  // namespace
}  // namespace dsv41
