// Chunked prefill at the released window of 128 on the released per-layer widths (issue: agent-scale
// contexts). The bench preset's widths (hidden 5120, 64 heads of 512, index 32×128, experts of 2304)
// on four layers, one of each attention role (SWA only, Full ratio 2, Full ratio 1 and candidate
// source, Reindex), and six experts: a 200-token prompt's window lists span several 64-row softmax
// chunks, so a prefill in chunks shorter than the window must keep the one-shot prefill's list layout
// to compute its bits (docs/state.md). The tiny widths test this at length (long_context_test.cpp);
// these are the attention kernels' and the indexer's released shapes. About 1.5 GB of weights and two
// minutes on 2 cores, so the test skips under the sanitizers.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/model.h"
#include "model/synthetic_checkpoint.h"
#include "runtime/session.h"
#include "text/tiny_tokenizer.h"
#include "test_util.h"

namespace dsv41 {
namespace {

ModelConfig four_layer_bench_widths(const nlohmann::json& tokenizer) {
  ModelConfig c = synthetic_config("bench");
  c.n_layers = 4;
  c.n_mtp_layers = 1;
  c.compress_ratios = {0, 2, 1, 1, 0};
  c.kv_source_layers = {1, 2};
  c.index_source_layers = {1, 2, 3};
  c.candidate_source_layer = 2;
  c.n_routed_experts = 6;
  c.engram_layer_ids = {1};
  c.engram_vocab_size = 1000;
  c.dspark_target_layer_ids = {1, 2, 3};
  c.dspark_n_routed_experts = 3;
  return complete_synthetic_config(c, tokenizer);
}

const Model& bench_widths_model() {
  static test::TempDir dir;
  static const bool written = [] {
    const nlohmann::json tokenizer = build_tiny_tokenizer(1024);
    write_synthetic_checkpoint(dir.path(), four_layer_bench_widths(tokenizer), 0, tokenizer, uint64_t{1} << 30);
    return true;
  }();
  (void)written;
  static std::unique_ptr<Model> model = load_model(dir.path());
  return *model;
}

TEST(BenchWidthsWindow, ChunksShorterThanTheWindowGiveTheOneShotPrefill) {
  DSV41_SKIP_UNDER_SANITIZERS("a 1.5 GB checkpoint at the released widths");
  const Model& m = bench_widths_model();
  const ModelConfig& c = m.config();
  ASSERT_EQ(c.window_size, 128);
  ASSERT_EQ(c.dim, 5120);
  ASSERT_EQ(c.head_dim, 512);
  ASSERT_EQ(c.index_n_heads * c.index_head_dim, 32 * 128);
  std::mt19937 rng(4);
  std::vector<int32_t> ids(200);
  for (auto& t : ids) t = static_cast<int32_t>(3 + rng() % 1000);
  SequenceState one = m.new_sequence(test::pools_for(m));
  const std::vector<float> whole = m.forward(one, ids, {}).logits;
  for (int64_t chunk : {1, 50, 128}) {
    SessionOptions o;
    o.chunk = chunk;
    Session s(m, test::pools_for(m), o);
    EXPECT_EQ(s.prefill(ids), whole) << "chunk " << chunk;
    EXPECT_EQ(first_difference(s.state(), one), "") << "chunk " << chunk;
  }
}

}  // namespace
}  // namespace dsv41
