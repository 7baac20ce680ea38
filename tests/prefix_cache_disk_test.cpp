// The prompt cache's disk tier through the command, as a user runs it: a new `dsv41 generate` process
// restores the prefix an earlier one stored, bit for bit in exact mode, global rows only in replay
// mode, and every way a cache file can go bad is detected and recomputed. (The tier's own tests, in
// one process, are prefix_cache_test.cpp's.)
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/config.h"
#include "prompt_ids.h"
#include "test_util.h"

namespace dsv41 {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

using test::concat;
using test::ids;

// The disk tier through the command, as a user runs it: a new process reuses the prefix.
class PrefixCacheDisk : public ::testing::Test {
 protected:
  // A 300-token stem, then (extra > 0) 30 more tokens: a conversation that grew.
  std::string prompt_ids(int extra_seed) const {
    std::vector<int32_t> p = ids(300, 20);
    if (extra_seed > 0) p = concat(p, ids(30, static_cast<uint32_t>(extra_seed)));
    std::string s;
    for (int32_t t : p) s += (s.empty() ? "" : ",") + std::to_string(t);
    return s;
  }
  json gen(const std::string& prompt, const std::string& extra, const std::string& dump) {
    auto r = test::run_dsv41("generate -m " + test::tiny_model_dir() + " --prompt-ids " + prompt +
                             " --teacher-ids 5,6,7,8 --json --dump-logits " + dump + " " + extra);
    EXPECT_EQ(r.status, 0) << r.out;
    last_output = r.out;
    return json::parse(r.out.substr(r.out.find('{')));
  }
  static std::string read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
  }
  test::TempDir dir;
  std::string last_output;
};

TEST_F(PrefixCacheDisk, ExactModeNewProcessIsBitIdentical) {
  const std::string cache = " --prompt-cache " + (dir / "cache");
  json cold = gen(prompt_ids(21), "", dir / "cold.bin");
  // An exact entry restores bit-identically at the boundary where its request stopped: the stem's
  // last whole block. The longer prompt shares the whole stem.
  json first = gen(prompt_ids(0), cache, dir / "first.bin");
  EXPECT_EQ(first["cache_source"], "none");
  EXPECT_GT(first["disk_bytes_per_token"].get<double>(), 106);  // global rows + the window snapshot
  json warm = gen(prompt_ids(21), cache, dir / "warm.bin");
  EXPECT_EQ(warm["cache_source"], "disk");
  EXPECT_EQ(warm["cached_tokens"], 256);  // the shared 300-token stem, in whole blocks
  EXPECT_EQ(warm["replayed_tokens"], 0);
  EXPECT_EQ(read(dir / "cold.bin"), read(dir / "warm.bin"));
  EXPECT_NEAR(warm["state_bytes_per_token"]["global"].get<double>(), 106.0, 0.5);  // dsv41 inspect: 106 B/token
}

TEST_F(PrefixCacheDisk, ReplayModeStoresOnlyGlobalRows) {
  const std::string cache = " --prompt-cache " + (dir / "cache") + " --cache-mode replay";
  json first = gen(prompt_ids(23), cache, dir / "a.bin");
  // 106 B/token of global rows plus the file's token ids (4 B/token) and header
  EXPECT_LT(first["disk_bytes_per_token"].get<double>(), 106 + 4 + 8);
  json warm = gen(prompt_ids(24), cache, dir / "b.bin");  // shares 300 tokens: any block boundary in them works
  EXPECT_EQ(warm["cache_source"], "disk");
  EXPECT_EQ(warm["cached_tokens"], 256);
  EXPECT_EQ(warm["replayed_tokens"], 16);
}

// Every way a cache file can go bad is detected, reported and recomputed: the answer is always the
// cold one.
TEST_F(PrefixCacheDisk, CorruptForeignAndOldFilesAreIgnoredAndRecomputed) {
  const std::string cache_dir = dir / "cache";
  json cold = gen(prompt_ids(31), "", dir / "cold.bin");
  gen(prompt_ids(31), " --prompt-cache " + cache_dir, dir / "seed.bin");
  std::string file;
  for (auto& e : std::filesystem::directory_iterator(cache_dir)) file = e.path().string();
  ASSERT_FALSE(file.empty());
  const std::string good = read(file);
  auto corrupt = [&](const std::string& what, std::string bytes) {
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
    json j = gen(prompt_ids(31), " --prompt-cache " + cache_dir, dir / "out.bin");
    EXPECT_EQ(j["cache_source"], "none") << what;
    EXPECT_NE(last_output.find("warning"), std::string::npos) << what << ": " << last_output;
    EXPECT_EQ(read(dir / "out.bin"), read(dir / "cold.bin")) << what;
  };
  for (size_t cut : {size_t{4}, size_t{20}, good.size() / 3, good.size() / 2, good.size() - 9, good.size() - 1}) {
    corrupt("truncated at " + std::to_string(cut), good.substr(0, cut));
  }
  for (size_t at : {size_t{30}, good.size() / 2, good.size() - 4}) {  // header, body, checksum
    std::string b = good;
    b[at] = static_cast<char>(b[at] ^ 0x5A);
    corrupt("byte flipped at " + std::to_string(at), b);
  }
  std::string version = good;
  version[8] = static_cast<char>(version[8] + 1);  // the u32 version after the 8-byte magic
  corrupt("other version", version);
  // a file made by another model: another fingerprint in its header
  std::string foreign = good;
  auto pos = foreign.find(test::tiny_model().fingerprint());
  ASSERT_NE(pos, std::string::npos);
  foreign.replace(pos, 16, config_fingerprint(load_config(test::golden_dir("tiny-dense"))));
  corrupt("another model", foreign);
}


}  // namespace
}  // namespace dsv41
