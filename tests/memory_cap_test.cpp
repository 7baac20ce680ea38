// Capped equals uncapped: `dsv41 generate` inside a memory cgroup whose limit is well below the
// checkpoint's size (and no --ram: the plan's default budget is the cgroup's limit) computes the
// uncapped run's greedy tokens and logits bit for bit, with its peak resident set under the limit.
// The checkpoint's pages are dropped from the page cache first, so the capped run reads them itself and
// they are charged to its cgroup. And --ram above the cgroup's limit is refused at start by every command
// that loads. Needs root and a writable memory cgroup hierarchy (v1 or v2); skips with a message elsewhere.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "model/synthetic_checkpoint.h"
#include "text/tiny_tokenizer.h"
#include "test_util.h"

namespace dsv41 {
namespace {

namespace fs = std::filesystem;
constexpr uint64_t kMiB = uint64_t{1} << 20;

// A memory cgroup of its own, removed at the end (its processes have exited by then).
class MemoryCgroup {
 public:
  explicit MemoryCgroup(uint64_t limit) {
    const std::string name = "dsv41-cap-test-" + std::to_string(getpid());
    for (const auto& [root, file] : {std::pair{"/sys/fs/cgroup/memory", "memory.limit_in_bytes"},
                                     std::pair{"/sys/fs/cgroup", "memory.max"}}) {
      std::error_code ec;
      if (!fs::exists(std::string(root) + "/" + (std::string(file) == "memory.max" ? "cgroup.controllers" : file), ec)) continue;
      const std::string dir = std::string(root) + "/" + name;
      if (!fs::create_directory(dir, ec) && !fs::is_directory(dir, ec)) {
        why_ += dir + ": " + ec.message() + "; ";
        continue;
      }
      std::ofstream out(dir + "/" + file);
      out << limit;
      out.close();
      if (!out) {
        why_ += dir + "/" + file + ": cannot be written; ";
        fs::remove(dir, ec);
        continue;
      }
      path_ = dir;
      limit_file_ = file;
      v1_ = std::string(file) == "memory.limit_in_bytes";
      return;
    }
    if (why_.empty()) why_ = "no memory cgroup hierarchy under /sys/fs/cgroup";
  }
  ~MemoryCgroup() {
    std::error_code ec;
    if (!path_.empty()) fs::remove(path_, ec);
  }
  bool ok() const { return !path_.empty(); }
  const std::string& why() const { return why_; }
  const std::string& path() const { return path_; }
  // The kernel's count of OOM kills in the group (v1: memory.oom_control; v2: memory.events).
  int64_t oom_kills() const {
    std::ifstream in(path_ + (v1_ ? "/memory.oom_control" : "/memory.events"));
    std::string key;
    int64_t v = 0;
    while (in >> key >> v) {
      if (key == "oom_kill") return v;
    }
    return 0;
  }

