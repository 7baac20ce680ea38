// What the op tests share: the backends they run (every kernel level this machine runs, at several
// thread counts), the bitwise comparison and random inputs shaped like the model's.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "numeric/formats.h"
#include "numeric/quant.h"

namespace dsv41::test {

// Every level the machine runs (backend_levels(), so a new backend is tested by being listed there),
// each at 1 and 3 threads: results must not depend on how the work is split. Made once per process.
inline const std::vector<std::unique_ptr<Backend>>& op_backends() {
  static const std::vector<std::unique_ptr<Backend>> all = [] {
    std::vector<std::unique_ptr<Backend>> out;
    for (const Isa level : available_backend_levels()) {
      for (const int threads : {1, 3}) {
        BackendOptions o;
        o.level = level;
        o.threads = threads;
        out.push_back(make_backend(o));
      }
    }
    return out;
  }();
  return all;
}

// The levels above the scalar reference (none on a machine without AVX2: those tests check nothing).
inline std::vector<const Backend*> fast_backends() {
  std::vector<const Backend*> out;
  for (const auto& b : op_backends()) {
    if (b->level() != Isa::scalar) out.push_back(b.get());
  }
  return out;
}

inline std::string label(const Backend& b) { return std::string(b.name()) + " x" + std::to_string(b.threads()); }

// A matrix with `backend`'s packed copy (kept alive in `keep`), or as it is when it reads row-major.
template <class Matrix>
Matrix packed_for(const Backend& backend, Matrix m, std::unique_ptr<PackedWeights>& keep) {
  keep = backend.pack(m);
  if (keep) m.packed = keep->view();
  return m;
}

// Index and values of the first bitwise difference, or "" when equal. With `any_nan`, two NaNs count
// as equal whatever their sign and payload: when two different NaNs meet in an addition, x86 keeps
// the first operand's, and the compiler may order a commutative add either way, so the payload of a
// NaN result is not part of any op's contract.
inline std::string first_difference(const std::vector<float>& got, const std::vector<float>& want,
                                    bool any_nan = false) {
  if (got.size() != want.size())
    return "sizes differ: " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
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

// ---- the AMX level's declared numerics (kernels/simd_amx.cpp) ------------------------------------
//
// Its FP8/FP4 linear layers multiply the reference's own exact operands but sum them in another
// order and rounding, so their contract is a bound, not bits. For one output with S = Σ_k |a·w·a_s·w_s|
// (the reference's quantized operands) and kb = K/32:
//  * the reference's chains (32 products a block, then kb scaled blocks) are within (31 + kb)·u·S of
//    the exact sum (first-order bound of a recursive sum, u = 2^-24); a BF16 layer's one chain over
//    K within K·u·S;
//  * the tile unit adds C and 32 products an instruction, each term cut by at most one fp32 unit in
//    the last place (2u) of the largest, then rounds once (u): within 67·u·(|C| + Σ|p|) an
//    instruction, and |C| <= S, so within 67·kb·u·S over the kb instructions (plus the same order
//    of S again for the partial sums: 2·67·kb·u·S);
//  * both are then rounded to bf16: one bf16 unit in the last place of the larger of the two.
// The op tests hold the level to that, and report the largest |got - want| / (u·S) they saw.
inline bool bits_are_the_references(const Backend& b) { return isa_gives_reference_bits(b.level()); }

// S per output of y[m, n] = x · Wᵀ for an FP8 or FP4 matrix, in double, from act_quant's codes and
// scales as the reference computes them.
inline std::vector<double> abs_product_sums(const float* x, int64_t m, int64_t n, int64_t k,
                                            const std::function<float(int64_t, int64_t)>& weight) {
  std::vector<double> out(static_cast<size_t>(m * n), 0.0);
  std::vector<uint8_t> codes(static_cast<size_t>(k));
  std::vector<float> scales(static_cast<size_t>(k / 32));
  std::vector<double> a(static_cast<size_t>(k));
  for (int64_t i = 0; i < m; ++i) {
    act_quant_fp8(x + i * k, k, codes.data(), scales.data());
    for (int64_t j = 0; j < k; ++j) a[j] = static_cast<double>(e4m3_to_f32(codes[j])) * scales[j / 32];
    for (int64_t r = 0; r < n; ++r) {
      double sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += std::fabs(a[j] * weight(r, j));
      out[i * n + r] = sum;
    }
  }
  return out;
}
inline std::vector<double> abs_product_sums(const float* x, int64_t m, const Fp8Matrix& w) {
  return abs_product_sums(x, m, w.n, w.k, [&](int64_t r, int64_t j) {
    return e4m3_to_f32(w.w[r * w.k + j]) * e8m0_to_f32(w.scale[(r / 32) * (w.k / 32) + j / 32]);
  });
}
inline std::vector<double> abs_product_sums(const float* x, int64_t m, const Fp4Matrix& w) {
  return abs_product_sums(x, m, w.n, w.k, [&](int64_t r, int64_t j) {
    const uint8_t byte = w.w[r * (w.k / 2) + j / 2];
    const uint8_t code = static_cast<uint8_t>(j % 2 ? byte >> 4 : byte & 0x0F);  // low nibble = even k
    return e2m1_to_f32(code) * e8m0_to_f32(w.scale[r * (w.k / 32) + j / 32]);
  });
}

// The first output outside the bound above, or "". `worst` gets the largest |got - want| / (u·S).
inline std::string first_outside_tile_bound(const std::vector<float>& got, const std::vector<float>& want,
                                            const std::vector<double>& s, int64_t k, bool blocked,
                                            double* worst = nullptr) {
  if (got.size() != want.size() || got.size() != s.size()) return "sizes differ";
  const double u = std::ldexp(1.0, -24), kb = static_cast<double>((k + 31) / 32);
  // the reference's chains: 31 adds a block and kb blocks (FP8/FP4), or one chain over K (BF16)
  const double chain = blocked ? 31 + kb : static_cast<double>(k);
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i] || (std::isnan(got[i]) && std::isnan(want[i]))) continue;  // infinities too
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double larger = std::max(std::fabs(got[i]), std::fabs(want[i]));
    const double bf16_ulp = larger > 0 ? std::ldexp(1.0, std::ilogb(larger) - 7) : 0.0;
    const double bound = (chain + 2 * 67 * kb) * u * s[i] + bf16_ulp;
    if (worst != nullptr && s[i] > 0) *worst = std::max(*worst, d / (u * s[i]));
    if (!(d <= bound)) {
      return "at " + std::to_string(i) + ": " + std::to_string(got[i]) + " vs " + std::to_string(want[i]) +
             " (bound " + std::to_string(bound) + ")";
    }
  }
  return "";
}

