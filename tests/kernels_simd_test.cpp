// The fast kernels (AVX2 / AVX-512, multithreaded) against the scalar references, bit for bit, at
// every ISA level this machine has; plus the thread pool and the CPU feature switch they rest on.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu_features.h"
#include "kernels/kernels.h"
#include "kernels/linear_internal.h"
#include "kernels/packed_weights.h"
#include "kernels/thread_pool.h"
#include "numeric/formats.h"

namespace {

using namespace dsv41;

using Fp8Fn = void (*)(const float*, int64_t, const Fp8Matrix&, float*);
using Fp4Fn = void (*)(const float*, int64_t, const Fp4Matrix&, float*);
using Bf16Fn = void (*)(const float*, int64_t, const Bf16Matrix&, float*);

struct Level {
  Isa isa;
  Fp8Fn fp8;
  Fp4Fn fp4;
  Bf16Fn bf16, f32;
  int tile_rows;  // of the weights it reads packed (packed_weights.h)
};

// The fast levels this machine can run (none on a machine without AVX2: the tests then skip).
std::vector<Level> levels() {
  std::vector<Level> out;
  if (isa_supported(Isa::avx2)) {
    out.push_back({Isa::avx2, detail::linear_fp8_avx2, detail::linear_fp4_avx2, detail::linear_bf16_avx2,
                   detail::linear_f32_avx2, 16});
  }
  if (isa_supported(Isa::avx512)) {
    out.push_back({Isa::avx512, detail::linear_fp8_avx512, detail::linear_fp4_avx512, detail::linear_bf16_avx512,
                   detail::linear_f32_avx512, 32});
  }
  return out;
}

// Sets the global pool's size for one scope, then restores it.
class PoolThreads {
 public:
  explicit PoolThreads(int n) : saved_(ThreadPool::global().threads()) { ThreadPool::global().resize(n); }
  ~PoolThreads() { ThreadPool::global().resize(saved_); }
  PoolThreads(const PoolThreads&) = delete;
  PoolThreads& operator=(const PoolThreads&) = delete;

 private:
  int saved_;
};

// Index and values of the first bitwise difference, or "" when equal. With `any_nan`, two NaNs count
// as equal whatever their sign and payload: when two different NaNs meet in an addition, x86 keeps
// the first operand's, and the compiler may order a commutative add either way, so the payload of a
// NaN result is not part of any kernel's contract.
std::string first_difference(const std::vector<float>& got, const std::vector<float>& want, bool any_nan = false) {
  if (got.size() != want.size()) return "sizes differ";
  if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0) return "";
  for (size_t i = 0; i < got.size(); ++i) {
    if (any_nan && std::isnan(got[i]) && std::isnan(want[i])) continue;
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i])) {
      return "first difference at " + std::to_string(i) + ": " + std::to_string(got[i]) + " vs " +
             std::to_string(want[i]);
    }
  }
  return "";
}

// bf16 activations whose 32-blocks have different magnitudes (so the act_quant scales differ), with
// some exact zeros and negative zeros.
std::vector<float> random_activations(std::mt19937& rng, int64_t m, int64_t k) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_int_distribution<int> shift(-8, 6), special(0, 99);
  std::vector<float> x(static_cast<size_t>(m * k));
  for (int64_t b = 0; b < m * k; b += 32) {
    const int s = shift(rng);
    for (int64_t j = b; j < std::min(b + 32, m * k); ++j) {
      const int sp = special(rng);
      x[j] = sp == 0 ? 0.0f : sp == 1 ? -0.0f : round_bf16(std::ldexp(dist(rng), s));
    }
  }
  return x;
}

std::vector<uint8_t> random_bytes(std::mt19937& rng, size_t n) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> v(n);
  for (auto& c : v) c = static_cast<uint8_t>(byte(rng));
  return v;
}

// FP8 codes without the NaN codes (a checkpoint has none; NaN handling is tested on its own).
std::vector<uint8_t> random_e4m3(std::mt19937& rng, size_t n) {
  std::vector<uint8_t> v = random_bytes(rng, n);
  for (auto& c : v) {
    if ((c & 0x7F) == 0x7F) c = static_cast<uint8_t>(c - 1);
  }
  return v;
}

std::vector<uint8_t> random_scales(std::mt19937& rng, size_t n, int lo = 110, int hi = 135) {
  std::uniform_int_distribution<int> code(lo, hi);
  std::vector<uint8_t> v(n);
  for (auto& c : v) c = static_cast<uint8_t>(code(rng));
  return v;
}

