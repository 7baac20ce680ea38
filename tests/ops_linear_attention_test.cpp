// The fast linear layers and sparse attention (AVX2 / AVX-512 / AVX-512-BF16, multithreaded) against the scalar
// references, bit for bit, at every kernel level this machine runs and several thread counts, on
// inputs aimed at their weak spots; plus the packed weight layout, the backend's options and the
// CPU feature detection they rest on. (tests/ops_test.cpp runs every op on the model's shapes.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/backend.h"
#include "kernels/linear_internal.h"
#include "kernels/reference.h"
#include "numeric/formats.h"
#include "numeric/row_codecs.h"
#include "ops_util.h"
#include "util/error.h"

namespace {

using namespace dsv41;
using namespace dsv41::test;

struct Shape {
  int64_t m, n, k;
};

std::string describe(const Backend& b, const Shape& s) {
  return label(b) + " m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k);
}

// Shapes for the quantized layers (k a multiple of 32): m = 1 (GEMV path) and m > 1 (GEMM path,
// with m not a multiple of the micro-tile), n not a multiple of the 8/16-row tiles, of the 32-row
// scale tiles or of the thread split, an odd number of K blocks (FP4 decodes blocks in pairs), K
// longer than one GEMM panel (256), and a decode-sized K.
const std::vector<Shape> kQuantShapes = {
    {1, 1, 32},   {1, 7, 64},    {1, 16, 96},   {1, 33, 160},  {1, 100, 288}, {1, 257, 1024}, {1, 64, 7168},
    {2, 5, 32},   {3, 40, 96},   {5, 17, 320},  {6, 48, 256},  {7, 33, 544},  {13, 129, 512}, {19, 70, 64},
    {64, 96, 1024}};

TEST(KernelsSimd, Fp8MatchesScalar) {
  std::mt19937 rng(11);
  double worst = 0;  // the AMX level's largest |got - want| / (u·S), against its bound's 2·67·kb + kb + 31
  for (const Backend* be : fast_backends()) {
    for (const Shape& s : kQuantShapes) {
      const std::vector<float> x = random_activations(rng, s.m, s.k);
      const std::vector<uint8_t> w = random_e4m3(rng, static_cast<size_t>(s.n * s.k));
      const std::vector<uint8_t> sc = random_scales(rng, static_cast<size_t>(((s.n + 31) / 32) * (s.k / 32)));
      const Fp8Matrix mat{w.data(), sc.data(), s.n, s.k};
      std::vector<float> want(static_cast<size_t>(s.m * s.n)), got(want.size(), -1.0f);
      reference::linear_fp8(x.data(), s.m, mat, want.data());
      be->linear_fp8(x.data(), s.m, mat, got.data());
      EXPECT_EQ(linear_disagreement(*be, got, want, x.data(), s.m, mat, &worst), "") << describe(*be, s);
      const std::vector<float> row_major = got;
      std::unique_ptr<PackedWeights> packed;
      const auto mat_packed = packed_for(*be, mat, packed);
      std::fill(got.begin(), got.end(), -1.0f);
      be->linear_fp8(x.data(), s.m, mat_packed, got.data());
      EXPECT_EQ(first_difference(got, row_major), "") << "packed " << describe(*be, s);
    }
  }
  if (worst > 0) std::printf("[simd] amx_bf16 linear_fp8: largest |got - want| / (u·S) %.1f\n", worst);
}

TEST(KernelsSimd, Fp4MatchesScalar) {
  std::mt19937 rng(12);
  for (const Backend* be : fast_backends()) {
    for (const Shape& s : kQuantShapes) {
      const std::vector<float> x = random_activations(rng, s.m, s.k);
      const std::vector<uint8_t> w = random_bytes(rng, static_cast<size_t>(s.n * s.k / 2));
      const std::vector<uint8_t> sc = random_scales(rng, static_cast<size_t>(s.n * (s.k / 32)));
      const Fp4Matrix mat{w.data(), sc.data(), s.n, s.k};
      std::vector<float> want(static_cast<size_t>(s.m * s.n)), got(want.size(), -1.0f);
      reference::linear_fp4(x.data(), s.m, mat, want.data());
      be->linear_fp4(x.data(), s.m, mat, got.data());
      EXPECT_EQ(linear_disagreement(*be, got, want, x.data(), s.m, mat), "") << describe(*be, s);
      const std::vector<float> row_major = got;
      std::unique_ptr<PackedWeights> packed;
      const auto mat_packed = packed_for(*be, mat, packed);
      std::fill(got.begin(), got.end(), -1.0f);
      be->linear_fp4(x.data(), s.m, mat_packed, got.data());
      EXPECT_EQ(first_difference(got, row_major), "") << "packed " << describe(*be, s);
    }
  }
}

// Scales (or, for BF16 layers, values) that would put an operand of the AMX level outside its safe
// range (a product subnormal, which the tile unit flushes, or a sum near overflow) send that weight
// tile, or that activation row, to the reference's computation: those outputs keep the reference's
// bits at every level.
TEST(KernelsSimd, OutOfRangeScalesTakeTheReferencesPath) {
  std::mt19937 rng(15);
  const int64_t m = 6, n = 96, k = 256, kb = k / 32;
  std::vector<float> x = random_activations(rng, m, k);
  for (int64_t j = 0; j < k; ++j) {
    x[1 * k + j] = std::ldexp(x[1 * k + j], 45);   // row 1: act_quant scales near 2^40
    x[4 * k + j] = std::ldexp(x[4 * k + j], -62);  // row 4: near 2^-70
    x[5 * k + j] = std::ldexp(x[5 * k + j], -118);  // row 5: BF16 products below 2^-126
  }
  std::vector<uint8_t> w8 = random_e4m3(rng, static_cast<size_t>(n * k)), s8 = random_scales(rng, (n / 32) * kb);
  s8[1 * kb + 3] = 2;    // weight tile 1 (rows 32..63), one block at 2^-125
  s8[2 * kb + 0] = 250;  // tile 2, one block at 2^123
  std::vector<uint8_t> w4 = random_bytes(rng, static_cast<size_t>(n * k / 2)), s4 = random_scales(rng, n * kb);
  s4[40 * kb + 5] = 3;    // row 40 (tile 1)
  s4[70 * kb + 1] = 252;  // row 70 (tile 2)
  std::vector<uint16_t> wb = random_bf16_bits(rng, static_cast<size_t>(n * k));
  wb[40 * k + 17] = 0x0003;  // a subnormal weight in tile 1 (the unit would flush it)
  wb[70 * k + 9] = bf16_from_f32(0x1p60f);  // a weight past 2^40 in tile 2
  const Fp8Matrix m8{w8.data(), s8.data(), n, k};
  const Fp4Matrix m4{w4.data(), s4.data(), n, k};
  const Bf16Matrix mb{wb.data(), n, k};
  std::vector<float> want8(static_cast<size_t>(m * n)), want4(want8.size()), wantb(want8.size());
  reference::linear_fp8(x.data(), m, m8, want8.data());
  reference::linear_fp4(x.data(), m, m4, want4.data());
  reference::linear_bf16(x.data(), m, mb, wantb.data());
  // the outputs of rows 1, 4 and 5, and of tiles 1 and 2 (outputs 32..95)
  const auto fallback_part = [&](const std::vector<float>& y) {
    std::vector<float> out;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t r = 0; r < n; ++r) {
        if (i == 1 || i == 4 || i == 5 || r >= 32) out.push_back(y[i * n + r]);
      }
    }
    return out;
  };
  for (const Backend* be : fast_backends()) {
    for (const bool packed : {false, true}) {
      std::unique_ptr<PackedWeights> p8, p4;
      const Fp8Matrix a8 = packed ? packed_for(*be, m8, p8) : m8;
      const Fp4Matrix a4 = packed ? packed_for(*be, m4, p4) : m4;
      std::unique_ptr<PackedWeights> pb;
      const Bf16Matrix ab = packed ? packed_for(*be, mb, pb) : mb;
      std::vector<float> got8(want8.size()), got4(want4.size()), gotb(wantb.size());
      be->linear_fp8(x.data(), m, a8, got8.data());
      be->linear_fp4(x.data(), m, a4, got4.data());
      be->linear_bf16(x.data(), m, ab, gotb.data());
      EXPECT_EQ(first_difference(fallback_part(gotb), fallback_part(wantb), true), "") << "bf16 " << label(*be);
      EXPECT_EQ(linear_disagreement(*be, gotb, wantb, x.data(), m, mb), "") << "bf16 " << label(*be);
      EXPECT_EQ(first_difference(fallback_part(got8), fallback_part(want8), true), "") << "fp8 " << label(*be);
      EXPECT_EQ(first_difference(fallback_part(got4), fallback_part(want4), true), "") << "fp4 " << label(*be);
      EXPECT_EQ(linear_disagreement(*be, got8, want8, x.data(), m, m8), "") << "fp8 " << label(*be);
      EXPECT_EQ(linear_disagreement(*be, got4, want4, x.data(), m, m4), "") << "fp4 " << label(*be);
      if (packed && ab.packed.tile_rows > 0) {
        // A packed BF16 matrix without its row-major values (the loader drops wo_a's converted copy):
        // the same bits, fallbacks included (tiles 1 and 2 and rows 1, 4, 5 take them).
        Bf16Matrix only = ab;
        only.w = nullptr;
        std::vector<float> packed_only(wantb.size());
        be->linear_bf16(x.data(), m, only, packed_only.data());
        EXPECT_EQ(first_difference(packed_only, gotb, true), "") << "bf16 packed only " << label(*be);
        // and an FP4 one without its row-major bytes and scales (the expert cache's)
        Fp4Matrix only4 = a4;
        only4.w = nullptr;
        only4.scale = nullptr;
        std::vector<float> packed_only4(want4.size());
        be->linear_fp4(x.data(), m, only4, packed_only4.data());
        EXPECT_EQ(first_difference(packed_only4, got4, true), "") << "fp4 packed only " << label(*be);
      }
    }
  }
}

