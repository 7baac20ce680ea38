// The cascaded sum of squares (cascade_sum.h) on vectors, bit for bit the scalar reference's: each of
// torch's kTorchSumLanes-lane vectors is kGroup vectors of the including file's SumV (W lanes, W
// dividing kTorchSumLanes: the AVX-512 file sums in ymm halves, since torch's vectors have 8 lanes),
// and every add is the same lane-by-lane fp32 add. Included by an ISA file inside its target region
// and namespace, after it defines SumV (W, F, zero, load, store, add, mul). The cascade is written
// out again rather than instantiated from the reference's templates: GCC compiles a template with the
// target options of its definition, which lies outside the ISA file's target region, so it could not
// inline the vector operations.
//
// No include guard on purpose: each ISA file includes it once, in its own namespace.

constexpr int kGroup = kTorchSumLanes / SumV::W;
static_assert(kGroup >= 1 && kGroup * SumV::W == kTorchSumLanes, "SumV's width must divide torch's");

struct TorchVector {
  SumV::F v[kGroup];
};

inline void add_to(TorchVector& acc, const TorchVector& b) {
  for (int g = 0; g < kGroup; ++g) acc.v[g] = SumV::add(acc.v[g], b.v[g]);
}

inline TorchVector zero_vector() {
  TorchVector r;
  for (int g = 0; g < kGroup; ++g) r.v[g] = SumV::zero();
  return r;
}

inline TorchVector squares(const float* p) {
  TorchVector r;
  for (int g = 0; g < kGroup; ++g) {
    const SumV::F x = SumV::load(p + g * SumV::W);
    r.v[g] = SumV::mul(x, x);
  }
  return r;
}

inline float cascade_sum_of_squares(const float* x, int64_t n) {
  constexpr int64_t L = kTorchSumLanes, kRows = 4, kLevels = 4;
  if (n < L) return reference::cascade_sum_of_squares<kTorchSumLanes>(x, n);
  const int64_t vectors = n / L, steps = vectors / kRows;
  // multi_row_sum over the 4-way interleave of the first steps·4 vectors
  const int64_t level_power = std::max<int64_t>(4, reference::cascade_detail::ceil_log2(steps) / kLevels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  TorchVector acc[kLevels][kRows];
  for (auto& level : acc)
    for (auto& row : level) row = zero_vector();
  int64_t i = 0;
  while (i + level_step <= steps) {
    for (int64_t j = 0; j < level_step; ++j, ++i) {
      for (int64_t k = 0; k < kRows; ++k) add_to(acc[0][k], squares(x + (i * kRows + k) * L));
    }
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kRows; ++k) {
        add_to(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = zero_vector();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < steps; ++i) {
    for (int64_t k = 0; k < kRows; ++k) add_to(acc[0][k], squares(x + (i * kRows + k) * L));
  }
  for (int64_t j = 1; j < kLevels; ++j) {
    for (int64_t k = 0; k < kRows; ++k) add_to(acc[0][k], acc[j][k]);
  }
  // row_sum: the vectors after the interleave into row 0, then rows 1..3
  for (int64_t v = steps * kRows; v < vectors; ++v) add_to(acc[0][0], squares(x + v * L));
  for (int64_t k = 1; k < kRows; ++k) add_to(acc[0][0], acc[0][k]);
  // the scalar tail, then the lanes in order
  alignas(64) float lanes[kTorchSumLanes];
  for (int g = 0; g < kGroup; ++g) SumV::store(lanes + g * SumV::W, acc[0][0].v[g]);
  float sum = 0.0f;
  for (int64_t t = vectors * L; t < n; ++t) sum += x[t] * x[t];
  for (int64_t l = 0; l < L; ++l) sum += lanes[l];
  return sum;
}
