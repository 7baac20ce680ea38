// The prefix cache: exact restores are bit-identical, replay restores re-run at most a window,
// branches never see each other's tokens, corrupt files are ignored, and no page leaks.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "runtime/prefix_cache.h"
#include "runtime/sampler.h"
#include "runtime/session.h"
#include "test_util.h"

namespace dsv41 {
namespace {

using nlohmann::json;

const Model& tiny() { return test::tiny_model(); }

std::vector<int32_t> ids(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<int32_t>(rng() % 1000);
  return v;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// prefill + teacher-forced steps; every logits row
std::vector<float> run_teacher(const Model& m, StatePools& pools, PrefixCache* cache, const std::vector<int32_t>& prompt,
                               const std::vector<int32_t>& teacher, CacheHit* hit = nullptr, SessionOptions opt = {}) {
  Session s(m, pools, opt, cache);
  std::vector<float> out = s.prefill(prompt);
  for (int32_t t : teacher) {
    std::vector<float> l = s.decode(t);
    out.insert(out.end(), l.begin(), l.end());
  }
  if (hit) *hit = s.cache_hit();
  return out;
}

// prefill + a few teacher-forced steps; every logits row
std::vector<float> run(const Model& m, StatePools& pools, PrefixCache* cache, const std::vector<int32_t>& prompt,
                       CacheHit* hit = nullptr, SessionOptions opt = {}) {
  Session s(m, pools, opt, cache);
  std::vector<float> out = s.prefill(prompt);
  for (int32_t t : {7, 8, 9}) {
    std::vector<float> l = s.decode(t);
    out.insert(out.end(), l.begin(), l.end());
  }
  if (hit) *hit = s.cache_hit();
  return out;
}

TEST(PrefixCacheRam, ExactRestoreIsBitIdenticalAndSharesPages) {
  const Model& m = tiny();
  StatePools pools(m.config(), m.roles(), m.backend().allocator());
  PrefixCache cache(m, pools, CacheMode::Exact, 64 << 20, "");
  const std::vector<int32_t> shared = ids(200, 1);
  const std::vector<int32_t> a = concat(shared, ids(30, 2)), b = concat(shared, ids(45, 3));
  CacheHit hit;
  std::vector<float> cold_b = run(m, pools, nullptr, b);
  run(m, pools, &cache, a, &hit);
  EXPECT_EQ(hit.source, "none");
  std::vector<float> warm_b = run(m, pools, &cache, b, &hit);
  EXPECT_EQ(hit.source, "ram");
  EXPECT_EQ(hit.cached_tokens, 192);  // the last whole block inside the shared prefix
  EXPECT_EQ(hit.replayed_tokens, 0);
  EXPECT_EQ(warm_b, cold_b);
}

// Two sequences branch from one cached prefix and run interleaved: each must see only its own tokens
// (copy-on-write pages), so each equals a run of the same prompt without any cache.
TEST(PrefixCacheRam, BranchesNeverSeeEachOthersTokens) {
  const Model& m = tiny();
  StatePools pools(m.config(), m.roles(), m.backend().allocator());
  PrefixCache cache(m, pools, CacheMode::Exact, 64 << 20, "");
  const std::vector<int32_t> shared = ids(130, 4);
  run(m, pools, &cache, concat(shared, ids(3, 5)));  // caches 128 tokens
  Session x(m, pools, {}, &cache), y(m, pools, {}, &cache);
  std::vector<int32_t> px = concat(shared, ids(21, 6)), py = concat(shared, ids(33, 7));
  std::vector<float> lx = x.prefill(px), ly = y.prefill(py);
  EXPECT_EQ(x.cache_hit().cached_tokens, 128);
  EXPECT_EQ(y.cache_hit().cached_tokens, 128);
  for (int i = 0; i < 40; ++i) {  // interleaved decoding, crossing page and compressor-pair boundaries
    lx = x.decode(static_cast<int32_t>(100 + i));
    ly = y.decode(static_cast<int32_t>(300 + i));
  }
  Session x0(m, pools, {}), y0(m, pools, {});
  std::vector<float> ex = x0.prefill(px), ey = y0.prefill(py);
  for (int i = 0; i < 40; ++i) {
    ex = x0.decode(static_cast<int32_t>(100 + i));
    ey = y0.decode(static_cast<int32_t>(300 + i));
  }
  EXPECT_EQ(lx, ex);
  EXPECT_EQ(ly, ey);
}

// Replay keeps only the global rows and re-runs the last window of cached tokens, so it is
// approximate by design (docs/state.md): each re-run token attends to a window that starts at the
// replay. On this 300-token prompt (256 cached) and 32 teacher-forced steps the measured deviation
// from the cold run is a relative L2 of 0.272 with 21 of 33 argmaxes equal; the bars sit a little
// above that. A replay that restored the wrong global rows looks like a cold run whose cached 256
// tokens differ: measured 0.776 and 1 of 33, which the bars must reject.
TEST(PrefixCacheRam, ReplayRerunsAtMostAWindow) {
  const Model& m = tiny();
  const int64_t V = m.config().vocab_size;
  StatePools pools(m.config(), m.roles(), m.backend().allocator());
  PrefixCache cache(m, pools, CacheMode::Replay, 64 << 20, "");
  const std::vector<int32_t> prompt = ids(300, 8), teacher = ids(32, 99);
  run(m, pools, &cache, prompt);
  CacheHit hit;
  const std::vector<float> warm = run_teacher(m, pools, &cache, prompt, teacher, &hit);
  const std::vector<float> cold = run_teacher(m, pools, nullptr, prompt, teacher);
  EXPECT_EQ(hit.source, "ram");
  EXPECT_EQ(hit.cached_tokens, 256);
  EXPECT_EQ(hit.replayed_tokens, m.config().window_size);
  constexpr double kMaxRelL2 = 0.33;
  constexpr int kMinSameTop1 = 17;
  const test::Deviation d = test::deviation(warm, cold, V);
  std::vector<int32_t> other = ids(256, 1234);
  other.insert(other.end(), prompt.begin() + 256, prompt.end());
  const test::Deviation wrong = test::deviation(run_teacher(m, pools, nullptr, other, teacher), cold, V);
  std::printf("[replay] relative L2 %.3f, top-1 %d of %d; with another cached prefix %.3f, %d of %d\n", d.rel_l2,
              d.same_top1, d.rows, wrong.rel_l2, wrong.same_top1, wrong.rows);
  EXPECT_LT(d.rel_l2, kMaxRelL2);
  EXPECT_GE(d.same_top1, kMinSameTop1);
  EXPECT_GT(wrong.rel_l2, kMaxRelL2);
  EXPECT_LT(wrong.same_top1, kMinSameTop1);
}

TEST(PrefixCacheRam, PagesReturnToBaselineAfterManyRequestsAndEvictions) {
  const Model& m = tiny();
  StatePools pools(m.config(), m.roles(), m.backend().allocator());
  std::mt19937 rng(9);
  {
    // a budget of a few blocks, so most stores evict
    PrefixCache cache(m, pools, CacheMode::Exact, 40 << 10, "");
    std::vector<std::vector<int32_t>> stems = {ids(64, 10), ids(128, 11), ids(192, 12)};
    for (int r = 0; r < 40; ++r) {
      std::vector<int32_t> p = concat(stems[rng() % 3], ids(static_cast<int>(1 + rng() % 80), 100 + r));
      Session s(m, pools, {}, &cache);
      s.prefill(p);
      for (int i = 0; i < static_cast<int>(rng() % 5); ++i) s.decode(5);
      EXPECT_LE(cache.ram_bytes(), 40u << 10);
    }
    EXPECT_GT(pools.pages_in_use(), 0u);  // what the cache still holds
  }
  EXPECT_EQ(pools.pages_in_use(), 0u);
}

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
  // a file made by another model: the golden checkpoint's geometry
  std::string foreign = good;
  auto pos = foreign.find(config_fingerprint(load_config(test::tiny_model_dir())));
  ASSERT_NE(pos, std::string::npos);
  foreign.replace(pos, 16, config_fingerprint(load_config(test::golden_dir("tiny-dense"))));
  corrupt("another model", foreign);
}

}  // namespace
}  // namespace dsv41
