// Rotary embedding (model-spec §3.1 "RoPE" and "Frequencies"; the reference's precompute_freqs_cis
// and apply_rotary_emb). The table is evaluated in fp32 step by step as torch does, because a table
// built in double differs from the reference's in about a third of the lanes by 1 ulp.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <numbers>

#include "kernels/reference.h"
#include "numeric/formats.h"

namespace dsv41 {

YarnRange yarn_range(int64_t rope_dim, int64_t original_seq_len, double base, double beta_fast, double beta_slow) {
  // Python float arithmetic in the reference's operation order:
  // dim * log(orig / (rotations * 2 * pi)) / (2 * log(base)).
  const double dim = static_cast<double>(rope_dim);
  const double orig = static_cast<double>(original_seq_len);
  const auto corrected_dim = [&](double rotations) {
    return dim * std::log(orig / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
  };
  YarnRange r;
  r.low = std::max(static_cast<int64_t>(std::floor(corrected_dim(beta_fast))), int64_t{0});
  r.high = std::min(static_cast<int64_t>(std::ceil(corrected_dim(beta_slow))), rope_dim - 1);
  return r;
}

RopeTable::RopeTable(int64_t rope_dim, int64_t original_seq_len, double base, double factor, double beta_fast,
                     double beta_slow)
    : dim_(rope_dim), freqs_(static_cast<size_t>(rope_dim / 2)) {
  assert(rope_dim > 0 && rope_dim % 2 == 0);
  // `base ** (arange(0, dim, 2, fp32) / dim)`: the exponent is an fp32 division, and torch evaluates
  // pow with the python-float base converted to fp32; `1.0 / t` is an fp32 reciprocal.
  const float base_f = static_cast<float>(base);
  const float dim_f = static_cast<float>(rope_dim);
  for (size_t i = 0; i < freqs_.size(); ++i) {
    const float exponent = static_cast<float>(2 * i) / dim_f;
    freqs_[i] = 1.0f / std::pow(base_f, exponent);
  }
  if (original_seq_len <= 0) return;

  // YaRN: ramp = clamp((i - low) / max(high - low, 1e-3), 0, 1) in fp32, then
  // f = f / factor * (1 - smooth) + f * smooth with smooth = 1 - ramp, each step an fp32 op.
  const YarnRange r = yarn_range(rope_dim, original_seq_len, base, beta_fast, beta_slow);
  // python's max(int, 1e-3) is the int when high > low and 1e-3 otherwise; torch divides by it in fp32.
  const float denom = r.high - r.low > 0 ? static_cast<float>(r.high - r.low) : static_cast<float>(1e-3);
  const float factor_f = static_cast<float>(factor);
  for (size_t i = 0; i < freqs_.size(); ++i) {
    const float shifted = static_cast<float>(i) - static_cast<float>(r.low);
    const float ramp = std::clamp(shifted / denom, 0.0f, 1.0f);
    const float smooth = 1.0f - ramp;
    const float f = freqs_[i];
    // Separate statements: the reference rounds every product (no fused multiply-add).
    const float scaled = f / factor_f;
    const float extrapolated = scaled * (1.0f - smooth);
    const float kept = f * smooth;
    freqs_[i] = extrapolated + kept;
  }
}

namespace {

void rotate(const std::vector<float>& freqs, float* x, int64_t pos, bool inverse) {
  // torch.outer(arange(seqlen) int64, freqs fp32) promotes the position to fp32 and rounds the
  // product to fp32, so the angle is fp32(float(pos) · f) — never a double product.
  const float p = static_cast<float>(pos);
  for (size_t i = 0; i < freqs.size(); ++i) {
    const float angle = p * freqs[i];
    // cos/sin of that fp32 angle, evaluated in double and rounded once: correctly rounded in
    // practice, where torch's vectorized fp32 cos/sin are within 1 ulp of it.
    const float c = static_cast<float>(std::cos(static_cast<double>(angle)));
    const float s_raw = static_cast<float>(std::sin(static_cast<double>(angle)));
    const float s = inverse ? -s_raw : s_raw;  // freqs_cis.conj()
    const float a = x[2 * i], b = x[2 * i + 1];
    // Complex multiply as torch's complex<float>: each product rounded, then one add each.
    const float ac = a * c, bd = b * s, ad = a * s, bc = b * c;
    x[2 * i] = round_bf16(ac - bd);
    x[2 * i + 1] = round_bf16(ad + bc);
  }
}

}  // namespace

namespace reference {

void rope(const RopeTable& table, const RotaryRows& r, bool inverse) {
  for (int64_t i = 0; i < r.rows; ++i) {
    rotate(table.freqs(), r.x + i * r.stride, r.first + (i / r.rows_per_position) * r.step, inverse);
  }
}

}  // namespace reference

}  // namespace dsv41
