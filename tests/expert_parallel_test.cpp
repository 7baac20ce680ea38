// `mpirun -np N dsv41 generate|serve|bench ... --expert-parallel` against the single process: each
// rank holds 1/N of the routed experts and Engram rows, and the greedy tokens and every logit are the
// single process's, bit for bit (the experts compute the same rows in the same batches, rank 0 sums
// them in the same order).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "model/synthetic_checkpoint.h"
#include "serve_process.h"
#include "server_util.h"
#include "test_util.h"

namespace dsv41 {
namespace {

using nlohmann::json;

// mpirun as the tests' machines allow it: as root (CI), more ranks than cores, no pinning (a rank's
// worker threads may use every core).
std::string mpirun(int ranks) {
  return "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe --bind-to none -np " +
         std::to_string(ranks) + " ";
}

test::CommandResult run_mpi(int ranks, const std::string& args) {
  return test::run_shell(mpirun(ranks) + test::dsv41_binary() + " " + args + " --expert-parallel");
}

// The process of `rank` among mpirun's children (its environment names the rank), or -1.
pid_t rank_of(pid_t launcher, int rank) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(line.substr(close + 2));
    std::string state;
    pid_t parent = 0;
    fields >> state >> parent;
    if (parent != launcher) continue;
    std::ifstream env(entry.path() / "environ", std::ios::binary);
    const std::string vars{std::istreambuf_iterator<char>(env), std::istreambuf_iterator<char>()};
    if (vars.find("OMPI_COMM_WORLD_RANK=" + std::to_string(rank) + '\0') != std::string::npos) return std::stoi(name);
  }
  return -1;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The JSON line of a generate --json run's output (MPI may print around it).
json json_line(const std::string& out) {
  const size_t at = out.find("{\"");
  if (at == std::string::npos) return json();
  return json::parse(out.substr(at, out.find('\n', at) - at), nullptr, false);
}

// A prompt of 40 ids prefilled in chunks of 16, then 12 greedy tokens.
const std::string kGenerate = "--prompt-ids 5,9,14,200,31,7,7,80,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,"
                              "21,22,23,24,25,26,27,28,29,30,31,32 -n 12 --chunk 16 --json";

TEST(ExpertParallel, TwoAndFourRanksGiveTheSingleProcessLogitsBitForBit) {
  test::TempDir out;
  const std::string model = "-m '" + test::tiny_model_dir() + "' ";
  const test::CommandResult single = test::run_dsv41("generate " + model + kGenerate + " --dump-logits " + out / "single");
  ASSERT_EQ(single.status, 0) << single.out;
  const json want = json_line(single.out);
  ASSERT_TRUE(want.contains("tokens")) << single.out;
  const std::string want_logits = file_bytes(out / "single");
  ASSERT_GT(want_logits.size(), 1000u);
  for (int ranks : {2, 4}) {
    const std::string dump = out / ("ranks" + std::to_string(ranks));
    const test::CommandResult r = run_mpi(ranks, "generate " + model + kGenerate + " --dump-logits " + dump);
    ASSERT_EQ(r.status, 0) << r.out;
    const json got = json_line(r.out);
    ASSERT_TRUE(got.contains("tokens")) << r.out;
    EXPECT_EQ(got["tokens"], want["tokens"]) << ranks << " ranks";
    EXPECT_TRUE(file_bytes(dump) == want_logits) << ranks << " ranks: the logits differ";
    // the exchange really ran: every MoE layer of every forward, every Engram lookup, bytes moved
    const json& x = got["expert_parallel"];
    EXPECT_EQ(x["ranks"], ranks);
    EXPECT_GT(x["moe_layers"].get<int64_t>(), 0);
    EXPECT_GT(x["engram_lookups"].get<int64_t>(), 0);
    EXPECT_GT(x["exchanged_bytes"].get<int64_t>(), 0);
  }
}

// DSpark's drafts and the target's verification run through the same exchange (the drafter's MoE
// blocks are split like the backbone's): the tokens of plain greedy decoding.
TEST(ExpertParallel, SpeculativeDecodingGivesThePlainTokens) {
  const std::string model = "-m '" + test::tiny_model_dir() + "' ";
  const test::CommandResult plain = test::run_dsv41("generate " + model + kGenerate);
  ASSERT_EQ(plain.status, 0) << plain.out;
  const test::CommandResult spec =
      run_mpi(2, "generate " + model + kGenerate + " --speculative dspark --acceptance-guard off");
  ASSERT_EQ(spec.status, 0) << spec.out;
  const json got = json_line(spec.out);
  ASSERT_TRUE(got.contains("spec")) << spec.out;
  EXPECT_GT(got["spec"]["verify_steps"].get<int64_t>(), 0);
  EXPECT_EQ(got["tokens"], json_line(plain.out)["tokens"]);
}

TEST(ExpertParallel, ARankCountThatDoesNotSplitTheExpertsIsRefused) {
  // the tiny preset has 8 routed experts per layer: 3 ranks cannot hold equal shares
  const test::CommandResult r = run_mpi(3, "generate -m '" + test::tiny_model_dir() + "' --prompt-ids 1,2,3 -n 2");
  EXPECT_NE(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("does not split into 3 equal parts"), std::string::npos) << r.out;
  // and a command that has no expert-parallel form says so
  const test::CommandResult inspect = test::run_dsv41("inspect '" + test::tiny_model_dir() + "' --expert-parallel");
  EXPECT_EQ(inspect.status, 1);
  EXPECT_NE(inspect.out.find("only generate, serve and bench"), std::string::npos) << inspect.out;
}

// Every rank must read the same checkpoint: a job whose rank 1 was pointed at other weights (MPI's
// multiple-program form) is refused by rank 0 before anything runs, naming the rank.
TEST(ExpertParallel, ARankWithAnotherCheckpointIsRefused) {
  test::TempDir other;
  write_synthetic_checkpoint(other.path(), "tiny", 1);
  const auto generate = [](const std::string& dir) {
    return test::dsv41_binary() + " generate -m '" + dir + "' --prompt-ids 1,2,3 -n 2 --expert-parallel";
  };
  const test::CommandResult r =
      test::run_shell(mpirun(1) + generate(test::tiny_model_dir()) + " : -np 1 " + generate(other.path()));
  EXPECT_NE(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("rank(s) 1 loaded a checkpoint other than rank 0's"), std::string::npos) << r.out;
}

TEST(ExpertParallel, ServeAnswersAsTheSingleServerAndStopsOnSigterm) {
  const json body = {{"messages", {{{"role", "user"}, {"content", "Name three rivers."}}}},
                     {"max_tokens", 12},
                     {"temperature", 0},
                     {"ignore_eos", true}};
  std::string want;
  {
    server::ServeProcess single(test::tiny_model_dir(), "--parallel 2");
    ASSERT_GT(single.port(), 0) << single.first_line();
    const server::Reply r = server::post(single.port(), "/v1/chat/completions", body);
    ASSERT_EQ(r.status, 200) << r.raw;
    want = r.body["choices"][0]["message"]["content"].get<std::string>();
  }
  server::ServeProcess job(test::tiny_model_dir(), "--parallel 2 --expert-parallel", mpirun(2));
  ASSERT_GT(job.port(), 0) << job.first_line();
  const server::Reply r = server::post(job.port(), "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["choices"][0]["message"]["content"].get<std::string>(), want);
  // streamed: the same text, event by event
  json streamed = body;
  streamed["stream"] = true;
  const server::Stream s = server::post_stream(job.port(), "/v1/chat/completions", streamed);
  ASSERT_EQ(s.status, 200) << s.raw;
  std::string text;
  for (const json& e : s.events) {
    if (e.contains("choices") && !e["choices"].empty() && e["choices"][0]["delta"].contains("content"))
      text += e["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(text, want);
  // SIGTERM to rank 0 stops the server as it stops alone, and rank 0 ends the job: status 0
  const pid_t rank0 = rank_of(job.pid(), 0);
  ASSERT_GT(rank0, 0);
  kill(rank0, SIGTERM);
  EXPECT_EQ(job.wait(30), 0);
}

// A rank that stops answering (SIGSTOP: a wedged host) in the middle of serving: the request that
// waits on it ends with an error naming the rank once --rank-timeout has passed, and the job exits
// with status 1 and a message naming the rank, instead of every request hanging without bound. With
// four ranks the others still answer rank 0's pings: only the stopped one is named.
TEST(ExpertParallel, AStalledRankEndsItsRequestsAndTheJobNamingTheRank) {
  constexpr int kTimeout = 2;
  const json body = {{"messages", {{{"role", "user"}, {"content", "Name three rivers."}}}}, {"max_tokens", 8}};
  for (const auto& [ranks, stopped] : {std::pair{2, 1}, std::pair{4, 2}}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    test::TempDir dir;
    server::ServeProcess job(test::tiny_model_dir(),
                             "--expert-parallel --rank-timeout " + std::to_string(kTimeout) + " 2>" + dir / "job.log", mpirun(ranks));
    ASSERT_GT(job.port(), 0) << job.first_line();
    ASSERT_EQ(server::post(job.port(), "/v1/chat/completions", body).status, 200);
    const pid_t rank = rank_of(job.pid(), stopped);
    ASSERT_GT(rank, 0);
    kill(rank, SIGSTOP);
    std::future<server::Reply> reply =
        std::async(std::launch::async, [&] { return server::post(job.port(), "/v1/chat/completions", body); });
    if (reply.wait_for(std::chrono::seconds(3 * kTimeout + 10)) != std::future_status::ready) {
      ADD_FAILURE() << "the request still waits on the stopped rank " << 3 * kTimeout + 10 << " s on";
      kill(rank, SIGCONT);
    }
    const server::Reply r = reply.get();
    const std::string named = "rank " + std::to_string(stopped) + " did not answer within " + std::to_string(kTimeout) + " s";
    EXPECT_GE(r.status, 500) << r.raw;
    EXPECT_NE(r.raw.find(named), std::string::npos) << r.raw;
    EXPECT_EQ(job.wait(20), 1);
    const std::string log = file_bytes(dir / "job.log");
    EXPECT_NE(log.find("dsv41 serve: error: expert parallel: " + named), std::string::npos) << log;
  }
}

// --rank-timeout is a number of seconds, and only for an expert-parallel job.
TEST(ExpertParallel, TheRankTimeoutFlagIsChecked) {
  const std::string model = "-m '" + test::tiny_model_dir() + "' --prompt-ids 1,2,3 -n 2";
  const test::CommandResult alone = test::run_dsv41("generate " + model + " --rank-timeout 5");
  EXPECT_EQ(alone.status, 1);
  EXPECT_NE(alone.out.find("--rank-timeout: belongs to --expert-parallel"), std::string::npos) << alone.out;
  const test::CommandResult zero = run_mpi(1, "generate " + model + " --rank-timeout 0");
  EXPECT_NE(zero.status, 0);
  EXPECT_NE(zero.out.find("--rank-timeout"), std::string::npos) << zero.out;
}

// mpirun's own SIGTERM ends every rank of the job at once (Open MPI's handling), none left behind.
TEST(ExpertParallel, MpirunsSigtermLeavesNoRankBehind) {
  server::ServeProcess job(test::tiny_model_dir(), "--expert-parallel", mpirun(2));
  ASSERT_GT(job.port(), 0) << job.first_line();
  EXPECT_NE(job.stop(SIGTERM, 30), -1);
  for (int i = 0; i < 250 && job.group_alive(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(job.group_alive());
}

// The report is read from stdout alone: the ranks' progress lines on stderr arrive through mpirun
// whenever they are written, and may land inside the JSON when the two streams are merged.
TEST(ExpertParallel, BenchReportsTheRanksAndTheirExchange) {
  test::TempDir dir;
  const std::string report_path = dir / "report.json";
  const test::CommandResult r = test::run_shell(mpirun(2) + test::dsv41_binary() + " bench -m '" + test::tiny_model_dir() +
                                                "' --scenario decode --lengths 16 --steps 3 --json --expert-parallel > '" +
                                                report_path + "'");
  ASSERT_EQ(r.status, 0) << r.out;
  const std::string out = file_bytes(report_path);
  const json report = json::parse(out, nullptr, false);
  ASSERT_FALSE(report.is_discarded()) << out;
  ASSERT_TRUE(report.contains("expert_parallel")) << out;
  const json& x = report["expert_parallel"];
  EXPECT_EQ(x["ranks"], 2);
  ASSERT_EQ(x["resident_bytes_per_rank"].size(), 2u);
  for (const json& bytes : x["resident_bytes_per_rank"]) EXPECT_GT(bytes.get<uint64_t>(), 0u);
  EXPECT_GT(x["exchanged_bytes_per_token"].get<double>(), 0);
  EXPECT_GT(x["exchanged_bytes_per_prompt_token"].get<double>(), 0);
  EXPECT_GT(x["decode_tok_s"].get<double>(), 0);
  EXPECT_GT(x["prefill_tok_s"].get<double>(), 0);
}

}  // namespace
}  // namespace dsv41
