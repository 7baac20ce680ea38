// Packed state rows: the bytes of hand-computed rows, and a round trip through the packed form that
// loses nothing against the quantize-dequantize the rest of the model applies.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <initializer_list>
#include <iterator>
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

// ---- hand-computed rows ------------------------------------------------------------------------
// Each row below is packed and the bytes compared with ones derived by hand from model-spec §3.1 and
// §6.1 (the derivation is in the comments; tests/tools/row_codecs_expected.py recomputes them from
// the spec with NumPy and prints the same bytes). Layout: all codes, then all scales; two E2M1 codes
// per byte, the even element in the low nibble. E2M1 magnitudes by code 0..7: 0, 0.5, 1, 1.5, 2, 3,
// 4, 6 (bit 3 = sign); nearest, ties to the even code: 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4,
// 5→4. A negative value that rounds to zero keeps its sign (code 8).

template <size_t N>
std::vector<float> padded(std::initializer_list<float> head) {
  std::vector<float> v(head);
  v.resize(N, 0.0f);
  return v;
}

std::vector<float> concat(std::initializer_list<std::vector<float>> parts) {
  std::vector<float> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

void expect_bytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(static_cast<int>(got[i]), static_cast<int>(want[i])) << "byte " << i;
  }
}

// Bit-exact comparison (so -0.0 and 0.0 differ).
void expect_values(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
        << "lane " << i << ": " << got[i] << " vs " << want[i];
  }
}

// Main KV: one E4M3 scale per 16, s = e4m3(max(amax, 6·2^-9) / 6), codes of clamp(x / s, ±6).
TEST(RowFormats, MainKvRowHandComputed) {
  const std::vector<float> x = concat({
      // block 0: amax 3, s = 3/6 = 0.5 exactly (e4m3 0x30: exponent 6 = -1 + 7, mantissa 0); x/s = 2x:
      // 6, -6, the seven E2M1 ties 0.25 ... 5, -0, 0, -2, 0.6 (→ 0.5), -4.4 (→ -4), 2, 1
      padded<16>({3.0f, -3.0f, 0.125f, 0.375f, 0.625f, 0.875f, 1.25f, 1.75f, 2.5f, -0.0f, 0.0f, -1.0f, 0.3f,
                  -2.2f, 1.0f, 0.5f}),
      // block 1: amax 7, 7/6 = 1.1667 rounds to the e4m3 1.125 (0x39: exponent 7, mantissa 1), so
      // 7/s = 6.22 is clamped to 6; -0.5/s = -0.44 → -0.5; 2/s = 1.78 → 2; 4/s = 3.56 → 4
      padded<16>({7.0f, -0.5f, 2.0f, 4.0f}),
      // block 2: amax 3·2^-9 is below the floor 6·2^-9, so s = 2^-9, the smallest e4m3 subnormal
      // (0x01); x/s = 0.5 and -3
      padded<16>({0x1p-10f, -3 * 0x1p-9f}),
  });
  const std::vector<uint8_t> want = {
      0xF7, 0x20, 0x42, 0x64, 0x86, 0xC0, 0xE1, 0x24,  // codes 7 F | 0 2 | 2 4 | 4 6 | 6 8 | 0 C | 1 E | 4 2
      0x97, 0x64, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // codes 7 9 | 4 6 | zeros
      0xD1, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // codes 1 D | zeros
      0x30, 0x39, 0x01,                                // the three E4M3 scales
  };
  ASSERT_EQ(main_kv_bytes(48), 27);
  std::vector<uint8_t> row(27);
  pack_main_kv_row(x.data(), 48, row.data());
  expect_bytes(row, want);
  std::vector<float> got(48);
  unpack_main_kv_row(row.data(), 48, got.data());
  expect_values(got, concat({
                         padded<16>({3.0f, -3.0f, 0.0f, 0.5f, 0.5f, 1.0f, 1.0f, 2.0f, 2.0f, -0.0f, 0.0f, -1.0f,
                                     0.25f, -2.0f, 1.0f, 0.5f}),
                         padded<16>({6.75f, -0.5625f, 2.25f, 4.5f}),  // codes × 1.125
                         padded<16>({0x1p-10f, -3 * 0x1p-9f}),
                     }));
}

// Index keys: one E8M0 scale per 32, s = pow2ceil(fp32(max(amax, 6·2^-126) · fp32(1/6))).
TEST(RowFormats, IndexKeyRowHandComputed) {
  const std::vector<float> x = concat({
      // block 0: 5·fp32(1/6) = 0.833 → s = 1 (e8m0 127 = 0x7F); ties 5 → 4 and -0.75 → -1, 3.5 → 4,
      // 0.25 → 0, 1.6 → 1.5, -2.6 → -3
      padded<32>({5.0f, -0.75f, 3.5f, 0.25f, 1.6f, -2.6f}),
      // block 1: 12·fp32(1/6) rounds to exactly 2.0 in fp32, a power of two, so s = 2 (0x80), not 4;
      // x/s = -6, 0.5, 3.5 (tie → 4), 0.2 → 0
      padded<32>({-12.0f, 1.0f, 7.0f, 0.4f}),
      // block 2: only -0: the floor gives s = 2^-126 (0x01); -0 keeps its sign (code 8)
      padded<32>({-0.0f}),
  });
  std::vector<uint8_t> want(51, 0x00);
  want[0] = 0xA6;   // codes 6 (4.0), A (-1.0)
  want[1] = 0x06;   // codes 6 (4.0), 0
  want[2] = 0xD3;   // codes 3 (1.5), D (-3.0)
  want[16] = 0x1F;  // codes F (-6), 1 (0.5)
  want[17] = 0x06;  // codes 6 (4), 0
  want[32] = 0x08;  // code 8 (-0)
  want[48] = 0x7F;
  want[49] = 0x80;
  want[50] = 0x01;
  ASSERT_EQ(index_key_bytes(96), 51);
  std::vector<uint8_t> row(51);
  pack_index_key_row(x.data(), 96, row.data());
  expect_bytes(row, want);
  std::vector<float> got(96);
  unpack_index_key_row(row.data(), 96, got.data());
  expect_values(got, concat({
                         padded<32>({4.0f, -1.0f, 4.0f, 0.0f, 1.5f, -3.0f}),
                         padded<32>({-12.0f, 1.0f, 8.0f, 0.0f}),
                         padded<32>({-0.0f}),
                     }));
}