// BF16 weights below the range whose products vdpbf16ps keeps (nonzero magnitudes under 2^-56): with
// activations at 2^-40 and weights at 2^-92 every product is subnormal, exact in fp32 (its lowest bit
// is 2^-146) and flushed by the instruction. Their tile takes the fp32 chains, decode steps (the
// AVX-512 GEMV) and prompts alike: the reference's bits, subnormal outputs and all.
TEST(KernelsSimd, Bf16WeightsBelowThePairsRangeMatchScalar) {
  std::mt19937 rng(17);
  const int64_t n = 96, k = 320;
  std::vector<float> x(static_cast<size_t>(6 * k));
  for (float& v : x) v = random_bf16_at(rng, -40);
  std::vector<uint16_t> wb(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r) {  // tile 1 (rows 32..63) at 2^-92, the others at 2^-3
    const int exponent = r >= 32 && r < 64 ? -92 : -3;
    for (int64_t j = 0; j < k; ++j) wb[static_cast<size_t>(r * k + j)] = bf16_from_f32(random_bf16_at(rng, exponent));
  }
  const Bf16Matrix mb{wb.data(), n, k};
  for (const int64_t m : {int64_t{1}, int64_t{3}, int64_t{6}}) {
    std::vector<float> want(static_cast<size_t>(m * n)), want_f32(want.size());
    reference::linear_bf16(x.data(), m, mb, want.data());
    reference::linear_f32(x.data(), m, mb, want_f32.data());
    for (const Backend* be : fast_backends()) {
      if (!bits_are_the_references(*be)) continue;  // the AMX level's sums are its own
      std::unique_ptr<PackedWeights> pb;
      const Bf16Matrix packed = packed_for(*be, mb, pb);
      std::vector<float> got(want.size()), got_f32(want.size());
      be->linear_bf16(x.data(), m, packed, got.data());
      be->linear_f32(x.data(), m, packed, got_f32.data());
      EXPECT_EQ(first_difference(got, want), "") << "bf16 m=" << m << " " << label(*be);
      EXPECT_EQ(first_difference(got_f32, want_f32), "") << "f32 m=" << m << " " << label(*be);
    }
  }
}

