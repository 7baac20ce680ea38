// How many prompt rows a step may run beside the sequences that are decoding, so that the step, and
// so the gap between their tokens, stays within a time budget. The costs come from the scheduler's
// own measurements of its forwards, nothing assumed about the machine:
//  - a decode step (a forward of decode and verify rows only) costs about `decode_seconds`: reading
//    the weights once;
//  - a forward with prompt rows costs about `prompt_row_seconds` per prompt row at the contexts now
//    being prefilled. Decode rows ride along almost free (the prompt rows read the same weights), so
//    a step of R prompt rows takes about R · prompt_row_seconds, and the prompt progresses at close
//    to its rate alone while the decoders wait at most about one budget between tokens.
// Both are moving averages, so the cost per row follows a prompt whose context grows.
#pragma once

#include <cstdint>

namespace dsv41 {

struct StepBudgetOptions {
  // The budget in seconds; 0: derived from the measured decode step, kDecodeSteps of it, within
  // [kFloorSeconds, kCeilingSeconds] (the floor until a step without prompt rows is measured).
  double budget_seconds = 0;
  // The most prompt rows one step runs (the activations' bound, EngineOptions::prefill_chunk): what a
  // step runs when nobody decodes, and before anything is measured.
  int64_t max_rows = 256;
  // The fewest prompt rows a step with a prompt runs, so a prompt progresses whatever the budget.
  int64_t min_rows = 8;
};

class StepBudget {
 public:
  // An automatic budget is this many decode steps: the decoders' tokens come at most that much apart
  // (vLLM and SGLang size a mixed step's prefill by a token budget; a time budget follows the machine).
  static constexpr double kDecodeSteps = 3;
  // ... but no less than this: below it a prompt's rows come in chunks too small for its GEMMs to
  // run at their rate (docs/serving.md measures it), and no more than this.
  static constexpr double kFloorSeconds = 0.025, kCeilingSeconds = 1.0;

  explicit StepBudget(StepBudgetOptions options);

  // A forward that ran `prompt_rows` prompt rows and `other_rows` decode and verify rows in `seconds`.
  void observe(int64_t prompt_rows, int64_t other_rows, double seconds);
  // The prompt rows a step may run beside `other_rows` decode and verify rows (max_rows when there
  // are none: a prompt alone runs at its own pace).
  int64_t prompt_rows(int64_t other_rows) const;
  // The budget now in force (seconds); automatic and before any decode step is measured, the floor.
  double budget_seconds() const;

 private:
  // 0 until a forward with prompt rows is measured
  double prompt_row_seconds() const { return prompt_rows_ > 0 ? prompt_seconds_ / prompt_rows_ : 0; }

  StepBudgetOptions options_;
  double decode_seconds_ = 0;  // 0: not measured yet
  // moving averages of the prompt forwards' seconds and rows: their ratio weighs each forward by its
  // rows, so a prompt's last few rows (whose forward is mostly fixed cost) move it little
  double prompt_seconds_ = 0, prompt_rows_ = 0;
};

}  // namespace dsv41
