#include "model/mhc.h"

#include "util/error.h"

namespace dsv41 {

namespace {

HcShape shape(const ModelConfig& c) {
  HcShape s;
  s.hc = c.hc_mult;
  s.dim = c.dim;
  s.norm_eps = static_cast<float>(c.norm_eps);
  s.sinkhorn_iters = c.hc_sinkhorn_iters;
  s.hc_eps = static_cast<float>(c.hc_eps);
  return s;
}

HcMixWeights mix_weights(const HcShape& s, const std::vector<float>& fn, const std::vector<float>& scale,
                         const std::vector<float>& base) {
  if (static_cast<int64_t>(fn.size()) != s.mix_count() * s.width() || scale.size() != 3 ||
      static_cast<int64_t>(base.size()) != s.mix_count()) {
    fail("hc mixes", "fn, scale or base has the wrong size for hc_mult and dim");
  }
  return {fn.data(), scale.data(), base.data()};
}

Mixes sized(const HcShape& s, int64_t count) {
  Mixes m;
  m.pre.resize(static_cast<size_t>(count * s.hc));
  m.post.resize(static_cast<size_t>(count * s.hc));
  m.comb.resize(static_cast<size_t>(count * s.hc * s.hc));
  return m;
}

HcCoefficientsOut outputs(Mixes& m) { return {m.pre.data(), m.post.data(), m.comb.data()}; }

}  // namespace

Mixes hc_mixes(const Backend& be, const ModelConfig& c, const float* X, int64_t count, const std::vector<float>& fn,
               const std::vector<float>& scale, const std::vector<float>& base) {
  const HcShape s = shape(c);
  Mixes m = sized(s, count);
  be.mhc_mixes(s, X, count, mix_weights(s, fn, scale, base), outputs(m));
  return m;
}

void hc_pre(const Backend& be, const ModelConfig& c, const float* X, const float* pre, int64_t count, float* y) {
  be.mhc_collapse(shape(c), X, pre, count, y);
}

void hc_post(const Backend& be, const ModelConfig& c, float* X, const float* y, const Mixes& m, int64_t count) {
  be.mhc_expand(shape(c), X, y, m.post.data(), m.comb.data(), count);
}

Mixes hc_step(const Backend& be, const ModelConfig& c, float* X, const float* y, const Mixes& prev,
              const std::vector<float>& fn, const std::vector<float>& scale, const std::vector<float>& base,
              int64_t count, float* u) {
  const HcShape s = shape(c);
  Mixes m = sized(s, count);
  be.mhc_step(s, X, y, {prev.pre.data(), prev.post.data(), prev.comb.data()}, mix_weights(s, fn, scale, base), count,
              outputs(m), u);
  return m;
}

}  // namespace dsv41