// What a level's linear output must be: the reference's bits, or (AMX) within the declared bound.
template <class Matrix>
std::string linear_disagreement(const Backend& b, const std::vector<float>& got, const std::vector<float>& want,
                                const float* x, int64_t m, const Matrix& w, double* worst = nullptr) {
  if (bits_are_the_references(b)) return first_difference(got, want);
  return first_outside_tile_bound(got, want, abs_product_sums(x, m, w), w.k, true, worst);
}
// linear_bf16 (bf16 activations): S from the values as they are.
inline std::string linear_disagreement(const Backend& b, const std::vector<float>& got, const std::vector<float>& want,
                                       const float* x, int64_t m, const Bf16Matrix& w, double* worst = nullptr) {
  if (bits_are_the_references(b)) return first_difference(got, want);
  std::vector<double> s(static_cast<size_t>(m * w.n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t r = 0; r < w.n; ++r) {
      for (int64_t j = 0; j < w.k; ++j) s[i * w.n + r] += std::fabs(double{x[i * w.k + j]} * bf16_to_f32(w.w[r * w.k + j]));
    }
  }
  return first_outside_tile_bound(got, want, s, w.k, false, worst);
}

// bf16 activations whose 32-blocks have different magnitudes (so the act_quant scales differ), with
// some exact zeros and negative zeros.
inline std::vector<float> random_activations(std::mt19937& rng, int64_t m, int64_t k) {
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

// bf16 values of a normal distribution with the given spread.
inline std::vector<float> random_bf16_values(std::mt19937& rng, size_t n, float sigma = 1.0f) {
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = round_bf16(dist(rng));
  return v;
}

inline std::vector<uint8_t> random_bytes(std::mt19937& rng, size_t n) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> v(n);
  for (auto& c : v) c = static_cast<uint8_t>(byte(rng));
  return v;
}

// FP8 codes without the NaN codes (a checkpoint has none; NaN handling is tested on its own).
inline std::vector<uint8_t> random_e4m3(std::mt19937& rng, size_t n) {
  std::vector<uint8_t> v = random_bytes(rng, n);
  for (auto& c : v) {
    if ((c & 0x7F) == 0x7F) c = static_cast<uint8_t>(c - 1);
  }
  return v;
}

inline std::vector<uint8_t> random_scales(std::mt19937& rng, size_t n, int lo = 110, int hi = 135) {
  std::uniform_int_distribution<int> code(lo, hi);
  std::vector<uint8_t> v(n);
  for (auto& c : v) c = static_cast<uint8_t>(code(rng));
  return v;
}

// A bf16 value of either sign with 7 random mantissa bits at 2^exponent.
inline float random_bf16_at(std::mt19937& rng, int exponent) {
  std::uniform_int_distribution<int> mantissa(0, 127), sign(0, 1);
  const float v = std::ldexp(1.0f + static_cast<float>(mantissa(rng)) / 128.0f, exponent);
  return round_bf16(sign(rng) ? -v : v);
}

inline std::vector<uint16_t> random_bf16_bits(std::mt19937& rng, size_t n, float sigma = 0.05f) {
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<uint16_t> v(n);
  for (auto& b : v) b = bf16_from_f32(dist(rng));
  return v;
}

}  // namespace dsv41::test
