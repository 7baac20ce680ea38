// Speculative decoding with the model's own DSpark drafter (model-spec §3.8): the drafter proposes up
// to block_size tokens, the target verifies them in one batched forward, the longest acceptable prefix
// is kept plus one token of the target's own, and every kind of state the rejected positions touched is
// rolled back to exactly what it would be had they never been run.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "model/dspark.h"
#include "runtime/sampler.h"
#include "runtime/session.h"

namespace dsv41 {

struct SpeculativeOptions {
  // Drafts verified per step: 0 = adaptive (the confidence head's acceptance estimates, below), else
  // a fixed count in 1..block_size.
  int fixed_length = 0;
  // Adaptive: verify drafts while the estimated probability that all of them are accepted,
  // prod(sigmoid(confidence_k)), stays at or above this.
  double min_survival = 0.5;
  // Test hook: replaces the drafted tokens (at most block_size of them) for the step whose first
  // token sits at `position`.
  std::function<std::vector<int32_t>(int64_t position, const std::vector<int32_t>& drafted)> force_drafts;
};

struct SpeculativeStats {
  int64_t steps = 0;
  int64_t proposed = 0;                      // drafts verified
  int64_t accepted = 0;                      // drafts accepted
  std::vector<int64_t> accepted_per_position;  // [k]: steps whose k-th draft was accepted
  int64_t target_forwards = 0;               // verification forwards (one per step)
  int64_t emitted = 0;                       // tokens produced by the steps
  double mean_accept_len() const { return steps ? static_cast<double>(emitted) / static_cast<double>(steps) : 0.0; }
};

class SpeculativeDecoder {
 public:
  // The session must have been created with the drafter observing it (attach_drafter).
  SpeculativeDecoder(Session& session, const Drafter& drafter, Sampler& sampler, SpeculativeOptions options);

  // One step after `next`, the newest emitted token (not yet run by the target): the tokens produced
  // (accepted drafts, then the target's own) and, for each, the target logits row that chose it.
  struct Step {
    std::vector<int32_t> tokens;
    std::vector<float> rows;
  };
  Step step(int32_t next);
  const SpeculativeStats& stats() const { return stats_; }

 private:
  int choose_length(const std::vector<float>& confidence) const;

  Session& session_;
  const Drafter& drafter_;
  Sampler& sampler_;
  Sampler draft_sampler_;
  SpeculativeOptions options_;
  SpeculativeStats stats_;
};

// Makes `drafter` observe every target forward of `session` (its rings follow the target's taps).
void attach_drafter(Session& session, const Drafter& drafter);

// The acceptance rule for one step (exposed for its statistical test): proposals[j] was drawn from
// draft[j]; target[j] is the target's distribution at that position, target[K] after all of them.
// Accepts proposals[j] with probability min(1, p/q); at the first rejection draws from
// normalise(max(0, p − q)); if all are accepted draws from target[K]. Returns the number accepted and
// sets `next` to the extra token. The emitted tokens are distributed exactly as target sampling.
int accept_drafts(const std::vector<std::vector<double>>& target, const std::vector<std::vector<double>>& draft,
                  const std::vector<int32_t>& proposals, Sampler& rng, int32_t& next);

}  // namespace dsv41
