// The expert cache (model/expert_cache.h): experts read from the files are the loader's packed
// experts bit for bit, the capacity holds, the frequently routed experts stay, a failed read is an
// error naming the file, and a model streaming its experts computes the resident model's logits.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/backend.h"
#include "kernels/packed_weights.h"
#include "model/expert_cache.h"
#include "model/model.h"
#include "runtime/session.h"
#include "test_util.h"
#include "text/engram_token_map.h"
#include "util/error.h"

namespace dsv41 {
namespace {

std::shared_ptr<const Backend> packing_backend() { return make_backend(); }

// The tiny preset's weights with every matrix packed, for comparison with what the cache reads.
std::shared_ptr<const ModelWeights> packed_weights(const std::string& dir, std::shared_ptr<const Backend> be) {
  return std::make_shared<const ModelWeights>(dir, load_config(dir), std::move(be));
}

bool same_packed(const Fp4Matrix& a, const Fp4Matrix& b) {
  return a.n == b.n && a.k == b.k && a.packed.tile_bytes == b.packed.tile_bytes &&
         std::memcmp(a.packed.tiles, b.packed.tiles, static_cast<size_t>((a.n + a.packed.tile_rows - 1) / a.packed.tile_rows * a.packed.tile_bytes)) == 0 &&
         std::memcmp(a.packed.scales, b.packed.scales, static_cast<size_t>((a.n + a.packed.tile_rows - 1) / a.packed.tile_rows * a.packed.scale_tile_bytes)) == 0;
}

TEST(ExpertCache, ReadsTheLoadersPackedExpertsAndHoldsItsCapacity) {
  auto be = packing_backend();
  if (be->weight_tile_rows() == 0) GTEST_SKIP() << "this backend packs nothing";
  const auto weights = packed_weights(test::tiny_model_dir(), be);
  const ExpertMatrices<Fp4Matrix>& e0 = weights->layers[0].ffn.experts[0];
  const uint64_t one = static_cast<uint64_t>(packed_fp4_bytes(e0.w1.n, e0.w1.k, be->weight_tile_rows()) +
                                             packed_fp4_bytes(e0.w2.n, e0.w2.k, be->weight_tile_rows()) +
                                             packed_fp4_bytes(e0.w3.n, e0.w3.k, be->weight_tile_rows()));
  ExpertCache cache(*weights, be, 3 * one, 2);
  EXPECT_EQ(cache.group_size(0), 1) << "two groups of one expert fit in three experts' bytes";

  const int experts = weights->config().routed_experts(0);
  for (int e = 0; e < experts; ++e) {
    const ExpertCache::Lease lease = cache.wait(cache.request(0, {e}));
    const ExpertMatrices<Fp4Matrix>& want = weights->layers[0].ffn.experts[static_cast<size_t>(e)];
    EXPECT_TRUE(same_packed(lease[0].w1, want.w1) && same_packed(lease[0].w2, want.w2) && same_packed(lease[0].w3, want.w3))
        << "expert " << e;
    EXPECT_EQ(lease[0].w1.w, nullptr) << "the cache keeps the packed copy alone";
  }
  ExpertCacheStats st = cache.stats();
  EXPECT_EQ(st.misses, static_cast<uint64_t>(experts));
  EXPECT_EQ(st.hits, 0u);
  EXPECT_LE(st.resident_bytes, 3 * one);
  EXPECT_EQ(st.evictions, static_cast<uint64_t>(experts - 3));
  EXPECT_EQ(st.direct_reads + st.buffered_reads, static_cast<uint64_t>(6 * experts));
  EXPECT_GT(st.bytes_read, 0u);

  // Expert 1 routed often stays; the others take turns in the rest.
  for (int round = 0; round < 4; ++round) {
    for (int e = 2; e < experts; ++e) {
      cache.wait(cache.request(0, {1}));
      cache.wait(cache.request(0, {e}));
    }
  }
  const uint64_t misses_before = cache.stats().misses;
  cache.wait(cache.request(0, {1}));
  EXPECT_EQ(cache.stats().misses, misses_before) << "the hot expert was evicted";
  // Pinned experts stay while a layer computes them, even past the capacity.
  const ExpertCache::Lease a = cache.wait(cache.request(0, {2, 3}));
  const ExpertCache::Lease b = cache.wait(cache.request(0, {4, 5}));
  EXPECT_TRUE(same_packed(a[0].w1, weights->layers[0].ffn.experts[2].w1));
  EXPECT_TRUE(same_packed(a[1].w2, weights->layers[0].ffn.experts[3].w2));
}

// Every token asks for the same experts in the same order, more of them than fit: the cache keeps a
// stable part (an LRU would evict each one just before it is asked for again, and never hit).
TEST(ExpertCache, AWorkingSetLargerThanTheCacheKeepsAPartResident) {
  auto be = packing_backend();
  if (be->weight_tile_rows() == 0) GTEST_SKIP() << "this backend packs nothing";
  const auto weights = packed_weights(test::tiny_model_dir(), be);
  const ExpertMatrices<Fp4Matrix>& e0 = weights->layers[0].ffn.experts[0];
  const uint64_t one = static_cast<uint64_t>(3 * packed_fp4_bytes(e0.w1.n, e0.w1.k, be->weight_tile_rows()));
  ExpertCache cache(*weights, be, 4 * one, 2);
  for (int token = 0; token < 10; ++token) {
    for (int e = 0; e < 8; ++e) cache.wait(cache.request(0, {e}));
  }
  const ExpertCacheStats st = cache.stats();
  // after the first pass, about 3 of the 8 hit each pass (one slot turns over)
  EXPECT_GE(st.hits, 9u * 2) << "hits " << st.hits << ", misses " << st.misses;
}

TEST(ExpertCache, AFailedReadIsAnErrorNamingTheFile) {
  auto be = packing_backend();
  if (be->weight_tile_rows() == 0) GTEST_SKIP() << "this backend packs nothing";
  test::TempDir dir;
  std::filesystem::copy(test::tiny_model_dir(), dir.path(), std::filesystem::copy_options::recursive);
  const auto weights = packed_weights(dir.path(), be);
  ExpertCache cache(*weights, be, uint64_t{1} << 30, 2);
  // The checkpoint is cut short under the running model (its mapping stays, the reads see the cut).
  const std::string shard = *weights->checkpoint().get("layers.3.ffn.experts.1.w2.weight").file;
  ASSERT_EQ(::truncate(shard.c_str(), 4096), 0);
  try {
    cache.wait(cache.request(3, {1}));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(shard), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.stats().resident_bytes, 0u) << "nothing of a failed read is cached";
}

// Through the whole model: a model streaming its experts through a cache of 40 of its 104 experts
// gives the resident model's logits, prefill and decode, and counts its hits and misses.
TEST(ExpertCache, AStreamingModelGivesTheResidentLogits) {
  auto be = packing_backend();
  if (be->weight_tile_rows() == 0) GTEST_SKIP() << "this backend packs nothing";
  const auto resident = load_model(test::tiny_model_dir(), {be});
  ASSERT_EQ(resident->expert_cache(), nullptr);
  auto weights = std::make_shared<const ModelWeights>(test::tiny_model_dir(), resident->config(), be, EngramTier::Mmap,
                                                      WeightPlacement{true, false});
  const ExpertMatrices<Fp4Matrix>& e0 = weights->layers[0].ffn.experts[0];
  const uint64_t one = static_cast<uint64_t>(3 * packed_fp4_bytes(e0.w1.n, e0.w1.k, be->weight_tile_rows()));
  std::ifstream tok(test::tiny_model_dir() + "/tokenizer.json");
  const Model streaming(be, weights, build_engram_token_map(nlohmann::json::parse(tok), resident->config().vocab_size),
                        40 * one);
  ASSERT_NE(streaming.expert_cache(), nullptr);
  const std::vector<int32_t> prompt = {0, 5, 77, 300, 41, 9, 12, 800, 3, 64, 250, 17, 99, 1000, 2, 8, 31, 500};
  Session a(*resident, test::pools_for(*resident), {}), b(streaming, test::pools_for(streaming), {});
  EXPECT_EQ(a.prefill(prompt), b.prefill(prompt));
  for (int32_t t : {7, 70, 700}) EXPECT_EQ(a.decode(t), b.decode(t));
  const ExpertCacheStats st = streaming.expert_cache()->stats();
  EXPECT_GT(st.misses, 0u);
  EXPECT_GT(st.hits + st.misses, st.misses) << "decode steps find some experts resident";
  EXPECT_LE(st.resident_bytes, 40 * one);
}

}  // namespace
}  // namespace dsv41