// The AVX-512-BF16 level folds power-of-two scales into its operands while every scale exponent is
// within ±50 (simd_avx512_bf16.cpp); a weight tile with a scale outside takes the AVX-512 path, and so
// does a call with an activation scale outside. Activation scales at that edge (act_quant's least is
// 2^-22) and, in a second call, one past it; weight scales at ±50, ±51 and 2^-115 (folded, such a
// tile's small weights would be subnormal bf16 values, which vdpbf16ps flushes); the smallest and
// largest codes (e4m3 subnormals among the activations and FP8 weights, ±448, FP4 ±0.5 and ±6): the
// reference's bits at every level, through the GEMM path and the GEMV.
TEST(KernelsSimd, ScalesAtTheFoldedRangesEdgesMatchScalar) {
  std::mt19937 rng(16);
  const int64_t n = 96, k = 256, kb = k / 32;
  const int exponents[] = {50, 49, 25, 0, -22, 10, -10, 50, 51};  // the last row only in the second call
  const int64_t m = std::size(exponents);
  std::vector<float> x(static_cast<size_t>(m * k));
  std::uniform_int_distribution<int> pick(0, 3);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < k; ++j) {
      // each block's largest |x| is 448·2^e (act_quant's scale 2^e); a quarter of the values fall below
      // e4m3's normal range once divided by it
      const float v = j % 32 == 0 ? 448.0f : pick(rng) == 0 ? std::ldexp(dist(rng), -8) : 100.0f * dist(rng);
      x[static_cast<size_t>(i * k + j)] = round_bf16(std::ldexp(v, exponents[i]));
    }
  }
  // weight scales block by block (FP8: per 32-row tile; FP4: per row): the first tile at 2^±50, the
  // second at each of the codes, the third at 2^-115 throughout (so nothing larger hides its sums)
  const uint8_t codes[] = {127 + 50, 127 - 51, 127 + 51, 127, 127 - 50, 127 - 115, 127 + 49};
  const auto code = [&](size_t tile, size_t i) -> uint8_t {
    return tile == 0 ? codes[i % 2 ? 0 : 4] : tile == 1 ? codes[i % std::size(codes)] : uint8_t{127 - 115};
  };
  std::vector<uint8_t> s8(static_cast<size_t>((n / 32) * kb)), s4(static_cast<size_t>(n * kb));
  for (size_t i = 0; i < s8.size(); ++i) s8[i] = code(i / kb, i);
  for (size_t i = 0; i < s4.size(); ++i) s4[i] = code(i / kb / 32, i + i / kb);
  std::vector<uint8_t> w8 = random_e4m3(rng, static_cast<size_t>(n * k));
  // e4m3 subnormals, then ±448
  for (size_t i = 0; i < w8.size(); i += 5) w8[i] = static_cast<uint8_t>((i % 2 ? 0x80 : 0x00) | (1 + i % 7));
  for (size_t i = 3; i < w8.size(); i += 11) w8[i] = i % 2 ? 0xFE : 0x7E;
  std::vector<uint8_t> w4 = random_bytes(rng, static_cast<size_t>(n * k / 2));
  for (size_t i = 0; i < w4.size(); i += 3) w4[i] = i % 2 ? 0x79 : 0x9F;  // ±6 and ±0.5
  const Fp8Matrix m8{w8.data(), s8.data(), n, k};
  const Fp4Matrix m4{w4.data(), s4.data(), n, k};
  for (const int64_t rows : {m - 1, m, int64_t{1}}) {
    std::vector<float> want8(static_cast<size_t>(rows * n)), want4(want8.size());
    reference::linear_fp8(x.data(), rows, m8, want8.data());
    reference::linear_fp4(x.data(), rows, m4, want4.data());
    for (const Backend* be : fast_backends()) {
      if (!bits_are_the_references(*be)) continue;  // the AMX level's sums are its own
      for (const bool packed : {false, true}) {
        std::unique_ptr<PackedWeights> p8, p4;
        std::vector<float> got8(want8.size()), got4(want4.size());
        be->linear_fp8(x.data(), rows, packed ? packed_for(*be, m8, p8) : m8, got8.data());
        be->linear_fp4(x.data(), rows, packed ? packed_for(*be, m4, p4) : m4, got4.data());
        EXPECT_EQ(first_difference(got8, want8), "") << "fp8 m=" << rows << (packed ? " packed " : " ") << label(*be);
        EXPECT_EQ(first_difference(got4, want4), "") << "fp4 m=" << rows << (packed ? " packed " : " ") << label(*be);
      }
    }
  }
}

// Every level, the AMX one included (whose bits are its own): a row's output is the same alone, in
// a decode-sized batch and in a prompt-sized one, so batching, chunking and speculative verification
// never change a token.
TEST(KernelsSimd, ARowsOutputDoesNotDependOnItsBatch) {
  std::mt19937 rng(14);
  const int64_t n = 70, k = 544, big = 1040;  // more than one AMX row block (1024)
  const std::vector<float> x = random_activations(rng, big, k);
  const std::vector<uint8_t> w8 = random_e4m3(rng, static_cast<size_t>(n * k));
  const std::vector<uint8_t> s8 = random_scales(rng, static_cast<size_t>(((n + 31) / 32) * (k / 32)));
  const std::vector<uint8_t> w4 = random_bytes(rng, static_cast<size_t>(n * k / 2));
  const std::vector<uint8_t> s4 = random_scales(rng, static_cast<size_t>(n * (k / 32)));
  const std::vector<uint16_t> wb = random_bf16_bits(rng, static_cast<size_t>(n * k));
  // Order-sensitive FP8 weights against activations of ones: the first four K blocks add 448 per
  // product (a running sum of 2^15.8, whose fp32 unit is 2^-8), the last four take it away again,
  // small products (multiples of 2^-9) lie between, so the result is about the size of the rounding
  // the large running sum causes: any change of summation order shows.
  std::vector<uint8_t> c8(static_cast<size_t>(n * k));
  std::uniform_int_distribution<int> bit(0, 1), mant(0, 7), expo(1, 3);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < k; ++j) {
      c8[r * k + j] = j < 128             ? 0x7E
                      : j >= k - 128      ? 0xFE
                                          : static_cast<uint8_t>((bit(rng) << 7) | (expo(rng) << 3) | mant(rng));  // 2^-6 .. 2^-3
    }
  }
  const std::vector<uint8_t> ones_scale(static_cast<size_t>(((n + 31) / 32) * (k / 32)), 127);
  std::vector<float> ones(x.size(), 1.0f);
  for (const Backend* be : fast_backends()) {
    std::unique_ptr<PackedWeights> p8, p4, pc;
    const Fp8Matrix m8 = packed_for(*be, Fp8Matrix{w8.data(), s8.data(), n, k}, p8);
    const Fp4Matrix m4 = packed_for(*be, Fp4Matrix{w4.data(), s4.data(), n, k}, p4);
    const Fp8Matrix mc = packed_for(*be, Fp8Matrix{c8.data(), ones_scale.data(), n, k}, pc);
    std::unique_ptr<PackedWeights> pb;
    const Bf16Matrix mb = packed_for(*be, Bf16Matrix{wb.data(), n, k}, pb);
    for (const int kind : {0, 1, 2, 3}) {
      const char* name = kind == 0 ? "fp8 " : kind == 1 ? "fp4 " : kind == 2 ? "fp8 cancelling " : "bf16 ";
      const auto run = [&](int64_t first, int64_t rows) {
        std::vector<float> y(static_cast<size_t>(rows * n));
        if (kind == 0) be->linear_fp8(x.data() + first * k, rows, m8, y.data());
        if (kind == 1) be->linear_fp4(x.data() + first * k, rows, m4, y.data());
        if (kind == 2) be->linear_fp8(ones.data() + first * k, rows, mc, y.data());
        if (kind == 3) be->linear_bf16(x.data() + first * k, rows, mb, y.data());
        return y;
      };
      const std::vector<float> all = run(0, big);
      for (const int64_t first : {int64_t{0}, int64_t{5}, int64_t{1020}, int64_t{1036}}) {
        for (const int64_t rows : {int64_t{1}, int64_t{4}, int64_t{37}}) {
          if (first + rows > big) continue;
          const std::vector<float> part = run(first, rows);
          const std::vector<float> want(all.begin() + first * n, all.begin() + (first + rows) * n);
          EXPECT_EQ(first_difference(part, want), "") << name << label(*be) << " rows " << first << "+" << rows;
        }
      }
    }
  }
}

