#include "runtime/speculative.h"

#include <algorithm>
#include <cmath>

#include "util/error.h"

namespace dsv41 {

void attach_drafter(Session& session, const Drafter& drafter) {
  session.set_observer([&drafter](SequenceState& st, const ForwardResult& r, int64_t start, int64_t count) {
    // tail mode computes the tapped layers only for the prompt's last rows: the ring needs no more
    drafter.observe(st, r.dspark_taps, r.first_tap_row, start + r.first_tap_row, count - r.first_tap_row);
  });
}

int accept_drafts(const std::vector<std::vector<double>>& target, const std::vector<std::vector<double>>& draft,
                  const std::vector<int32_t>& proposals, Sampler& rng, int32_t& next) {
  const size_t K = proposals.size();
  for (size_t j = 0; j < K; ++j) {
    const int32_t y = proposals[j];
    const double p = target[j][static_cast<size_t>(y)], q = draft[j][static_cast<size_t>(y)];
    if (q > 0 && rng.uniform() * q < p) continue;  // accepted with probability min(1, p/q)
    std::vector<double> residual(target[j].size());
    double mass = 0;
    for (size_t v = 0; v < residual.size(); ++v) mass += residual[v] = std::max(0.0, target[j][v] - draft[j][v]);
    next = mass > 0 ? rng.draw(residual) : rng.draw(target[j]);
    return static_cast<int>(j);
  }
  next = rng.draw(target[K]);
  return static_cast<int>(K);
}

AcceptanceGuard::AcceptanceGuard(AcceptanceGuardOptions options)
    : options_(options), next_pause_(options.pause_steps) {
  if (options_.window < 1 || options_.probe_steps < 1 || options_.pause_steps < 1 ||
      options_.max_pause_steps < options_.pause_steps || options_.start_paused < 0 ||
      options_.start_paused > options_.max_pause_steps) {
    fail("acceptance guard",
         "needs window >= 1, probe_steps >= 1, 1 <= pause_steps <= max_pause_steps and 0 <= start_paused <= max_pause_steps");
  }
  if (options_.enabled && options_.start_paused > 0) {
    // the steps of the start are timed as a pause's are, so the first window decides without a probe
    plain_left_ = options_.start_paused;
    next_pause_ = std::min(std::max(options_.start_paused * 2, options_.pause_steps), options_.max_pause_steps);
    learned_pause_ = options_.start_paused;
  }
}

void AcceptanceGuard::verified(int64_t tokens, double seconds) {
  if (!options_.enabled) return;
  ++steps_;
  tokens_ += tokens;
  seconds_ += seconds;
  if (steps_ < options_.window) return;
  if (plain_timed_ == 0) {  // nothing to compare with yet: time a few plain steps, then decide
    plain_left_ = options_.probe_steps;
    probing_ = true;
    return;
  }
  decide();
}

void AcceptanceGuard::plain_step(double seconds) {
  // a running mean of the first few, then an exponential average that follows the context's growth
  ++plain_timed_;
  const double weight = 1.0 / static_cast<double>(std::min<int64_t>(plain_timed_, 8));
  plain_seconds_ += (seconds - plain_seconds_) * weight;
  if (plain_left_ > 0 && --plain_left_ == 0 && probing_) {
    probing_ = false;
    decide();  // the window waiting for the probe
  }
}

void AcceptanceGuard::decide() {
  // pays when speculating yields tokens at least as fast as plain steps do
  const bool pays = static_cast<double>(tokens_) * plain_seconds_ >= seconds_;
  steps_ = 0;
  tokens_ = 0;
  seconds_ = 0;
  if (pays) {
    next_pause_ = options_.pause_steps;  // a later failure starts from the first pause again
    learned_pause_ = 0;
    return;
  }
  plain_left_ = next_pause_;
  learned_pause_ = next_pause_;
  next_pause_ = std::min(next_pause_ * 2, options_.max_pause_steps);
  ++pauses_;
}

SpeculativeDecoder::SpeculativeDecoder(Session& session, const Drafter& drafter, Sampler& sampler,
                                       SpeculativeOptions options)
    : session_(session), drafter_(drafter), sampler_(sampler),
      // the drafter samples with the target's settings from a stream of its own
      draft_sampler_([&] {
        SamplingParams p = sampler.params();
        p.seed ^= 0x5eedu;
        return p;
      }()),
      options_(std::move(options)), guard_(options_.guard) {
  if (options_.fixed_length < 0 || options_.fixed_length > drafter.block_size()) {
    fail("--draft-length", "must be between 1 and the DSpark block size " + std::to_string(drafter.block_size()));
  }
  const ModelConfig& c = session.model().config();
  if (drafter.block_size() + 1 > c.window_size) fail("speculative", "a verify step must fit in the window ring");
  stats_.accepted_per_position.assign(static_cast<size_t>(drafter.block_size()), 0);
}

int SpeculativeDecoder::choose_length(const std::vector<float>& confidence) const {
  const int B = static_cast<int>(confidence.size());
  if (options_.fixed_length > 0) return std::min(options_.fixed_length, B);
  // the confidence head estimates each draft's conditional acceptance (as a logit): keep drafts while
  // the probability that all of them survive stays high enough
  double survive = 1;
  int k = 0;
  for (int j = 0; j < B; ++j) {
    survive *= 1.0 / (1.0 + std::exp(-static_cast<double>(confidence[j])));
    if (survive < options_.min_survival) break;
    k = j + 1;
  }
  return std::max(k, 1);
}

SpeculativeDecoder::Step SpeculativeDecoder::step(int32_t next) {
  plan(next, drafter_.block_size());
  Session::run_planned({&session_});
  return finish();
}

void SpeculativeDecoder::plan(int32_t next, int max_drafts) {
  planned_at_ = std::chrono::steady_clock::now();
  verifying_ = max_drafts >= 1 && guard_.drafting();
  if (!verifying_) {
    // the drafter's rings need only the window before its next draft: none at the end, and during a
    // pause only its last window_size steps, which it projects in one batch when drafting resumes
    const bool drafts_again = max_drafts >= 1 && guard_.plain_steps_left() <= session_.model().config().window_size;
    session_.plan_decode(next, drafts_again ? Session::Observe::Later : Session::Observe::No);
    return;
  }
  session_.observe_deferred();
  const int64_t V = session_.model().config().vocab_size;
  Draft d = drafter_.draft(session_.state(), next, draft_sampler_);
  const int K0 = std::min(choose_length(d.confidence), max_drafts);
  proposals_.assign(d.tokens.begin(), d.tokens.begin() + K0);
  q_.assign(static_cast<size_t>(K0), {});
  for (int j = 0; j < K0; ++j) q_[j] = draft_sampler_.distribution(&d.logits[j * V], V);
  if (options_.force_drafts) {
    proposals_ = options_.force_drafts(session_.position(), proposals_);
    if (proposals_.size() > static_cast<size_t>(std::min(max_drafts, drafter_.block_size()))) {
      proposals_.resize(static_cast<size_t>(std::min(max_drafts, drafter_.block_size())));
    }
    q_.assign(proposals_.size(), std::vector<double>(static_cast<size_t>(V), 0.0));
    for (size_t j = 0; j < proposals_.size(); ++j) q_[j][static_cast<size_t>(proposals_[j])] = 1.0;  // drawn with certainty
  }
  std::vector<int32_t> run = {next};
  run.insert(run.end(), proposals_.begin(), proposals_.end());
  session_.plan_verify(std::move(run));
}

SpeculativeDecoder::Step SpeculativeDecoder::finish() {
  const int64_t V = session_.model().config().vocab_size;
  const ForwardResult& r = session_.planned_result();
  const double measured = std::chrono::duration<double>(std::chrono::steady_clock::now() - planned_at_).count();
  const double seconds = options_.step_seconds ? options_.step_seconds(verifying_, measured) : measured;
  Step out;
  std::vector<float> row;
  if (!verifying_) {  // a plain step: the target's own token
    if (options_.constrain) {
      row = r.logits;
      options_.constrain({}, row);
      out.tokens.push_back(sampler_.sample(row.data(), V));
    } else {
      out.tokens.push_back(sampler_.sample(r.logits.data(), V));
    }
    out.rows = r.logits;
    ++stats_.plain_steps;
    guard_.plain_step(seconds);
    stats_.guard_pauses = guard_.pauses();  // a probe's end may decide
    return out;
  }
  const int64_t K = static_cast<int64_t>(proposals_.size());
  std::vector<std::vector<double>> p(static_cast<size_t>(K + 1));
  for (int64_t j = 0; j <= K; ++j) {
    if (!options_.constrain) {
      p[j] = sampler_.distribution(&r.logits[j * V], V);
      continue;
    }
    row.assign(r.logits.begin() + j * V, r.logits.begin() + (j + 1) * V);
    options_.constrain(std::vector<int32_t>(proposals_.begin(), proposals_.begin() + j), row);
    p[j] = sampler_.distribution(row.data(), V);
    if (j < K && std::isinf(row[static_cast<size_t>(proposals_[j])])) {
      // the draft leaves the grammar: it is rejected here (its target probability is 0), and no
      // later position is read
      for (int64_t k = j + 1; k <= K; ++k) p[k] = p[j];
      break;
    }
  }
  int32_t extra = 0;
  const int64_t a = accept_drafts(p, q_, proposals_, sampler_, extra);
  out.tokens.assign(proposals_.begin(), proposals_.begin() + a);
  out.tokens.push_back(extra);
  out.rows.assign(r.logits.begin(), r.logits.begin() + (a + 1) * V);
  session_.keep_verified(1 + a);  // `next` and the accepted drafts; `extra` runs in the next step
  ++stats_.target_forwards;
  ++stats_.steps;
  stats_.proposed += K;
  stats_.accepted += a;
  for (int64_t j = 0; j < a; ++j) ++stats_.accepted_per_position[static_cast<size_t>(j)];
  stats_.emitted += a + 1;
  guard_.verified(a + 1, seconds);
  stats_.guard_pauses = guard_.pauses();
  return out;
}

}  // namespace dsv41
