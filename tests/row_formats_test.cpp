// Packed state rows hold exactly what the reference's quantize-dequantize produces.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "numeric/formats.h"
#include "numeric/quant.h"
#include "numeric/row_codecs.h"

namespace dsv41 {
namespace {

std::vector<float> random_row(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0, 1);
  std::uniform_real_distribution<float> mag(-6, 3);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = round_bf16(g(rng) * std::exp2(mag(rng)));
  x[3] = 0.0f;
  x[5] = -0.0f;
  return x;
}

template <typename Pack, typename Unpack, typename Qdq>
void expect_lossless(int64_t n, int64_t bytes, Pack pack, Unpack unpack, Qdq qdq) {
  for (uint32_t seed = 0; seed < 200; ++seed) {
    std::vector<float> x = random_row(n, seed), want = x, got(static_cast<size_t>(n));
    qdq(want.data(), static_cast<size_t>(n));
    std::vector<uint8_t> row(static_cast<size_t>(bytes));
    pack(x.data(), n, row.data());
    unpack(row.data(), n, got.data());
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << "seed " << seed;
  }
}

TEST(RowFormats, SizesAtTheReleasedWidths) {
  EXPECT_EQ(main_kv_bytes(512), 288);
  EXPECT_EQ(index_key_bytes(128), 68);
  EXPECT_EQ(window_row_bytes(512), 528);
}

TEST(RowFormats, PackedRowsEqualTheReferenceQuantizeDequantize) {
  expect_lossless(512, main_kv_bytes(512), pack_main_kv_row, unpack_main_kv_row, fp4_qdq_e4m3);
  expect_lossless(128, index_key_bytes(128), pack_index_key_row, unpack_index_key_row, fp4_qdq_e8m0);
  expect_lossless(512, window_row_bytes(512), pack_window_row, unpack_window_row, act_qdq_fp8);
}

}  // namespace
}  // namespace dsv41