TEST(KernelsSimd, Bf16AndF32MatchScalar) {
  std::mt19937 rng(13);
  // K need not be a multiple of 32 here: partial last blocks, K shorter than one block, and K = 0.
  std::vector<Shape> shapes = kQuantShapes;
  for (const Shape s : {Shape{1, 9, 200}, Shape{1, 31, 1}, Shape{1, 5, 0}, Shape{4, 23, 77}, Shape{9, 50, 333},
                        Shape{1, 300, 5120}}) {
    shapes.push_back(s);
  }
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (const Backend* be : fast_backends()) {
    for (const Shape& s : shapes) {
      const std::vector<float> xb = random_activations(rng, s.m, s.k);  // bf16 values for linear_bf16
      std::vector<float> xf(static_cast<size_t>(s.m * s.k));
      for (auto& v : xf) v = dist(rng);  // any fp32 for linear_f32
      const std::vector<uint16_t> w = random_bf16_bits(rng, static_cast<size_t>(s.n * s.k));
      const Bf16Matrix mat{w.data(), s.n, s.k};
      std::unique_ptr<PackedWeights> packed;
      const auto mat_packed = packed_for(*be, mat, packed);
      std::vector<float> want(static_cast<size_t>(s.m * s.n)), got(want.size(), -1.0f);
      reference::linear_bf16(xb.data(), s.m, mat, want.data());
      be->linear_bf16(xb.data(), s.m, mat, got.data());
      EXPECT_EQ(linear_disagreement(*be, got, want, xb.data(), s.m, mat), "") << "bf16 " << describe(*be, s);
      const std::vector<float> row_major = got;
      std::fill(got.begin(), got.end(), -1.0f);
      be->linear_bf16(xb.data(), s.m, mat_packed, got.data());
      EXPECT_EQ(first_difference(got, row_major), "") << "bf16 packed " << describe(*be, s);
      reference::linear_f32(xf.data(), s.m, mat, want.data());
      std::fill(got.begin(), got.end(), -1.0f);
      be->linear_f32(xf.data(), s.m, mat, got.data());
      EXPECT_EQ(first_difference(got, want), "") << "f32 " << describe(*be, s);
      std::fill(got.begin(), got.end(), -1.0f);
      be->linear_f32(xf.data(), s.m, mat_packed, got.data());
      EXPECT_EQ(first_difference(got, want), "") << "f32 packed " << describe(*be, s);
      // linear_f32 on activations that are all bf16 values (the vision tower's) takes the exact-product
      // path: still the reference's bits, unrounded
      reference::linear_f32(xb.data(), s.m, mat, want.data());
      for (const Bf16Matrix* m : {&mat, &mat_packed}) {
        std::fill(got.begin(), got.end(), -1.0f);
        be->linear_f32(xb.data(), s.m, *m, got.data());
        EXPECT_EQ(first_difference(got, want), "") << "f32 on bf16 values " << (m == &mat ? "" : "packed ") << describe(*be, s);
      }
    }
  }
}

// Products below fp32's normal range, exact there (at least 2^-149): the reference keeps them, a
// kernel that flushes subnormals (vdpbf16ps) must not see them. Activations of 2^-100 against weights
// of 2^-30; and O(1) activations against a matrix whose second tile holds subnormal bf16 weights
// (2^-130) beside ordinary ones. Row-major and packed.
TEST(KernelsSimd, Bf16ProductsBelowTheNormalRangeMatchScalar) {
  std::mt19937 rng(31);
  const int64_t m = 9, n = 70, k = 96;
  for (const Backend* be : fast_backends()) {
    std::vector<float> tiny_x(static_cast<size_t>(m * k)), x(tiny_x.size());
    for (auto& v : tiny_x) v = random_bf16_at(rng, -100);
    for (auto& v : x) v = random_bf16_at(rng, 0);
    std::vector<uint16_t> w_small(static_cast<size_t>(n * k)), w_subnormal_tile(w_small.size());
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < k; ++j) {
        w_small[static_cast<size_t>(r * k + j)] = bf16_from_f32(random_bf16_at(rng, -30));
        const int exponent = r >= 32 && r < 64 ? -130 : -3;
        w_subnormal_tile[static_cast<size_t>(r * k + j)] = bf16_from_f32(random_bf16_at(rng, exponent));
      }
    }
    for (const auto& [in, weights] : {std::pair{&tiny_x, &w_small}, std::pair{&x, &w_subnormal_tile}}) {
      const Bf16Matrix mat{weights->data(), n, k};
      std::unique_ptr<PackedWeights> packed;
      const auto mat_packed = packed_for(*be, mat, packed);
      const std::string what = in == &x ? "subnormal weights " : "tiny activations ";
      std::vector<float> want(static_cast<size_t>(m * n)), got(want.size());
      for (const Bf16Matrix* mm : {&mat, &mat_packed}) {
        reference::linear_bf16(in->data(), m, mat, want.data());
        be->linear_bf16(in->data(), m, *mm, got.data());
        EXPECT_EQ(first_difference(got, want), "") << "bf16 " << what << label(*be);
        reference::linear_f32(in->data(), m, mat, want.data());
        be->linear_f32(in->data(), m, *mm, got.data());
        EXPECT_EQ(first_difference(got, want), "") << "f32 " << what << label(*be);
      }
    }
  }
}

