// The model with its matrices packed for the SIMD kernels (kernels/packed_weights.h) against the same
// checkpoint read in its own row-major layout, at every SIMD level the machine runs: packing changes
// where the bytes lie, never a result.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "model/model.h"
#include "runtime/session.h"
#include "test_util.h"

namespace {

using namespace dsv41;

// The tiny checkpoint on a backend of `level` that packs its weights or reads the checkpoint's layout.
std::unique_ptr<Model> load_tiny(Isa level, bool packed) {
  BackendOptions o;
  o.level = level;
  o.pack_weights = packed;
  return load_model(test::tiny_model_dir(), {make_backend(o)});
}

std::vector<int32_t> random_ids(size_t n, uint32_t seed, int32_t vocab) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> id(0, vocab - 1);
  std::vector<int32_t> ids(n);
  for (auto& t : ids) t = id(rng);
  return ids;
}

TEST(PackedModel, PackedAndRowMajorWeightsGiveIdenticalLogits) {
  int levels = 0;
  for (const Isa level : available_backend_levels()) {
    const std::unique_ptr<Model> packed = load_tiny(level, true), plain = load_tiny(level, false);
    const int tile_rows = packed->backend().weight_tile_rows();
    if (tile_rows == 0) continue;  // the scalar level reads no packed weights
    ++levels;
    const LayerWeights& L = packed->weights().layers[0];
    ASSERT_EQ(L.attn.wq_a.packed.tile_rows, tile_rows) << isa_name(level);
    ASSERT_EQ(L.ffn.experts[0].w1.packed.tile_rows, tile_rows);
    ASSERT_NE(packed->weights().head.packed, nullptr);
    ASSERT_EQ(plain->backend().weight_tile_rows(), 0);
    ASSERT_EQ(plain->weights().layers[0].attn.wq_a.packed.tile_rows, 0);
    EXPECT_GT(packed->backend().allocator().bytes_in_use(), 0u) << "the packed copies are the backend's memory";
    EXPECT_EQ(plain->backend().allocator().bytes_in_use(), 0u);

    const std::vector<int32_t> prompt = random_ids(100, 5, static_cast<int32_t>(packed->config().vocab_size));
    Session a(*packed, test::pools_for(*packed), {}), b(*plain, test::pools_for(*plain), {});
    EXPECT_EQ(a.prefill(prompt), b.prefill(prompt)) << isa_name(level) << " prefill (the GEMM path)";
    for (int32_t tok : {3, 70, 900}) EXPECT_EQ(a.decode(tok), b.decode(tok)) << isa_name(level) << " decode (GEMV)";
  }
  if (levels == 0) GTEST_SKIP() << "no SIMD level runs here: nothing reads packed weights";
}

}  // namespace