// Sliding-window rows: E4M3 codes, one E8M0 scale per 32, s = pow2ceil(fp32(max(amax, 1e-4) ·
// fp32(1/448))). An E4M3 code is sign | exponent (bias 7) << 3 | mantissa; binade 2^e has step 2^(e-3),
// the subnormals step 2^-9.
TEST(RowFormats, WindowRowHandComputed) {
  const std::vector<float> x = concat({
      // block 0: 448·fp32(1/448) = 1 + 4.5e-8 rounds to 1.0 in fp32, so s = 1 (0x7F). 448 → 0x7E (the
      // largest finite), -1 → 0xB8, 1.0625 is a tie of 1 and 1.125 → 1 (0x38), 1.1875 a tie of 1.125
      // and 1.25 → 1.25 (0x3A), 2^-9 → 0x01, 2^-10 a tie of 0 and 2^-9 → 0, 3·2^-10 a tie of 2^-9 and
      // 2^-8 → 2^-8 (0x02), 2^-6 → the smallest normal 0x08, 300 = 9.375 steps of 32 → 288 (0x79), -0 → 0x80
      padded<32>({448.0f, -1.0f, 1.0625f, 1.1875f, 0x1p-9f, 0x1p-10f, 3 * 0x1p-10f, 0x1p-6f, 300.0f, -0.0f}),
      // block 1: 0.3·fp32(1/448) = 6.7e-4 → s = 2^-10 (117 = 0x75); x/s = 307.2 → 320 (0x7A), -102.4 →
      // -104 (0xED), 0.01024 = 5.24 subnormal steps → 5 (0x05)
      padded<32>({0.3f, -0.1f, 1e-5f}),
      // block 2: amax below the 1e-4 floor: 1e-4·fp32(1/448) = 2.2e-7 → s = 2^-22 (105 = 0x69); x/s =
      // -125.8 = 15.7 steps of 8 → 16 steps carries into the next binade: -128 (0xF0)
      padded<32>({-3e-5f}),
  });
  std::vector<uint8_t> want(99, 0x00);
  const uint8_t head0[] = {0x7E, 0xB8, 0x38, 0x3A, 0x01, 0x00, 0x02, 0x08, 0x79, 0x80};
  std::copy(std::begin(head0), std::end(head0), want.begin());
  want[32] = 0x7A;
  want[33] = 0xED;
  want[34] = 0x05;
  want[64] = 0xF0;
  want[96] = 0x7F;
  want[97] = 0x75;
  want[98] = 0x69;
  ASSERT_EQ(window_row_bytes(96), 99);
  std::vector<uint8_t> row(99);
  pack_window_row(x.data(), 96, row.data());
  expect_bytes(row, want);
  std::vector<float> got(96);
  unpack_window_row(row.data(), 96, got.data());
  expect_values(got, concat({
                         padded<32>({448.0f, -1.0f, 1.0f, 1.25f, 0x1p-9f, 0.0f, 0x1p-8f, 0x1p-6f, 288.0f, -0.0f}),
                         padded<32>({320 * 0x1p-10f, -104 * 0x1p-10f, 5 * 0x1p-19f}),
                         padded<32>({-0x1p-15f}),
                     }));
}

// ---- sizes and the packed round trip -----------------------------------------------------------

TEST(RowFormats, SizesAtTheReleasedWidths) {
  EXPECT_EQ(main_kv_bytes(512), 288);
  EXPECT_EQ(index_key_bytes(128), 68);
  EXPECT_EQ(window_row_bytes(512), 528);
}

// unpack(pack(x)) equals the in-place quantize-dequantize of numeric/quant (the form the model uses
// where it does not store rows) on 200 random rows per format, zeros of both signs included: storing
// packed loses nothing. Both sides share the quantizer; the hand-computed rows above pin its output.
TEST(RowFormats, PackedRoundTripEqualsQuantizeDequantize) {
  expect_lossless(512, main_kv_bytes(512), pack_main_kv_row, unpack_main_kv_row, fp4_qdq_e4m3);
  expect_lossless(128, index_key_bytes(128), pack_index_key_row, unpack_index_key_row, fp4_qdq_e8m0);
  expect_lossless(512, window_row_bytes(512), pack_window_row, unpack_window_row, act_qdq_fp8);
}

}  // namespace
}  // namespace dsv41
