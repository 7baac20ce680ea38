// Speculative decoding with the model's own DSpark drafter (model-spec §3.8): the drafter proposes up
// to block_size tokens, the target verifies them in one batched forward, the longest acceptable prefix
// is kept plus one token of the target's own, and every kind of state the rejected positions touched is
// rolled back to exactly what it would be had they never been run.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "model/dspark.h"
#include "runtime/sampler.h"
#include "runtime/session.h"

namespace dsv41 {

// When drafting stops paying: a verification costs more than a plain decode step (the drafter's
// forward, its head over the drafted rows, K more rows through the target), and how much more depends
// on the model and the machine (measured, docs/speculative.md: 3.3x a plain step on tiny, where
// per-call overhead dominates, about 1.5x at the released widths). So the guard measures both: each
// window of verifications gives tokens per second speculating; plain steps (a short probe after the
// first window, which decides when it ends, then every pause) give the plain rate. A window slower
// than plain decoding pauses drafting (the pause doubling for every failure in a row, reset by a
// window that pays) before it is tried again. The times are those the sequence sees: in a batch, the
// whole step's. While paused, the drafter stops observing the target, and the taps of the pause's
// last window-ring's length of steps are kept and projected in one batch when drafting resumes, so a
// pause costs plain steps only and the drafter still resumes with its whole window.
// Greedy output does not depend on the guard. At temperature > 0 it does: a verification and a plain
// step draw differently from the seeded stream, and the guard decides by timing, so a seeded sampled
// run repeats itself exactly only with the guard off (`--acceptance-guard off`).
struct AcceptanceGuardOptions {
  bool enabled = true;
  // Each window that does not pay costs its verifications' excess over plain steps, so the window is
  // short and the pauses grow long: at most `window` verifications per max_pause_steps plain steps
  // once drafting has failed a few times (docs/speculative.md measures the bound). Two verifications
  // tell a drafter that pays from one that does not well enough: a wrong pause costs one pause's
  // gain, a wrong go-on one more window.
  int window = 2;                     // verifications measured before each decision
  int probe_steps = 2;                // plain steps timed after the first window
  int pause_steps = 32;               // plain steps of the first pause
  int max_pause_steps = 1024;
  // Plain steps before the first window: what sequences that finished before this one learned (the
  // engine passes learned_pause() on), so that where drafting has not been paying a new sequence
  // does not pay for a window to find out again. A first window that fails after it pauses for twice
  // as long; one that pays resets the pauses.
  int start_paused = 0;
};

class AcceptanceGuard {
 public:
  explicit AcceptanceGuard(AcceptanceGuardOptions options);
  bool drafting() const { return plain_left_ == 0; }  // whether the next step should speculate
  int plain_steps_left() const { return plain_left_; }  // of the probe or pause under way
  void verified(int64_t tokens, double seconds);      // after a verification that yielded `tokens`
  void plain_step(double seconds);                    // after a plain step (a probe or a pause)
  int64_t pauses() const { return pauses_; }
  // For the next sequence's start_paused: the pause the last decision chose, 0 if it found that
  // drafting pays or nothing was decided.
  int learned_pause() const { return learned_pause_; }

 private:
  AcceptanceGuardOptions options_;
  int steps_ = 0;
  int64_t tokens_ = 0;
  double seconds_ = 0;
  double plain_seconds_ = 0;  // mean of the plain steps timed (running mean, then an average of 8)
  int64_t plain_timed_ = 0;
  int plain_left_ = 0, next_pause_ = 0;
  bool probing_ = false;  // the plain steps under way are the probe a window waits for
  void decide();          // on the window's verifications against the plain rate
  int64_t pauses_ = 0;
  int learned_pause_ = 0;
};

struct SpeculativeOptions {
  // Drafts verified per step: 0 = adaptive (the confidence head's acceptance estimates, below), else
  // a fixed count in 1..block_size.
  int fixed_length = 0;
  // Adaptive: verify drafts while the estimated probability that all of them are accepted,
  // prod(sigmoid(confidence_k)), stays at or above this.
  double min_survival = 0.5;
  AcceptanceGuardOptions guard;
  // Test and measurement hook: replaces the drafted tokens (at most block_size of them) for the step
  // whose first token sits at `position`.
  std::function<std::vector<int32_t>(int64_t position, const std::vector<int32_t>& drafted)> force_drafts;
  // Test hook: replaces each step's measured seconds for the acceptance guard (`verification` says
  // which kind of step), so that its decisions follow the test, not how busy the machine is.
  std::function<double(bool verification, double measured)> step_seconds;
  // Structured outputs: masks a target logits row to the tokens allowed after `accepted` (the tokens
  // this step has produced before the row's position), setting the others to -inf. The target's
  // distribution at each verified position is its masked row's, so a draft outside the mask is
  // rejected, and greedy output is the plain constrained run's token for token.
  std::function<void(const std::vector<int32_t>& accepted, std::vector<float>& row)> constrain;
};

struct SpeculativeStats {
  int64_t steps = 0;                         // verifications
  int64_t proposed = 0;                      // drafts verified
  int64_t accepted = 0;                      // drafts accepted
  std::vector<int64_t> accepted_per_position;  // [k]: steps whose k-th draft was accepted
  int64_t target_forwards = 0;               // verification forwards (one per step)
  int64_t emitted = 0;                       // tokens produced by the verifications
  int64_t plain_steps = 0;                   // steps decoded without drafts (guard pauses, the last token)
  int64_t guard_pauses = 0;                  // times the acceptance guard stopped drafting
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
  // The same in two halves around a forward shared with other sessions (Session::run_planned):
  // plan() drafts and plans a verification of at most `max_drafts` drafts on the session, or a plain
  // decode when max_drafts < 1 or the acceptance guard is pausing; finish() reads the result.
  void plan(int32_t next, int max_drafts);
  Step finish();
  const SpeculativeStats& stats() const { return stats_; }
  const AcceptanceGuard& guard() const { return guard_; }

 private:
  int choose_length(const std::vector<float>& confidence) const;

  Session& session_;
  const Drafter& drafter_;
  Sampler& sampler_;
  Sampler draft_sampler_;
  SpeculativeOptions options_;
  AcceptanceGuard guard_;
  SpeculativeStats stats_;
  // the planned step
  bool verifying_ = false;
  std::chrono::steady_clock::time_point planned_at_;
  std::vector<int32_t> proposals_;
  std::vector<std::vector<double>> q_;
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
