// The DSpark drafter (model-spec §3.8): the mtp.* blocks draft `dspark_block_size` tokens after the
// target's newest token in one forward. Context comes only from the drafter's own window rings, filled
// with projections of the target's tapped streams; the draft block attends to those rings and,
// bidirectionally, to itself. A Markov head biases each drafted position's logits by the token before
// it, sequentially, and a confidence head estimates how likely each draft is to be accepted.
#pragma once

#include <cstdint>
#include <vector>

#include "model/model.h"
#include "state/sequence_state.h"
#include "model/token_picker.h"

namespace dsv41 {

struct Draft {
  std::vector<int32_t> tokens;     // block_size drafted tokens, after the given one
  std::vector<float> logits;       // [block_size, vocab]: the drafter's logits (Markov bias included)
  std::vector<float> confidence;   // [block_size]: raw confidence-head outputs
};

class Drafter {
 public:
  explicit Drafter(const Model& model);

  // Fills the drafter's rings with the target positions [start, start+count), from the taps the target
  // forward returned for them (ForwardResult::dspark_taps rows, row `first_row` onward).
  void observe(SequenceState& state, const std::vector<float>& taps, int64_t first_row, int64_t start,
               int64_t count) const;

  // Drafts after `next`, the token the target produced for position state.length. The rings must hold
  // position state.length - 1. `picker` chooses each drafted token from the drafter's logits.
  Draft draft(const SequenceState& state, int32_t next, TokenPicker& picker) const;

  int block_size() const { return model_.config().dspark_block_size; }

 private:
  const Model& model_;
};

}  // namespace dsv41
