// How a request's tokens are drawn (runtime/sampler.h draws them).
#pragma once

#include <cstdint>

namespace dsv41 {

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy (argmax)
  double top_p = 1.0;        // (0, 1]
  uint64_t seed = 0;
  int64_t top_k = 0;         // the k most likely tokens only, before top_p; 0: all
};

}  // namespace dsv41
