// Token sampling: greedy at temperature 0, otherwise softmax(logits / T) restricted to the top_k most
// likely tokens and, within them, to the smallest set whose probability reaches top_p, drawn with a seeded generator so the same seed gives
// the same tokens on every machine.
#pragma once

#include <cstdint>
#include <vector>

#include "model/token_picker.h"
#include "runtime/logit_order.h"
#include "runtime/sampling_params.h"

namespace dsv41 {

class Sampler final : public TokenPicker {
 public:
  explicit Sampler(const SamplingParams& params);
  int32_t sample(const float* logits, int64_t vocab) override;
  const SamplingParams& params() const { return params_; }

  // The distribution sample() draws from: softmax(logits / T) cut to the top-p nucleus and
  // renormalised (one-hot at the argmax at temperature 0).
  std::vector<double> distribution(const float* logits, int64_t vocab);
  // A draw from a distribution over token ids (weights need not sum to 1).
  int32_t draw(const std::vector<double>& weights);
  double uniform();  // [0, 1)

 private:
  void sample_prepare(const float* logits, int64_t vocab);  // fills order_, probs_, keep_
  SamplingParams params_;
  uint64_t state_[4];
  int64_t keep_ = 0;
  std::vector<int32_t> order_;
  std::vector<double> probs_;
  LogitOrder logit_order_;
};

// Index of the largest logit (the lowest index among equals).
int32_t argmax(const float* logits, int64_t vocab);

}  // namespace dsv41