// Inputs where the order of the additions shows in the bf16 outputs: in each 32-block a few large
// products cancel around many small ones with low-order bits, so the fp32 partial sums round, and
// the result is about as small as those roundings. A kernel that summed in any other order, or
// paired an activation with the wrong weight, fails here (random inputs alone would rarely show it
// after the output's rounding to bf16).
TEST(KernelsSimd, OrderSensitiveInputsMatchScalar) {
  std::mt19937 rng(19);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_int_distribution<int> bit(0, 1), mant(0, 7);
  const Shape shapes[] = {{1, 64, 256}, {3, 40, 128}, {9, 33, 96}};
  for (const Backend* be : fast_backends()) {
    for (const Shape& s : shapes) {
      // FP8: x = 1 at both ends of each block (codes 256 after act_quant), ~2^-11 inside (codes
      // near 2^-3); weights ±240 at the ends (cancelling), codes near 2^-3 inside.
      std::vector<float> x(static_cast<size_t>(s.m * s.k));
      for (int64_t j = 0; j < s.m * s.k; ++j) {
        const int64_t in_block = j % 32;
        x[j] = in_block == 0 || in_block == 31 ? 1.0f : round_bf16(std::ldexp(dist(rng), -11));
      }
      std::vector<uint8_t> w8(static_cast<size_t>(s.n * s.k));
      const uint8_t big = e4m3_from_f32(240.0f);
      for (int64_t j = 0; j < s.n * s.k; ++j) {
        const int64_t in_block = j % 32;
        w8[j] = in_block == 0    ? big
                : in_block == 31 ? static_cast<uint8_t>(big | 0x80)
                                 : static_cast<uint8_t>((bit(rng) << 7) | (4 << 3) | mant(rng));
      }
      const std::vector<uint8_t> sc8(static_cast<size_t>(((s.n + 31) / 32) * (s.k / 32)), 127);
      const Fp8Matrix m8{w8.data(), sc8.data(), s.n, s.k};
      std::vector<float> want(static_cast<size_t>(s.m * s.n)), got(want.size());
      reference::linear_fp8(x.data(), s.m, m8, want.data());
      be->linear_fp8(x.data(), s.m, m8, got.data());
      EXPECT_EQ(linear_disagreement(*be, got, want, x.data(), s.m, m8), "") << "fp8 " << describe(*be, s);

      // FP4: 12 products of 256·6 first, 8 small ones (2^-8-ish activations, ±0.5 or ±1), then 12
      // of -256·6: the partial reaches 2^14, where fp32 keeps only 2^-9.
      for (int64_t j = 0; j < s.m * s.k; ++j) {
        const int64_t in_block = j % 32;
        x[j] = in_block < 12 || in_block >= 20 ? 1.0f : round_bf16(std::ldexp(1.0f + std::fabs(dist(rng)), -16));
      }
      std::vector<uint8_t> w4(static_cast<size_t>(s.n * s.k / 2));
      for (int64_t r = 0; r < s.n; ++r) {
        for (int64_t j = 0; j < s.k; ++j) {
          const int64_t in_block = j % 32;
          const int code = in_block < 12 ? 7 : in_block >= 20 ? 15 : (bit(rng) << 3) | (1 + bit(rng));
          uint8_t& byte = w4[r * (s.k / 2) + j / 2];
          byte = static_cast<uint8_t>(j % 2 == 0 ? (byte & 0xF0) | code : (byte & 0x0F) | (code << 4));
        }
      }
      const std::vector<uint8_t> sc4(static_cast<size_t>(s.n * (s.k / 32)), 127);
      const Fp4Matrix m4{w4.data(), sc4.data(), s.n, s.k};
      reference::linear_fp4(x.data(), s.m, m4, want.data());
      be->linear_fp4(x.data(), s.m, m4, got.data());
      EXPECT_EQ(linear_disagreement(*be, got, want, x.data(), s.m, m4), "") << "fp4 " << describe(*be, s);

      // bf16 / f32: one chain over all of k: ±1000·w at the two ends, small terms between.
      for (int64_t i = 0; i < s.m; ++i) {
        for (int64_t j = 0; j < s.k; ++j) {
          x[i * s.k + j] = j == 0 ? 1000.0f : j == s.k - 1 ? -1000.0f : round_bf16(dist(rng) * 1e-3f);
        }
      }
      std::vector<uint16_t> wb = random_bf16_bits(rng, static_cast<size_t>(s.n * s.k));
      for (int64_t r = 0; r < s.n; ++r) wb[r * s.k + s.k - 1] = wb[r * s.k];
      const Bf16Matrix mb{wb.data(), s.n, s.k};
      reference::linear_bf16(x.data(), s.m, mb, want.data());
      be->linear_bf16(x.data(), s.m, mb, got.data());
      EXPECT_EQ(linear_disagreement(*be, got, want, x.data(), s.m, mb), "") << "bf16 " << describe(*be, s);
      reference::linear_f32(x.data(), s.m, mb, want.data());
      be->linear_f32(x.data(), s.m, mb, got.data());
      EXPECT_EQ(first_difference(got, want), "") << "f32 " << describe(*be, s);
    }
  }
}

// act_quant in vector code against quant.cpp's, over every bf16 bit pattern (NaNs, infinities,
// subnormals, both zeros) in three arrangements, so blocks see every kind of amax.
TEST(KernelsSimd, ActivationQuantizationMatchesScalar) {
  using QuantFn = detail::QuantizedActivations (*)(const float*, int64_t, int64_t, float);
  std::vector<std::pair<Isa, QuantFn>> fns;
  if (isa_supported(Isa::avx2)) fns.emplace_back(Isa::avx2, detail::quantize_activations_avx2);
  if (isa_supported(Isa::avx512)) fns.emplace_back(Isa::avx512, detail::quantize_activations_avx512);
  std::vector<float> all(65536);
  for (uint32_t b = 0; b < 65536; ++b) all[b] = bf16_to_f32(static_cast<uint16_t>(b));
  std::mt19937 rng(17);
  std::vector<float> shuffled = all;
  std::shuffle(shuffled.begin(), shuffled.end(), rng);
  std::vector<float> finite;  // no NaN or infinity: blocks with ordinary, tiny and huge amax
  for (float v : shuffled) {
    if (std::isfinite(v)) finite.push_back(v);
  }
  finite.resize(finite.size() / 32 * 32);
  const int64_t k = 1024;
  for (const auto& [isa, fn] : fns) {
    for (const std::vector<float>* input : {&all, &shuffled, &finite}) {
      const int64_t m = static_cast<int64_t>(input->size()) / k;
      for (const float prescale : {1.0f, 256.0f}) {
        const detail::QuantizedActivations want = detail::quantize_activations(input->data(), m, k, prescale);
        const detail::QuantizedActivations got = fn(input->data(), m, k, prescale);
        EXPECT_EQ(first_difference(got.values, want.values), "") << isa_name(isa) << " prescale " << prescale;
        EXPECT_EQ(first_difference(got.scales, want.scales), "") << isa_name(isa) << " scales";
      }
    }
  }
}