 private:
  std::string path_, limit_file_, why_;
  bool v1_ = true;
};

// Writes the folder's files out and drops them from the page cache.
void drop_page_cache(const std::string& dir) {
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const int fd = ::open(entry.path().c_str(), O_RDONLY);
    ASSERT_GE(fd, 0) << entry.path();
    ::fsync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

uint64_t folder_bytes(const std::string& dir) {
  uint64_t n = 0;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) n += entry.file_size();
  }
  return n;
}

// The peak resident set a `generate --json` run reports of itself (VmHWM: its own pages only).
double peak_rss_mib(const std::string& out) {
  const size_t at = out.find("\"peak_rss_mb\":");
  return at == std::string::npos ? -1 : std::atof(out.c_str() + at + 14);
}

TEST(MemoryCap, CappedRunEqualsUncappedBitForBit) {
  DSV41_SKIP_UNDER_SANITIZERS("a resident-set limit");
  constexpr uint64_t kLimit = 96 * kMiB;
  MemoryCgroup cgroup(kLimit);
  if (!cgroup.ok()) GTEST_SKIP() << "cannot make a memory cgroup here: " << cgroup.why();

  // The small preset with 64 routed experts a layer: about 220 MB, most of it experts.
  test::TempDir dir;
  const nlohmann::json tokenizer = build_tiny_tokenizer(synthetic_config("small").vocab_size);
  ModelConfig geometry = synthetic_config("small", tokenizer);
  geometry.n_routed_experts = 64;
  const ModelConfig config = complete_synthetic_config(geometry, tokenizer);
  write_synthetic_checkpoint(dir.path(), config, 3, tokenizer, 64 * kMiB);
  const uint64_t checkpoint = folder_bytes(dir.path());
  ASSERT_GT(checkpoint, 2 * kLimit) << "the limit must be well below the checkpoint";
  drop_page_cache(dir.path());

  std::mt19937 rng(8);
  std::uniform_int_distribution<int> id(3, static_cast<int>(config.vocab_size) - 1);
  std::string ids = "0";
  for (int i = 1; i < 300; ++i) ids += "," + std::to_string(id(rng));
  const std::string args = "generate -m " + dir.path() + " --prompt-ids " + ids + " -n 8 --temp 0 --chunk 128 --json";

  // The capped run. Its peak resident set also counts the pages of the binary and its libraries,
  // charged to the cgroup that read them first: the whole peak of a run on the tiny preset bounds that.
  const test::CommandResult capped = test::run_shell("echo $$ > " + cgroup.path() + "/cgroup.procs && exec " + test::dsv41_binary() +
                                              " " + args + " --dump-logits " + (dir / "capped.bin"));
  ASSERT_EQ(capped.status, 0) << "capped run: " << capped.out;
  EXPECT_EQ(cgroup.oom_kills(), 0);
  const test::CommandResult baseline = test::run_dsv41("generate -m " + test::tiny_model_dir() + " -p hi -n 1 --json");
  ASSERT_EQ(baseline.status, 0) << baseline.out;
  const double capped_peak = peak_rss_mib(capped.out), allowance = peak_rss_mib(baseline.out);
  ASSERT_GT(capped_peak, 0) << capped.out;
  ASSERT_GT(allowance, 0) << baseline.out;
  EXPECT_LT(capped_peak, static_cast<double>(kLimit / kMiB) + allowance) << "peak resident set of the capped run, MiB";

  const test::CommandResult uncapped = test::run_dsv41(args + " --dump-logits " + (dir / "uncapped.bin"));
  ASSERT_EQ(uncapped.status, 0) << uncapped.out;
  const std::string a = read_file(dir / "capped.bin"), b = read_file(dir / "uncapped.bin");
  ASSERT_GT(a.size(), 8 * static_cast<size_t>(config.vocab_size) * 4);
  EXPECT_TRUE(a == b) << "the capped run's logits differ from the uncapped run's";
  const auto tokens = [](const std::string& out) {
    const size_t at = out.find("\"tokens\"");
    return at == std::string::npos ? std::string() : out.substr(at, out.find(']', at) - at);
  };
  EXPECT_FALSE(tokens(uncapped.out).empty()) << uncapped.out;
  EXPECT_EQ(tokens(capped.out), tokens(uncapped.out));
  // the capped run streamed its experts and says what it read; the uncapped one held them all
  const auto report = [](const std::string& out) {  // the JSON line, the last the command prints
    const size_t line = out.rfind("\n{");
    return nlohmann::json::parse(out.substr(line == std::string::npos ? 0 : line + 1));
  };
  const nlohmann::json streamed = report(capped.out);
  ASSERT_TRUE(streamed.contains("expert_cache")) << capped.out;
  EXPECT_GT(streamed["expert_cache"]["misses"].get<uint64_t>(), 0u);
  EXPECT_GT(streamed["expert_cache"]["bytes_read"].get<uint64_t>(), 0u);
  EXPECT_LT(streamed["expert_cache"]["capacity_bytes"].get<uint64_t>(), kLimit);
  EXPECT_FALSE(report(uncapped.out).contains("expert_cache"));
  std::printf("[memory-cap] checkpoint %.1f MiB, limit %.0f MiB, capped peak RSS %.1f MiB (a whole tiny-preset run: "
              "%.1f MiB)\n",
              static_cast<double>(checkpoint) / kMiB, static_cast<double>(kLimit) / kMiB, capped_peak, allowance);
}

// --ram above the memory cgroup's limit is refused before the load, naming both numbers, by every
// command that loads a model: the kernel would kill the process at the limit with nothing logged.
// `plan` still plans for the budget named (it may be for another machine) and says so.
TEST(MemoryCap, RamAboveTheCgroupLimitIsRefusedNamingBoth) {
  constexpr uint64_t kLimit = 96 * kMiB;
  MemoryCgroup cgroup(kLimit);
  if (!cgroup.ok()) GTEST_SKIP() << "cannot make a memory cgroup here: " << cgroup.why();
  const std::string in_group = "echo $$ > " + cgroup.path() + "/cgroup.procs && exec timeout 60 " + test::dsv41_binary() + " ";
  const std::string m = " -m " + test::tiny_model_dir() + " --ram 8G";
  for (const std::string& command : {"generate" + m + " -p hi -n 1", "ppl" + m + " -f " + test::source_dir() + "/README.md --ctx 16",
                                     "serve" + m + " --port 0", "bench" + m + " --scenario decode", "chat" + m + " < /dev/null"}) {
    SCOPED_TRACE(command);
    const test::CommandResult r = test::run_shell(in_group + command);
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_NE(r.out.find("--ram: 8589934592 bytes (8.00 GiB) is above the memory cgroup's limit of 100663296 bytes (96.00 MiB"), std::string::npos) << r.out;
  }
  const test::CommandResult plan = test::run_shell(in_group + "plan" + m);
  EXPECT_EQ(plan.status, 0) << plan.out;
  EXPECT_NE(plan.out.find("is above the memory cgroup's limit"), std::string::npos) << plan.out;
  EXPECT_EQ(cgroup.oom_kills(), 0);
}

}  // namespace
}  // namespace dsv41
