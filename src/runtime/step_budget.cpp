#include "runtime/step_budget.h"

#include <algorithm>
#include <cmath>

#include "util/error.h"

namespace dsv41 {

namespace {

// The weight of a new measurement in the moving averages: within about five steps the estimate
// follows a change (another prompt joining, the batch changing; a prompt's growing context is a slow
// drift) to a few percent, while one noisy step moves it by half its error.
constexpr double kNewWeight = 0.5;

double follow(double average, double measured) {
  return average <= 0 ? measured : average + kNewWeight * (measured - average);
}

}  // namespace

StepBudget::StepBudget(StepBudgetOptions options) : options_(options) {
  if (!(options_.budget_seconds >= 0) || !std::isfinite(options_.budget_seconds))
    fail("step budget", "must be a finite number of seconds, at least 0 (0: automatic)");
  if (options_.max_rows < 1) fail("step budget", "needs at least one prompt row per step");
  options_.min_rows = std::clamp<int64_t>(options_.min_rows, 1, options_.max_rows);
}

void StepBudget::observe(int64_t prompt_rows, int64_t other_rows, double seconds) {
  if (!(seconds >= 0) || !std::isfinite(seconds)) return;
  if (prompt_rows > 0) {
    // the step's whole time over its prompt rows: what a prompt row costs with the decoders beside it
    prompt_seconds_ = follow(prompt_seconds_, seconds);
    prompt_rows_ = follow(prompt_rows_, static_cast<double>(prompt_rows));
  } else if (other_rows > 0) {
    decode_seconds_ = follow(decode_seconds_, seconds);
  }
}

double StepBudget::budget_seconds() const {
  if (options_.budget_seconds > 0) return options_.budget_seconds;
  // before any step without prompt rows (a fleet whose prompts never stop arriving), the floor
  if (decode_seconds_ <= 0) return kFloorSeconds;
  return std::clamp(kDecodeSteps * decode_seconds_, kFloorSeconds, kCeilingSeconds);
}

int64_t StepBudget::prompt_rows(int64_t other_rows) const {
  const double budget = budget_seconds();
  const double per_row = prompt_row_seconds();
  if (other_rows <= 0 || per_row <= 0) return options_.max_rows;
  const double rows = std::floor(budget / per_row);
  if (rows >= static_cast<double>(options_.max_rows)) return options_.max_rows;
  return std::max(options_.min_rows, static_cast<int64_t>(rows));
}

}  // namespace dsv41
