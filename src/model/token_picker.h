// What chooses a token from a logits row inside the model: the DSpark drafter picks each drafted
// token before its Markov head can bias the next position. The runtime's Sampler implements it.
#pragma once

#include <cstdint>

namespace dsv41 {

class TokenPicker {
 public:
  virtual ~TokenPicker() = default;
  virtual int32_t sample(const float* logits, int64_t vocab) = 0;
};

}  // namespace dsv41
