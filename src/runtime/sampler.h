// Token sampling: greedy at temperature 0, otherwise softmax(logits / T) restricted to the smallest
// set of tokens whose probability reaches top_p, drawn with a seeded generator so the same seed gives
// the same tokens on every machine.
#pragma once

#include <cstdint>
#include <vector>

namespace dsv41 {

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy (argmax)
  double top_p = 1.0;        // (0, 1]
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  int32_t sample(const float* logits, int64_t vocab);
  const SamplingParams& params() const { return params_; }

 private:
  double uniform();  // [0, 1)
  SamplingParams params_;
  uint64_t state_[4];
  std::vector<int32_t> order_;
  std::vector<double> probs_;
};

// Index of the largest logit (the lowest index among equals).
int32_t argmax(const float* logits, int64_t vocab);

}  // namespace dsv41
