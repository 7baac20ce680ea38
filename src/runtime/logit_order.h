// The vocabulary ordered by logit for sampling: largest first, equal logits by ascending id (-0 and
// +0 equal), exactly the order a comparison sort with that rule gives, so seeded draws and the
// normaliser's summation order stay what they were. A stable LSD radix sort on the logits' bits: at
// the released vocabulary (129,280) the comparison sort took 14.2 ms per sampled row on one EPYC
// core (bench/kernels_bench.cpp, SampleRow), and a speculative verification at temperature > 0
// samples up to 2·block + 1 rows.
#pragma once

#include <cstdint>
#include <vector>

namespace dsv41 {

class LogitOrder {
 public:
  // Fills `order` with 0..vocab-1 in that order. NaN logits have no place in the rule; they sort as
  // their bits say (deterministic, never a crash).
  void sort(const float* logits, int64_t vocab, std::vector<int32_t>& order);

 private:
  std::vector<uint32_t> keys_, keys_tmp_;  // scratch kept between calls: no allocation per token
  std::vector<int32_t> order_tmp_;
};

}  // namespace dsv41