std::vector<uint16_t> random_bf16_bits(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<uint16_t> v(n);
  for (auto& b : v) b = bf16_from_f32(dist(rng));
  return v;
}

struct Shape {
  int64_t m, n, k;
};

// The same matrix with a packed copy for `level` (the copy must outlive the returned view).
template <class Matrix>
Matrix with_packed(Matrix m, const std::unique_ptr<PackedWeights>& p) {
  m.packed = p->view();
  return m;
}

std::string describe(const Level& l, const Shape& s) {
  return std::string(isa_name(l.isa)) + " m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) +
         " k=" + std::to_string(s.k);
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
  for (const Level& level : levels()) {
    for (const Shape& s : kQuantShapes) {
      const std::vector<float> x = random_activations(rng, s.m, s.k);
      const std::vector<uint8_t> w = random_e4m3(rng, static_cast<size_t>(s.n * s.k));
      const std::vector<uint8_t> sc = random_scales(rng, static_cast<size_t>(((s.n + 31) / 32) * (s.k / 32)));
      const Fp8Matrix mat{w.data(), sc.data(), s.n, s.k};
      std::vector<float> want(static_cast<size_t>(s.m * s.n)), got(want.size(), -1.0f);
      detail::linear_fp8_scalar(x.data(), s.m, mat, want.data());
      level.fp8(x.data(), s.m, mat, got.data());
      EXPECT_EQ(first_difference(got, want), "") << describe(level, s);
      const auto packed = pack_fp8(mat, level.tile_rows);
      std::fill(got.begin(), got.end(), -1.0f);
      level.fp8(x.data(), s.m, with_packed(mat, packed), got.data());
      EXPECT_EQ(first_difference(got, want), "") << "packed " << describe(level, s);
    }
  }
}