// Values at the edges: NaN weight codes (the FP8 fast path hands those tiles to the reference code),
// scale codes 0 (a subnormal 2^-127), 254 and 255 (NaN), activations near the fp32 limits and bf16
// subnormals. The outputs then hold infinities and NaNs: every non-NaN output matches bit for bit,
// and every NaN is a NaN in both.
TEST(KernelsSimd, ExtremeValuesMatchScalar) {
  std::mt19937 rng(14);
  for (const Backend* be : fast_backends()) {
    for (const Shape& s : {Shape{1, 70, 256}, Shape{5, 70, 256}}) {
      std::vector<float> x = random_activations(rng, s.m, s.k);
      x[3] = 3.0e38f;
      x[40] = -2.5e38f;
      x[100] = std::ldexp(1.0f, -133);  // bf16 subnormal
      x[101] = -std::ldexp(3.0f, -130);
      std::vector<uint8_t> w8 = random_e4m3(rng, static_cast<size_t>(s.n * s.k));
      w8[5 * s.k + 17] = 0x7F;    // NaN codes in rows 5 and 40
      w8[40 * s.k + 200] = 0xFF;
      std::vector<uint8_t> sc8 = random_scales(rng, static_cast<size_t>(((s.n + 31) / 32) * (s.k / 32)));
      sc8[1] = 0;
      sc8[2] = 254;
      sc8[9] = 255;
      const Fp8Matrix m8{w8.data(), sc8.data(), s.n, s.k};
      std::vector<float> want(static_cast<size_t>(s.m * s.n)), got(want.size());
      reference::linear_fp8(x.data(), s.m, m8, want.data());
      be->linear_fp8(x.data(), s.m, m8, got.data());
      EXPECT_EQ(first_difference(got, want, true), "") << "fp8 " << describe(*be, s);
      std::unique_ptr<PackedWeights> p8;
      const auto m8_p8 = packed_for(*be, m8, p8);  // flags the tiles of rows 5 and 40
      be->linear_fp8(x.data(), s.m, m8_p8, got.data());
      EXPECT_EQ(first_difference(got, want, true), "") << "fp8 packed " << describe(*be, s);

      const std::vector<uint8_t> w4 = random_bytes(rng, static_cast<size_t>(s.n * s.k / 2));
      std::vector<uint8_t> sc4 = random_scales(rng, static_cast<size_t>(s.n * (s.k / 32)));
      sc4[3] = 0;
      sc4[50] = 254;
      sc4[77] = 255;
      const Fp4Matrix m4{w4.data(), sc4.data(), s.n, s.k};
      reference::linear_fp4(x.data(), s.m, m4, want.data());
      be->linear_fp4(x.data(), s.m, m4, got.data());
      EXPECT_EQ(first_difference(got, want, true), "") << "fp4 " << describe(*be, s);
      std::unique_ptr<PackedWeights> p4;
      const auto m4_p4 = packed_for(*be, m4, p4);  // scale codes 0, 254 and 255 through the vector decode
      be->linear_fp4(x.data(), s.m, m4_p4, got.data());
      EXPECT_EQ(first_difference(got, want, true), "") << "fp4 packed " << describe(*be, s);
    }
  }
}

// ---- packed weights ---------------------------------------------------------------------------

// The layout itself: column c of the rows of a tile side by side, zero rows after the last one, rows
// padded to whole K blocks, FP4 scales per tile in the same order with 127 for the padding rows.
TEST(PackedWeights, LayoutIsColumnsOfTileRows) {
  const int64_t n = 5, k = 40;  // 2 tiles of 4 rows; k padded to 64
  std::vector<uint8_t> w(static_cast<size_t>(n * k / 2));
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint8_t>(i * 7 + 1);
  std::vector<uint8_t> sc(static_cast<size_t>(n * 1));
  for (size_t i = 0; i < sc.size(); ++i) sc[i] = static_cast<uint8_t>(120 + i);
  const std::unique_ptr<Backend> be = make_backend({Isa::scalar, 2, true});
  const PackedWeights p(be->exec(), be->allocator(), w.data(), n, k / 2, 32, 1, 4, sc.data(), 1, false);
  const PackedView v = p.view();
  ASSERT_EQ(v.tile_rows, 4);
  ASSERT_EQ(v.tile_bytes, 32 * 4);
  for (int64_t t = 0; t < 2; ++t) {
    for (int64_t c = 0; c < 32; ++c) {
      for (int64_t r = 0; r < 4; ++r) {
        const int64_t row = t * 4 + r;
        const uint8_t want = row < n && c < k / 2 ? w[static_cast<size_t>(row * (k / 2) + c)] : 0;
        EXPECT_EQ(v.tiles[t * v.tile_bytes + c * 4 + r], want) << t << " " << c << " " << r;
      }
    }
    for (int64_t r = 0; r < 4; ++r) {
      const int64_t row = t * 4 + r;
      EXPECT_EQ(v.scales[t * v.scale_tile_bytes + r], row < n ? sc[static_cast<size_t>(row)] : 127);
    }
  }
  EXPECT_EQ(v.from_row(4).tiles, v.tiles + v.tile_bytes);
  EXPECT_EQ(v.from_row(2).tile_rows, 0) << "a sub-matrix off the tile grid has no packed view";
}

// A sub-matrix of packed rows (one group of a block-diagonal projection such as wo_a) gives the
// rows of the whole matrix, whether it starts on a tile boundary (packed) or not (row-major).
TEST(PackedWeights, RowGroupsMatchTheWholeMatrix) {
  std::mt19937 rng(23);
  for (const Backend* be : fast_backends()) {
    const int64_t tile = be->weight_tile_rows(), n = 4 * tile + 8, k = 96;
    const std::vector<uint16_t> w = random_bf16_bits(rng, static_cast<size_t>(n * k));
    const std::vector<float> x = random_activations(rng, 1, k);
    const Bf16Matrix all{w.data(), n, k};
    const std::unique_ptr<PackedWeights> packed = be->pack(all);
    ASSERT_NE(packed, nullptr);
    std::vector<float> want(static_cast<size_t>(n));
    // the reference's bits at an exact level; the level's own whole-matrix bits at amx_bf16
    bits_are_the_references(*be) ? reference::linear_bf16(x.data(), 1, all, want.data())
                                 : be->linear_bf16(x.data(), 1, all, want.data());
    for (const int64_t row0 : {int64_t{0}, tile, 2 * tile + 8, int64_t{3}}) {
      const int64_t count = std::min<int64_t>(2 * tile, n - row0);
      const PackedView pv = packed->view().from_row(row0);
      const Bf16Matrix part{w.data() + row0 * k, count, k, pv};
      std::vector<float> got(static_cast<size_t>(count), -1.0f);
      be->linear_bf16(x.data(), 1, part, got.data());
      const std::vector<float> expect(want.begin() + row0, want.begin() + row0 + count);
      EXPECT_EQ(first_difference(got, expect), "") << label(*be) << " rows from " << row0;
    }
  }
}

// ---- sparse attention ------------------------------------------------------------------------

// Packed K=V rows as the state holds them: window rows (E4M3 codes, E8M0 per 32) and compressed
// rows (E2M1 nibbles, E4M3 per 16), every code but the NaN ones, scales around 1.
struct PackedRows {
  std::vector<std::vector<uint8_t>> window, compressed;
  std::vector<const uint8_t*> window_ptr, compressed_ptr;
  KvRows list() const {
    return {window_ptr.data(), static_cast<int64_t>(window_ptr.size()), compressed_ptr.data(),
            static_cast<int64_t>(compressed_ptr.size())};
  }
};
PackedRows random_kv_rows(std::mt19937& rng, int64_t d, size_t n_window, size_t n_compressed, double null_share) {
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::uniform_int_distribution<int> e8m0(120, 132), e4m3_scale(0x30, 0x48);
  PackedRows p;
  for (size_t j = 0; j < n_window; ++j) {
    std::vector<uint8_t> row = random_e4m3(rng, static_cast<size_t>(window_row_bytes(d)));
    for (int64_t b = 0; b < d / 32; ++b) row[static_cast<size_t>(d + b)] = static_cast<uint8_t>(e8m0(rng));
    p.window.push_back(std::move(row));
  }
  for (size_t j = 0; j < n_compressed; ++j) {
    std::vector<uint8_t> row = random_bytes(rng, static_cast<size_t>(main_kv_bytes(d)));
    for (int64_t b = 0; b < d / 16; ++b) row[static_cast<size_t>(d / 2 + b)] = static_cast<uint8_t>(e4m3_scale(rng));
    p.compressed.push_back(std::move(row));
  }
  for (auto& r : p.window) p.window_ptr.push_back(unit(rng) >= null_share ? r.data() : nullptr);
  for (auto& r : p.compressed) p.compressed_ptr.push_back(unit(rng) >= null_share ? r.data() : nullptr);
  return p;
}

