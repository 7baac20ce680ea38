// The sum of squares in the order of the reference: torch on CPU, `x.square().mean(-1)` (RMSNorm,
// the mHC mixes' one norm over hc·dim values, the Engram gate's norms). torch's CPU mean is a sum
// then one division by n, and the sum is ATen's cascade_sum (aten/src/ATen/native/cpu/SumKernel.cpp,
// the contiguous inner reduction: vectorized_inner_sum → row_sum → multi_row_sum). For n values:
//
//  * The row is read as n/L vectors of L fp32 lanes (L = Vectorized<float>::size(): 8 on ATen's
//    AVX2 kernels, 16 on its AVX-512 ones), the n mod L values after them are the scalar tail.
//  * row_sum interleaves the vectors 4 ways (ilp_factor 4): vector v goes to accumulator row v mod 4
//    at step v/4, for the first 4·⌊(n/L)/4⌋ vectors; each of the 4 rows is a multi_row_sum cascade.
//  * multi_row_sum over `size` steps keeps 4 levels of accumulators (num_levels 4). With
//    p = max(4, CeilLog2(size)/4) and step = 2^p: each run of `step` values is added into level 0;
//    then level 1 += level 0 (level 0 cleared) and, while the index is a multiple of step^j, level
//    j+1 += level j. The last size mod step values go into level 0; at the end level 0 += level 1,
//    += level 2, += level 3, in that order.
//  * The vectors left over after the interleave (n/L mod 4 of them) are added to row 0 in order;
//    then row 0 += row 1, += row 2, += row 3, lane by lane.
//  * The result starts from 0: the scalar tail is added in index order, then the L lanes of row 0
//    in lane order.
//  * A row shorter than L takes the scalar path (scalar_inner_sum): the same row_sum over single
//    values, the tail after the 4-way interleave added to row 0, then rows 1..3.
// Every square is x·x rounded to fp32 (x.square() is its own tensor), and every add is one fp32
// add: no fused multiply-add, no reassociation. (torch splits a reduction across threads only
// between rows, never inside one, so the thread count cannot change a row's sum.)
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>

namespace dsv41 {

// The lanes of the reference's vectors: 8, i.e. the goldens' torch ran ATen's AVX2 kernels (oneDNN's
// GEMMs choose their ISA apart from ATen's). Measured, since the goldens do not record it: with 8
// lanes the PyTorch port in tools/train reproduces every block output of tiny-dense and tiny-sparse
// bit for bit (check_golden.py); with 16, block 0 of tiny-dense already differs at three positions.
constexpr int kTorchSumLanes = 8;

namespace reference {

namespace cascade_detail {

constexpr int kRows = 4;    // row_sum's ilp_factor
constexpr int kLevels = 4;  // multi_row_sum's num_levels

// W fp32 lanes, added lane by lane: one of torch's Vectorized<float> (W = L) or one value (W = 1).
template <int W>
using Lanes = std::array<float, W>;

template <int W>
void add_to(Lanes<W>& acc, const Lanes<W>& v) {
  for (int l = 0; l < W; ++l) acc[l] += v[l];
}

// ATen's utils::CeilLog2: 1 up to 2, else the bit width of x - 1.
inline int64_t ceil_log2(int64_t x) {
  return x <= 2 ? 1 : static_cast<int64_t>(std::bit_width(static_cast<uint64_t>(x - 1)));
}

// multi_row_sum with 4 rows over `size` steps; load(i, k) is row k's value at step i.
template <int W, typename Load>
std::array<Lanes<W>, kRows> multi_row_sum(int64_t size, const Load& load) {
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  std::array<std::array<Lanes<W>, kRows>, kLevels> acc{};
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i) {
      for (int k = 0; k < kRows; ++k) add_to<W>(acc[0][k], load(i, k));
    }
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kRows; ++k) {
        add_to<W>(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = Lanes<W>{};
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i) {
    for (int k = 0; k < kRows; ++k) add_to<W>(acc[0][k], load(i, k));
  }
  for (int j = 1; j < kLevels; ++j) {
    for (int k = 0; k < kRows; ++k) add_to<W>(acc[0][k], acc[j][k]);
  }
  return acc[0];
}

// row_sum over `count` items (vectors or values); item(v) loads item v.
template <int W, typename Item>
Lanes<W> row_sum(int64_t count, const Item& item) {
  const int64_t steps = count / kRows;
  std::array<Lanes<W>, kRows> partial =
      multi_row_sum<W>(steps, [&](int64_t i, int k) { return item(i * kRows + k); });
  for (int64_t v = steps * kRows; v < count; ++v) add_to<W>(partial[0], item(v));
  for (int k = 1; k < kRows; ++k) add_to<W>(partial[0], partial[k]);
  return partial[0];
}

}  // namespace cascade_detail

// Σ value(i) for i < n in the cascade above with L lanes (8 or 16), as plain scalar loops; value(i)
// is the i-th fp32 summand, already rounded (x[i]·x[i] for the squares). L is a parameter so a test
// can check the order against this machine's torch; the model uses kTorchSumLanes.
template <int L, typename Value>
float cascade_sum(int64_t n, const Value& value) {
  using namespace cascade_detail;
  static_assert(L == 8 || L == 16);
  if (n < L) {  // scalar_inner_sum
    const Lanes<1> sum = row_sum<1>(n, [&](int64_t i) { return Lanes<1>{value(i)}; });
    return 0.0f + sum[0];
  }
  const int64_t vectors = n / L;
  const Lanes<L> lanes = row_sum<L>(vectors, [&](int64_t v) {
    Lanes<L> out;
    for (int l = 0; l < L; ++l) out[l] = value(v * L + l);
    return out;
  });
  float sum = 0.0f;
  for (int64_t i = vectors * L; i < n; ++i) sum += value(i);
  for (int l = 0; l < L; ++l) sum += lanes[l];
  return sum;
}

// Σ v[i]: torch's `.sum(-1)` of a contiguous fp32 row.
template <int L = kTorchSumLanes>
float cascade_sum_of(const float* v, int64_t n) {
  return cascade_sum<L>(n, [v](int64_t i) { return v[i]; });
}

// Σ x[i]², each square rounded to fp32 first.
template <int L = kTorchSumLanes>
float cascade_sum_of_squares(const float* x, int64_t n) {
  return cascade_sum<L>(n, [x](int64_t i) { return x[i] * x[i]; });
}

}  // namespace reference

}  // namespace dsv41