TEST(KernelsSimd, Fp4MatchesScalar) {
  std::mt19937 rng(12);
  for (const Level& level : levels()) {
    for (const Shape& s : kQuantShapes) {
      const std::vector<float> x = random_activations(rng, s.m, s.k);
      const std::vector<uint8_t> w = random_bytes(rng, static_cast<size_t>(s.n * s.k / 2));
      const std::vector<uint8_t> sc = random_scales(rng, static_cast<size_t>(s.n * (s.k / 32)));
      const Fp4Matrix mat{w.data(), sc.data(), s.n, s.k};
      std::vector<float> want(static_cast<size_t>(s.m * s.n)), got(want.size(), -1.0f);
      detail::linear_fp4_scalar(x.data(), s.m, mat, want.data());
      level.fp4(x.data(), s.m, mat, got.data());
      EXPECT_EQ(first_difference(got, want), "") << describe(level, s);
      const auto packed = pack_fp4(mat, level.tile_rows);
      std::fill(got.begin(), got.end(), -1.0f);
      level.fp4(x.data(), s.m, with_packed(mat, packed), got.data());
      EXPECT_EQ(first_difference(got, want), "") << "packed " << describe(level, s);
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
  for (const Level& level : levels()) {
    for (const Shape& s : shapes) {
      const std::vector<float> xb = random_activations(rng, s.m, s.k);  // bf16 values for linear_bf16
      std::vector<float> xf(static_cast<size_t>(s.m * s.k));
      for (auto& v : xf) v = dist(rng);  // any fp32 for linear_f32
      const std::vector<uint16_t> w = random_bf16_bits(rng, static_cast<size_t>(s.n * s.k));
      const Bf16Matrix mat{w.data(), s.n, s.k};
      const auto packed = pack_bf16(mat, level.tile_rows);
      std::vector<float> want(static_cast<size_t>(s.m * s.n)), got(want.size(), -1.0f);
      detail::linear_bf16_scalar(xb.data(), s.m, mat, want.data());
      level.bf16(xb.data(), s.m, mat, got.data());
      EXPECT_EQ(first_difference(got, want), "") << "bf16 " << describe(level, s);
      std::fill(got.begin(), got.end(), -1.0f);
      level.bf16(xb.data(), s.m, with_packed(mat, packed), got.data());
      EXPECT_EQ(first_difference(got, want), "") << "bf16 packed " << describe(level, s);
      detail::linear_f32_scalar(xf.data(), s.m, mat, want.data());
      std::fill(got.begin(), got.end(), -1.0f);
      level.f32(xf.data(), s.m, mat, got.data());
      EXPECT_EQ(first_difference(got, want), "") << "f32 " << describe(level, s);
      std::fill(got.begin(), got.end(), -1.0f);
      level.f32(xf.data(), s.m, with_packed(mat, packed), got.data());
      EXPECT_EQ(first_difference(got, want), "") << "f32 packed " << describe(level, s);
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
  for (const Level& level : levels()) {
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
      detail::linear_fp8_scalar(x.data(), s.m, m8, want.data());
      level.fp8(x.data(), s.m, m8, got.data());
      EXPECT_EQ(first_difference(got, want), "") << "fp8 " << describe(level, s);

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
      detail::linear_fp4_scalar(x.data(), s.m, m4, want.data());
      level.fp4(x.data(), s.m, m4, got.data());
      EXPECT_EQ(first_difference(got, want), "") << "fp4 " << describe(level, s);

      // bf16 / f32: one chain over all of k: ±1000·w at the two ends, small terms between.
      for (int64_t i = 0; i < s.m; ++i) {
        for (int64_t j = 0; j < s.k; ++j) {
          x[i * s.k + j] = j == 0 ? 1000.0f : j == s.k - 1 ? -1000.0f : round_bf16(dist(rng) * 1e-3f);
        }
      }
      std::vector<uint16_t> wb = random_bf16_bits(rng, static_cast<size_t>(s.n * s.k));
      for (int64_t r = 0; r < s.n; ++r) wb[r * s.k + s.k - 1] = wb[r * s.k];
      const Bf16Matrix mb{wb.data(), s.n, s.k};
      detail::linear_bf16_scalar(x.data(), s.m, mb, want.data());
      level.bf16(x.data(), s.m, mb, got.data());
      EXPECT_EQ(first_difference(got, want), "") << "bf16 " << describe(level, s);
      detail::linear_f32_scalar(x.data(), s.m, mb, want.data());
      level.f32(x.data(), s.m, mb, got.data());
      EXPECT_EQ(first_difference(got, want), "") << "f32 " << describe(level, s);
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
        const detail::QuantizedActivations want = detail::quantize_activations(input->data(), m, k, prescale, false);
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
  for (const Level& level : levels()) {
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
      detail::linear_fp8_scalar(x.data(), s.m, m8, want.data());
      level.fp8(x.data(), s.m, m8, got.data());
      EXPECT_EQ(first_difference(got, want, true), "") << "fp8 " << describe(level, s);
      const auto p8 = pack_fp8(m8, level.tile_rows);  // flags the tiles of rows 5 and 40
      level.fp8(x.data(), s.m, with_packed(m8, p8), got.data());
      EXPECT_EQ(first_difference(got, want, true), "") << "fp8 packed " << describe(level, s);

      const std::vector<uint8_t> w4 = random_bytes(rng, static_cast<size_t>(s.n * s.k / 2));
      std::vector<uint8_t> sc4 = random_scales(rng, static_cast<size_t>(s.n * (s.k / 32)));
      sc4[3] = 0;
      sc4[50] = 254;
      sc4[77] = 255;
      const Fp4Matrix m4{w4.data(), sc4.data(), s.n, s.k};
      detail::linear_fp4_scalar(x.data(), s.m, m4, want.data());
      level.fp4(x.data(), s.m, m4, got.data());
      EXPECT_EQ(first_difference(got, want, true), "") << "fp4 " << describe(level, s);
      const auto p4 = pack_fp4(m4, level.tile_rows);  // scale codes 0, 254 and 255 through the vector decode
      level.fp4(x.data(), s.m, with_packed(m4, p4), got.data());
      EXPECT_EQ(first_difference(got, want, true), "") << "fp4 packed " << describe(level, s);
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
  const PackedWeights p(w.data(), n, k / 2, 32, 1, 4, sc.data(), 1, false);
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
  for (const Level& level : levels()) {
    const int64_t n = 4 * level.tile_rows + 8, k = 96;
    const std::vector<uint16_t> w = random_bf16_bits(rng, static_cast<size_t>(n * k));
    const std::vector<float> x = random_activations(rng, 1, k);
    const Bf16Matrix all{w.data(), n, k};
    const auto packed = pack_bf16(all, level.tile_rows);
    std::vector<float> want(static_cast<size_t>(n));
    detail::linear_bf16_scalar(x.data(), 1, all, want.data());
    for (const int64_t row0 : {int64_t{0}, int64_t{level.tile_rows}, int64_t{2 * level.tile_rows + 8}, int64_t{3}}) {
      const int64_t count = std::min<int64_t>(2 * level.tile_rows, n - row0);
      const PackedView pv = packed->view().from_row(row0);
      const Bf16Matrix part{w.data() + row0 * k, count, k, pv};
      std::vector<float> got(static_cast<size_t>(count), -1.0f);
      level.bf16(x.data(), 1, part, got.data());
      const std::vector<float> expect(want.begin() + row0, want.begin() + row0 + count);
      EXPECT_EQ(first_difference(got, expect), "") << isa_name(level.isa) << " rows from " << row0;
    }
  }
}

// ---- sparse attention ------------------------------------------------------------------------

using AttnFn = void (*)(const float*, int64_t, int64_t, const std::vector<const float*>&, const float*, float,
                        float*);

std::vector<std::pair<Isa, AttnFn>> attention_levels() {
  std::vector<std::pair<Isa, AttnFn>> out;
  if (isa_supported(Isa::avx2)) out.emplace_back(Isa::avx2, detail::sparse_attention_avx2);
  if (isa_supported(Isa::avx512)) out.emplace_back(Isa::avx512, detail::sparse_attention_avx512);
  return out;
}

// Lists with null entries scattered, whole null chunks, several chunks of 64 and a partial last one;
// head counts that are and are not multiples of the vector width; d with a scalar tail; q either
// bf16 values (as the model passes) or arbitrary fp32.
TEST(KernelsSimd, SparseAttentionMatchesScalar) {
  std::mt19937 rng(18);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  struct Case {
    int64_t heads, d;
    size_t len;
    double null_share;
    bool bf16_q;
  };
  const Case cases[] = {{1, 512, 1, 0.0, true},     {5, 64, 63, 0.2, true},   {16, 512, 64, 0.0, true},
                        {17, 100, 65, 0.3, true},   {64, 512, 200, 0.1, true}, {64, 512, 640, 0.05, false},
                        {33, 48, 130, 0.5, false},  {8, 512, 0, 0.0, true},    {24, 512, 192, 1.0, true}};
  for (const auto& [isa, fn] : attention_levels()) {
    for (const Case& c : cases) {
      std::vector<float> q(static_cast<size_t>(c.heads * c.d)), sink(static_cast<size_t>(c.heads));
      for (auto& v : q) v = c.bf16_q ? round_bf16(dist(rng) * 0.3f) : dist(rng) * 0.3f;
      for (auto& v : sink) v = dist(rng);
      std::vector<std::vector<float>> store(c.len, std::vector<float>(static_cast<size_t>(c.d)));
      std::vector<const float*> rows(c.len, nullptr);
      for (size_t j = 0; j < c.len; ++j) {
        for (auto& v : store[j]) v = round_bf16(dist(rng));
        if (unit(rng) >= c.null_share) rows[j] = store[j].data();
      }
      if (c.len > 70) std::fill(rows.begin(), rows.begin() + 64, nullptr);  // a whole empty chunk
      const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
      std::vector<float> want(q.size()), got(q.size(), -1.0f);
      detail::sparse_attention_scalar(q.data(), c.heads, c.d, rows, sink.data(), scale, want.data());
      fn(q.data(), c.heads, c.d, rows, sink.data(), scale, got.data());
      EXPECT_EQ(first_difference(got, want), "")
          << isa_name(isa) << " heads " << c.heads << " d " << c.d << " len " << c.len;
      for (const int threads : {1, 2}) {
        const PoolThreads pool(threads);
        std::fill(got.begin(), got.end(), -1.0f);
        fn(q.data(), c.heads, c.d, rows, sink.data(), scale, got.data());
        EXPECT_EQ(first_difference(got, want), "") << isa_name(isa) << " threads " << threads;
      }
    }
  }
}

TEST(KernelsSimd, ThreadCountDoesNotChangeResults) {
  std::mt19937 rng(15);
  const Shape shapes[] = {{1, 1000, 512}, {1, 77, 4096}, {9, 333, 512}};
  for (const Level& level : levels()) {
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
        const PoolThreads threads(t + 1);
        for (auto& v : r[t]) v.assign(static_cast<size_t>(s.m * s.n), -1.0f);
        level.fp8(x.data(), s.m, m8, r[t][0].data());
        level.fp4(x.data(), s.m, m4, r[t][1].data());
        level.bf16(x.data(), s.m, mb, r[t][2].data());
        level.f32(x.data(), s.m, mb, r[t][3].data());
      }
      for (int kind = 0; kind < 4; ++kind) {
        EXPECT_EQ(first_difference(r[1][kind], r[0][kind]), "") << "kind " << kind << " " << describe(level, s);
      }
    }
  }
}

// The public entry points follow the active level, and each level gives the reference's bits.
TEST(KernelsSimd, DispatchFollowsActiveIsa) {
  std::mt19937 rng(16);
  const Shape s{3, 50, 128};
  const std::vector<float> x = random_activations(rng, s.m, s.k);
  const std::vector<uint8_t> w = random_e4m3(rng, static_cast<size_t>(s.n * s.k));
  const std::vector<uint8_t> sc = random_scales(rng, static_cast<size_t>(((s.n + 31) / 32) * (s.k / 32)));
  const Fp8Matrix mat{w.data(), sc.data(), s.n, s.k};
  std::vector<float> want(static_cast<size_t>(s.m * s.n)), got(want.size());
  detail::linear_fp8_scalar(x.data(), s.m, mat, want.data());
  const Isa saved = active_isa();
  for (const Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    set_active_isa(isa);
    EXPECT_EQ(active_isa(), isa_supported(isa) ? isa : detected_isa());
    linear_fp8(x.data(), s.m, mat, got.data());
    EXPECT_EQ(first_difference(got, want), "") << isa_name();
  }
  set_active_isa(saved);
}

TEST(CpuFeatures, NamesAndLevels) {
  EXPECT_STREQ(isa_name(Isa::scalar), "scalar");
  EXPECT_STREQ(isa_name(Isa::avx2), "avx2");
  EXPECT_STREQ(isa_name(Isa::avx512), "avx512");
  const CpuFeatures& f = cpu_features();
  EXPECT_TRUE(!f.avx512 || f.avx2) << "AVX-512 level implies the AVX2 level";
  EXPECT_TRUE(!f.avx512_bf16 || f.avx512);
  EXPECT_TRUE(isa_supported(Isa::scalar));
  EXPECT_TRUE(isa_supported(detected_isa()));
  std::printf("[simd] detected %s (avx512_bf16 %s), active %s, %d pool threads\n", isa_name(detected_isa()),
              f.avx512_bf16 ? "yes" : "no", isa_name(), ThreadPool::global().threads());
}

// ---- thread pool --------------------------------------------------------------------------------

TEST(ThreadPool, CoversTheRangeOnceInGrainMultiples) {
  for (const int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    for (const int64_t n : {0, 1, 2, 7, 16, 100, 1001}) {
      for (const int64_t grain : {1, 3, 16, 64}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        std::atomic<int> bad_start{0};
        pool.parallel_for(n, grain, [&](int64_t b, int64_t e) {
          if (b % grain != 0 || b >= e) bad_start.fetch_add(1);
          for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << threads << " " << n << " " << grain;
        EXPECT_EQ(bad_start.load(), 0);
      }
    }
  }
}

TEST(ThreadPool, UsesTheWorkersAndReusesThem) {
  ThreadPool pool(2);
  std::atomic<int> other{0};
  const auto caller = std::this_thread::get_id();
  for (int rep = 0; rep < 50; ++rep) {
    pool.parallel_for(8, 1, [&](int64_t, int64_t) {
      if (std::this_thread::get_id() != caller) other.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));  // long enough for the worker to join
    });
  }
  EXPECT_GT(other.load(), 0) << "the worker takes chunks";
  EXPECT_LT(other.load(), 50 * 8) << "the caller takes chunks too";
}

TEST(ThreadPool, NestedAndConcurrentCallsRunInline) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  pool.parallel_for(4, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      pool.parallel_for(10, 1, [&](int64_t b2, int64_t e2) { sum.fetch_add(e2 - b2); });
    }
  });
  EXPECT_EQ(sum.load(), 40);
  // Two threads calling at once: one gets the workers, the other runs inline; both complete.
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 2; ++t) {
    callers.emplace_back([&] {
      for (int rep = 0; rep < 500; ++rep) {
        pool.parallel_for(64, 4, [&](int64_t b, int64_t e) { total.fetch_add(e - b); });
      }
    });
  }
  for (auto& c : callers) c.join();
  EXPECT_EQ(total.load(), 2 * 500 * 64);
}

TEST(ThreadPool, ExceptionsReachTheCaller) {
  ThreadPool pool(2);
  EXPECT_THROW(pool.parallel_for(2, 1,
                                 [](int64_t b, int64_t) {
                                   if (b == 1) throw std::runtime_error("worker");
                                 }),
               std::runtime_error);
  // The pool still works afterwards.
  std::atomic<int> n{0};
  pool.parallel_for(2, 1, [&](int64_t b, int64_t e) { n.fetch_add(static_cast<int>(e - b)); });
  EXPECT_EQ(n.load(), 2);
}

}  // namespace