// Lists with null entries scattered, whole null chunks, several chunks of 64 and a partial last one,
// window and compressed rows on both sides of a chunk boundary; head counts that are and are not
// multiples of the vector width; d with a scalar tail; q either bf16 values (as the model passes)
// or arbitrary fp32.
TEST(KernelsSimd, SparseAttentionMatchesScalar) {
  std::mt19937 rng(18);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  struct Case {
    int64_t heads, d;
    size_t window, compressed;
    double null_share;
    bool bf16_q;
  };
  const Case cases[] = {{1, 512, 1, 0, 0.0, true},      {5, 64, 63, 0, 0.2, true},     {16, 512, 16, 48, 0.0, true},
                        {17, 96, 40, 25, 0.3, true},    {64, 512, 128, 72, 0.1, true}, {64, 512, 128, 512, 0.05, false},
                        {33, 64, 2, 128, 0.5, false},   {8, 512, 0, 0, 0.0, true},     {24, 512, 128, 64, 1.0, true}};
  for (const Backend* be : fast_backends()) {
    for (const Case& c : cases) {
      std::vector<float> q(static_cast<size_t>(c.heads * c.d)), sink(static_cast<size_t>(c.heads));
      for (auto& v : q) v = c.bf16_q ? round_bf16(dist(rng) * 0.3f) : dist(rng) * 0.3f;
      for (auto& v : sink) v = dist(rng);
      PackedRows rows = random_kv_rows(rng, c.d, c.window, c.compressed, c.null_share);
      if (c.window + c.compressed > 70) {  // a whole empty chunk
        for (size_t j = 0; j < 64; ++j) {
          (j < c.window ? rows.window_ptr[j] : rows.compressed_ptr[j - c.window]) = nullptr;
        }
      }
      const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
      std::vector<float> want(q.size()), got(q.size(), -1.0f);
      reference::sparse_attention(q.data(), c.heads, c.d, rows.list(), sink.data(), scale, want.data());
      be->sparse_attention(q.data(), c.heads, c.d, rows.list(), sink.data(), scale, got.data());
      EXPECT_EQ(first_difference(got, want), "")
          << label(*be) << " heads " << c.heads << " d " << c.d << " rows " << c.window << "+" << c.compressed;
    }
  }
}

// The packed rows attention reads decode to what the row codecs unpack: an attention over one row
// gives that row back (one row: softmax weight 1, the sink's share 0).
TEST(KernelsAttention, ReadsPackedRowsAsTheCodecsUnpackThem) {
  std::mt19937 rng(20);
  const int64_t d = 64, heads = 2;
  const PackedRows rows = random_kv_rows(rng, d, 1, 1, 0.0);
  const float no_sink[heads] = {-1e30f, -1e30f};
  const std::vector<float> q(static_cast<size_t>(heads * d), 0.0f);
  for (const bool window : {true, false}) {
    const uint8_t* row = window ? rows.window[0].data() : rows.compressed[0].data();
    const KvRows one = window ? KvRows{&row, 1, nullptr, 0} : KvRows{nullptr, 0, &row, 1};
    std::vector<float> values(static_cast<size_t>(d));
    window ? unpack_window_row(row, d, values.data()) : unpack_main_kv_row(row, d, values.data());
    for (float& v : values) v += 0.0f;  // the sums start from +0: a -0 value comes out as +0
    for (const auto& b : op_backends()) {
      std::vector<float> out(static_cast<size_t>(heads * d));
      b->sparse_attention(q.data(), heads, d, one, no_sink, 1.0f, out.data());
      for (int64_t h = 0; h < heads; ++h) {
        const std::vector<float> got(out.begin() + h * d, out.begin() + (h + 1) * d);
        EXPECT_EQ(first_difference(got, values), "") << label(*b) << (window ? " window" : " compressed");
      }
    }
  }
}

TEST(KernelsSimd, ThreadCountDoesNotChangeResults) {
  std::mt19937 rng(15);
  const Shape shapes[] = {{1, 1000, 512}, {1, 77, 4096}, {9, 333, 512}};
  for (const Isa level : available_backend_levels()) {
    const std::unique_ptr<Backend> one = make_backend({level, 1, true}), two = make_backend({level, 2, true});
    for (const Shape& s : shapes) {
      const std::vector<float> x = random_activations(rng, s.m, s.k);
      const std::vector<uint8_t> w8 = random_e4m3(rng, static_cast<size_t>(s.n * s.k));
      const std::vector<uint8_t> sc8 = random_scales(rng, static_cast<size_t>(((s.n + 31) / 32) * (s.k / 32)));
      const std::vector<uint8_t> w4 = random_bytes(rng, static_cast<size_t>(s.n * s.k / 2));
      const std::vector<uint8_t> sc4 = random_scales(rng, static_cast<size_t>(s.n * (s.k / 32)));
      const std::vector<uint16_t> wb = random_bf16_bits(rng, static_cast<size_t>(s.n * s.k));
      const Fp8Matrix m8{w8.data(), sc8.data(), s.n, s.k};
      const Fp4Matrix m4{w4.data(), sc4.data(), s.n, s.k};
      const Bf16Matrix mb{wb.data(), s.n, s.k};
      std::vector<float> r[2][4];
      for (int t = 0; t < 2; ++t) {
        const Backend& b = t == 0 ? *one : *two;
        for (auto& v : r[t]) v.assign(static_cast<size_t>(s.m * s.n), -1.0f);
        b.linear_fp8(x.data(), s.m, m8, r[t][0].data());
        b.linear_fp4(x.data(), s.m, m4, r[t][1].data());
        b.linear_bf16(x.data(), s.m, mb, r[t][2].data());
        b.linear_f32(x.data(), s.m, mb, r[t][3].data());
      }
      for (int kind = 0; kind < 4; ++kind) {
        EXPECT_EQ(first_difference(r[1][kind], r[0][kind]), "") << "kind " << kind << " " << describe(*two, s);
      }
    }
  }
}

// ---- backends ---------------------------------------------------------------------------------------

