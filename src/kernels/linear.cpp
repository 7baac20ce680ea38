// Scalar reference linear layers (model-spec §3.1 "linear"; the port's fp8_gemm / fp4_gemm and
// F.linear). Summation runs in index order: the reference's BLAS order is unspecified, so bit-exact
// agreement with it is not possible anyway, and a fixed order makes the faster versions testable.
#include <array>
#include <cassert>
#include <vector>

#include "kernels/kernels.h"
#include "numeric/formats.h"
#include "numeric/quant.h"

namespace dsv41 {

namespace {

constexpr int64_t kBlock = static_cast<int64_t>(kFp8Block);  // K block of both quantized GEMMs

// Decoding through a table keeps the inner loops free of branches; built once, thread-safe.
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = e4m3_to_f32(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

// x act_quant'ed to FP8 row by row: the e4m3 values (decoded codes) and one power-of-two scale per
// 32 along K. Quantizing every row up front lets the weight loops run rows in any order.
struct QuantizedRows {
  int64_t k;
  std::vector<float> values;  // [m, k]
  std::vector<float> scales;  // [m, k/32]
  QuantizedRows(const float* x, int64_t m, int64_t k_) : k(k_), values(m * k_), scales(m * (k_ / kBlock)) {
    const auto& lut = e4m3_table();
    std::vector<uint8_t> codes(k);
    for (int64_t i = 0; i < m; ++i) {
      act_quant_fp8(x + i * k, k, codes.data(), scales.data() + i * (k / kBlock));
      for (int64_t j = 0; j < k; ++j) values[i * k + j] = lut[codes[j]];
    }
  }
  const float* row_values(int64_t i) const { return values.data() + i * k; }
  const float* row_scales(int64_t i) const { return scales.data() + i * (k / kBlock); }
};

// acc += partial · a_s · b_s, in the port's order (`acc += partial * a_s[:, k] * b_s[:, k]`). Both
// scales are powers of two, so the products are exact unless they leave the normal range. Separate
// statements keep clang's default -ffp-contract=on from fusing them into the add (GCC does not
// contract in ISO mode, which the build uses).
inline float add_scaled(float acc, float partial, float a_s, float b_s) {
  const float scaled = partial * a_s;
  const float term = scaled * b_s;
  return acc + term;
}

// One output: Σ over K blocks of (Σ_j a_j·w_j)·a_s·w_s. a·w products of e4m3 (or e2m1) by e4m3
// values are exact in fp32, so only the block sums and the accumulation round.
float block_scaled_dot(const float* a, const float* a_scales, const float* w, const uint8_t* w_scales,
                       int64_t k) {
  float acc = 0.0f;
  for (int64_t b = 0; b < k / kBlock; ++b) {
    float partial = 0.0f;
    for (int64_t j = b * kBlock; j < (b + 1) * kBlock; ++j) partial += a[j] * w[j];
    acc = add_scaled(acc, partial, a_scales[b], e8m0_to_f32(w_scales[b]));
  }
  return acc;
}

}  // namespace

void linear_fp8(const float* x, int64_t m, const Fp8Matrix& w, float* y) {
  assert(w.k % kBlock == 0 && "act_quant needs K in whole blocks of 32");
  const int64_t kb = w.k / kBlock;  // = ceil(k/32), the scale tensor's row length
  const auto& lut = e4m3_table();
  const QuantizedRows a(x, m, w.k);
  std::vector<float> wrow(w.k);  // one weight row decoded to e4m3 values
  for (int64_t n = 0; n < w.n; ++n) {
    for (int64_t j = 0; j < w.k; ++j) wrow[j] = lut[w.w[n * w.k + j]];
    const uint8_t* srow = w.scale + (n / kBlock) * kb;  // weight scales tile 32×32
    for (int64_t i = 0; i < m; ++i) {
      y[i * w.n + n] = round_bf16(block_scaled_dot(a.row_values(i), a.row_scales(i), wrow.data(), srow, w.k));
    }
  }
}

void linear_fp4(const float* x, int64_t m, const Fp4Matrix& w, float* y) {
  assert(w.k % kBlock == 0 && "act_quant and the FP4 weight scales need K in whole blocks of 32");
  const int64_t kb = w.k / kBlock;
  const QuantizedRows a(x, m, w.k);
  std::vector<float> wrow(w.k);  // one weight row unpacked to E2M1 values
  for (int64_t n = 0; n < w.n; ++n) {
    const uint8_t* packed = w.w + n * (w.k / 2);
    for (int64_t j = 0; j < w.k / 2; ++j) {
      wrow[2 * j] = e2m1_to_f32(packed[j] & 0x0F);  // low nibble = even k (model-spec §2.2)
      wrow[2 * j + 1] = e2m1_to_f32(static_cast<uint8_t>(packed[j] >> 4));
    }
    const uint8_t* srow = w.scale + n * kb;  // per row, per 32 along K
    for (int64_t i = 0; i < m; ++i) {
      y[i * w.n + n] = round_bf16(block_scaled_dot(a.row_values(i), a.row_scales(i), wrow.data(), srow, w.k));
    }
  }
}

void linear_bf16(const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  for (int64_t i = 0; i < m; ++i) {
    const float* xr = x + i * w.k;
    for (int64_t n = 0; n < w.n; ++n) {
      const uint16_t* wr = w.w + n * w.k;
      float acc = 0.0f;  // bf16·bf16 products are exact in fp32
      for (int64_t j = 0; j < w.k; ++j) acc += xr[j] * bf16_to_f32(wr[j]);
      y[i * w.n + n] = round_bf16(acc);
    }
  }
}

void linear_f32(const float* x, int64_t m, const Bf16Matrix& w, float* y) {
  for (int64_t i = 0; i < m; ++i) {
    const float* xr = x + i * w.k;
    for (int64_t n = 0; n < w.n; ++n) {
      const uint16_t* wr = w.w + n * w.k;
      float acc = 0.0f;
      for (int64_t j = 0; j < w.k; ++j) {
        // fp32·bf16 products do round: a separate statement keeps clang from fusing the add.
        const float prod = xr[j] * bf16_to_f32(wr[j]);
        acc += prod;
      }
      y[i * w.n + n] = acc;
    }
  }
}

}  // namespace dsv41
