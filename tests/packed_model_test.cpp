// The model with its matrices packed for the SIMD kernels (kernels/packed_weights.h) against the same
// checkpoint read in its own row-major layout: packing changes where the bytes lie, never a result.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cpu_features.h"
#include "kernels/packed_weights.h"
#include "model/model.h"
#include "runtime/session.h"
#include "test_util.h"

namespace {

using namespace dsv41;

// Loads the tiny checkpoint with packing switched on or off (DSV41_PACK, read while loading).
std::unique_ptr<Model> load_tiny(bool packed) {
  if (packed) {
    unsetenv("DSV41_PACK");
  } else {
    setenv("DSV41_PACK", "0", 1);
  }
  std::unique_ptr<Model> m = load_model(test::tiny_model_dir());
  unsetenv("DSV41_PACK");
  return m;
}

std::vector<int32_t> random_ids(size_t n, uint32_t seed, int32_t vocab) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> id(0, vocab - 1);
  std::vector<int32_t> ids(n);
  for (auto& t : ids) t = id(rng);
  return ids;
}

TEST(PackedModel, PackedAndRowMajorWeightsGiveIdenticalLogits) {
  if (packed_tile_rows() == 0) GTEST_SKIP() << "the scalar kernels read no packed weights";
  const std::unique_ptr<Model> packed = load_tiny(true), plain = load_tiny(false);
  const LayerWeights& L = packed->weights().layers[0];
  ASSERT_EQ(L.attn.wq_a.packed.tile_rows, packed_tile_rows());
  ASSERT_EQ(L.ffn.experts[0].w1.packed.tile_rows, packed_tile_rows());
  ASSERT_NE(packed->weights().head.packed, nullptr);
  ASSERT_EQ(plain->weights().layers[0].attn.wq_a.packed.tile_rows, 0);

  const std::vector<int32_t> prompt = random_ids(100, 5, static_cast<int32_t>(packed->config().vocab_size));
  Session a(*packed, test::pools_for(*packed), {}), b(*plain, test::pools_for(*plain), {});
  EXPECT_EQ(a.prefill(prompt), b.prefill(prompt)) << "prefill (the GEMM path)";
  for (int32_t tok : {3, 70, 900}) EXPECT_EQ(a.decode(tok), b.decode(tok)) << "decode (the GEMV path)";
}

}  // namespace
