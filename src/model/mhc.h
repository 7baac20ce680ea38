// The mHC residual stream (model-spec §3.2): hc_mult copies of the hidden state, mixed around every
// sublayer by coefficients computed from the stream itself (Sinkhorn-normalised `comb`), with the
// V4.1 single-pass handoff of `pre` from one sublayer to the next. The arithmetic is the backend's
// mHC ops.
#pragma once

#include <cstdint>
#include <vector>

#include "io/config.h"
#include "kernels/backend.h"

namespace dsv41 {

struct Mixes {
  std::vector<float> pre, post, comb;  // [count, hc], [count, hc], [count, hc, hc]
};

// The coefficients of one sublayer for each token: one rsqrt over all hc·dim values of the token, a
// (2+hc)·hc-wide fp32 projection, then Sinkhorn.
Mixes hc_mixes(const Backend& be, const ModelConfig& c, const float* X, int64_t count, const std::vector<float>& fn,
               const std::vector<float>& scale, const std::vector<float>& base);
// Collapse the copies with `pre` (fp32 sum, one bf16 rounding): y[count, dim].
void hc_pre(const Backend& be, const ModelConfig& c, const float* X, const float* pre, int64_t count, float* y);
// Expand a sublayer output back: X'[k] = post[k]·y + Σ_j comb[j][k]·X[j], rounded to bf16.
void hc_post(const Backend& be, const ModelConfig& c, float* X, const float* y, const Mixes& m, int64_t count);
// The step from one sublayer to the next, in one pass over the stream: hc_post(X, y, prev), then the
// next sublayer's mixes of the new X (returned), then hc_pre of the new X with prev.pre into u (the
// next sublayer's input). Same bits as those three calls.
Mixes hc_step(const Backend& be, const ModelConfig& c, float* X, const float* y, const Mixes& prev,
              const std::vector<float>& fn, const std::vector<float>& scale, const std::vector<float>& base,
              int64_t count, float* u);

}  // namespace dsv41