TEST(Backends, LevelsAreListedLowestFirstAndTheMachineRunsTheAvailableOnes) {
  const std::vector<Isa> all = backend_levels(), here = available_backend_levels();
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all.front(), Isa::scalar);
  ASSERT_FALSE(here.empty());
  EXPECT_EQ(here.back(), detected_isa());
  for (const Isa l : here) EXPECT_TRUE(isa_supported(l));
  for (const Isa l : all) {
    if (!isa_supported(l)) {
      EXPECT_THROW(make_backend({l, 1, true}), Error) << isa_name(l);
    }
  }
}

TEST(Backends, OptionsAreTheirs) {
  const std::unique_ptr<Backend> def = make_backend();
  EXPECT_EQ(def->level(), default_isa());
  EXPECT_EQ(def->threads(), ThreadPool::hardware_threads());
  const std::unique_ptr<Backend> b = make_backend({Isa::scalar, 3, true});
  EXPECT_EQ(b->level(), Isa::scalar);
  EXPECT_STREQ(b->name(), "scalar");
  EXPECT_EQ(b->threads(), 3);
  EXPECT_EQ(b->weight_tile_rows(), 0) << "the scalar level reads the checkpoint's layout";
  EXPECT_THROW(make_backend({Isa::scalar, -1, true}), Error);
  EXPECT_THROW(make_backend({Isa::scalar, 5000, true}), Error);
  for (const Backend* fast : fast_backends()) {
    EXPECT_GT(fast->weight_tile_rows(), 0) << label(*fast);
    const std::unique_ptr<Backend> plain = make_backend({fast->level(), 1, false});
    EXPECT_EQ(plain->weight_tile_rows(), 0) << "pack_weights = false keeps the row-major layout";
    const std::vector<uint8_t> w(64 * 32, 1), sc(2, 127);
    EXPECT_EQ(plain->pack(Fp8Matrix{w.data(), sc.data(), 64, 32}), nullptr);
  }
}

// Two backends, each with its own threads, used at once from two threads: each gives the
// reference's bits, whatever the other does.
TEST(Backends, TwoBackendsRunAtOnce) {
  std::mt19937 rng(21);
  const Shape s{3, 300, 512};
  const std::vector<float> x = random_activations(rng, s.m, s.k);
  const std::vector<uint8_t> w = random_e4m3(rng, static_cast<size_t>(s.n * s.k));
  const std::vector<uint8_t> sc = random_scales(rng, static_cast<size_t>(((s.n + 31) / 32) * (s.k / 32)));
  const Fp8Matrix mat{w.data(), sc.data(), s.n, s.k};
  std::vector<float> want(static_cast<size_t>(s.m * s.n));
  reference::linear_fp8(x.data(), s.m, mat, want.data());
  const std::unique_ptr<Backend> a = make_backend({detected_isa(), 2, true}), b = make_backend({Isa::scalar, 1, true});
  std::vector<std::string> errors(2);
  std::vector<std::thread> runs;
  for (int t = 0; t < 2; ++t) {
    runs.emplace_back([&, t] {
      const Backend& be = t == 0 ? *a : *b;
      std::vector<float> got(want.size());
      for (int rep = 0; rep < 20 && errors[t].empty(); ++rep) {
        be.linear_fp8(x.data(), s.m, mat, got.data());
        errors[t] = first_difference(got, want);
      }
    });
  }
  for (auto& r : runs) r.join();
  EXPECT_EQ(errors[0], "") << label(*a);
  EXPECT_EQ(errors[1], "") << label(*b);
}

// The AMX level is tested by the op tests above wherever it runs; say so where it does not.
TEST(KernelsSimd, AmxLevelIsTestedWhereItRuns) {
  if (!isa_supported(Isa::amx_bf16)) {
    GTEST_SKIP() << "this CPU or kernel has no AMX-BF16 tiles for this process: the amx_bf16 level "
                    "(simd_amx.cpp) is not run here";
  }
  int seen = 0;
  for (const Backend* be : fast_backends()) seen += be->level() == Isa::amx_bf16;
  EXPECT_EQ(seen, 2) << "the op tests run the level at 1 and 3 threads";
  EXPECT_NE(default_isa(), Isa::amx_bf16) << "its sums are not the reference's: never the default";
}

TEST(CpuFeatures, NamesAndLevels) {
  EXPECT_STREQ(isa_name(Isa::scalar), "scalar");
  EXPECT_STREQ(isa_name(Isa::avx2), "avx2");
  EXPECT_STREQ(isa_name(Isa::avx512), "avx512");
  EXPECT_STREQ(isa_name(Isa::avx512_bf16), "avx512_bf16");
  EXPECT_STREQ(isa_name(Isa::amx_bf16), "amx_bf16");
  const CpuFeatures& f = cpu_features();
  EXPECT_TRUE(!f.avx512 || f.avx2) << "AVX-512 level implies the AVX2 level";
  EXPECT_TRUE(!f.avx512_bf16 || f.avx512);
  EXPECT_TRUE(!f.bf16_dot_in_order || f.avx512_bf16);
  EXPECT_TRUE(!f.amx_permitted || f.amx_bf16);
  EXPECT_EQ(detected_isa() >= Isa::avx512_bf16, f.avx512_bf16 && f.bf16_dot_in_order)
      << "the AVX-512-BF16 level runs where vdpbf16ps exists and rounds in order";
  EXPECT_EQ(detected_isa() == Isa::amx_bf16, f.avx512_bf16 && f.bf16_dot_in_order && f.amx_permitted)
      << "the AMX level runs on top of it where Linux grants the tiles";
  EXPECT_TRUE(isa_supported(Isa::scalar));
  EXPECT_TRUE(isa_supported(detected_isa()));
  EXPECT_EQ(f.bf16_dot_over_fma > 0, f.avx512_bf16) << "timed exactly where the unit exists";
  const Isa exact_top = std::min(detected_isa(), Isa::avx512_bf16);
  const bool dot_pays = exact_top == Isa::avx512_bf16 && f.bf16_dot_over_fma >= 1.0;
  EXPECT_EQ(default_isa(), exact_top == Isa::avx512_bf16 && !dot_pays ? Isa::avx512 : exact_top)
      << "the default is the best level with the reference's bits, unless that is a BF16 dot slower than the FMA";
  std::printf("[simd] detected %s, default %s (avx512_bf16 %s, rounding in order %s, dot/FMA FLOP rate %.2f)\n",
              isa_name(detected_isa()), isa_name(default_isa()), f.avx512_bf16 ? "yes" : "no",
              f.bf16_dot_in_order ? "yes" : "no", f.bf16_dot_over_fma);
  for (const Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx_bf16}) {
    EXPECT_EQ(parse_isa(isa_name(isa), "level"), isa);
  }
  EXPECT_THROW(parse_isa("sse", "DSV41_ISA"), Error);
}

}  // namespace
