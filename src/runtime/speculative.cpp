#include "runtime/speculative.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "numeric/row_codecs.h"
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

SpeculativeDecoder::SpeculativeDecoder(Session& session, const Drafter& drafter, Sampler& sampler,
                                       SpeculativeOptions options)
    : session_(session), drafter_(drafter), sampler_(sampler),
      // the drafter samples with the target's settings from a stream of its own
      draft_sampler_(SamplingParams{sampler.params().temperature, sampler.params().top_p, sampler.params().seed ^ 0x5eedu}),
      options_(std::move(options)) {
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
  const Model& model = session_.model();
  const ModelConfig& c = model.config();
  SequenceState& st = session_.mutable_state();
  const int64_t p1 = st.length, V = c.vocab_size, W = c.window_size;

  Draft d = drafter_.draft(st, next, draft_sampler_);
  const int K0 = choose_length(d.confidence);
  std::vector<int32_t> proposals(d.tokens.begin(), d.tokens.begin() + K0);
  std::vector<std::vector<double>> q(static_cast<size_t>(K0));
  for (int j = 0; j < K0; ++j) q[j] = draft_sampler_.distribution(&d.logits[j * V], V);
  if (options_.force_drafts) {
    proposals = options_.force_drafts(p1, proposals);
    if (proposals.size() > static_cast<size_t>(drafter_.block_size())) fail("speculative", "too many forced drafts");
    q.assign(proposals.size(), std::vector<double>(static_cast<size_t>(V), 0.0));
    for (size_t j = 0; j < proposals.size(); ++j) q[j][static_cast<size_t>(proposals[j])] = 1.0;  // drawn with certainty
  }
  const int64_t K = static_cast<int64_t>(proposals.size());

  // what the verify forward overwrites and a rollback must put back
  const int64_t wrb = window_row_bytes(c.head_dim);
  std::vector<std::vector<uint8_t>> saved_slots(static_cast<size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    if (st.window[l].empty()) continue;
    for (int64_t pos = p1; pos <= p1 + K; ++pos) {
      const uint8_t* slot = &st.window[l][(pos % W) * wrb];
      saved_slots[l].insert(saved_slots[l].end(), slot, slot + wrb);
    }
  }
  std::vector<std::vector<float>> saved_tail_kv(st.sources.size()), saved_tail_score(st.sources.size());
  for (size_t l = 0; l < st.sources.size(); ++l) {
    if (!st.sources[l]) continue;
    saved_tail_kv[l] = st.sources[l]->tail_kv;
    saved_tail_score[l] = st.sources[l]->tail_score;
  }
  const int saved_keys_layer = st.last_index_keys_layer;

  // verify every proposal in one target forward
  std::vector<int32_t> run = {next};
  run.insert(run.end(), proposals.begin(), proposals.end());
  ForwardOptions opt;
  opt.all_logits = true;
  opt.record_compressor_rows = true;
  opt.dspark_taps = true;
  opt.index_keys = session_.options().index_keys;
  ForwardResult r = model.forward(st, run, opt);
  ++stats_.target_forwards;

  std::vector<std::vector<double>> p(static_cast<size_t>(K + 1));
  for (int64_t j = 0; j <= K; ++j) p[j] = sampler_.distribution(&r.logits[j * V], V);
  int32_t extra = 0;
  const int64_t a = accept_drafts(p, q, proposals, sampler_, extra);
  const int64_t kept = p1 + 1 + a;  // `next` and the accepted drafts

  // roll back the rejected positions: window slots, compressed rows and keys, compressor tails, the
  // last key publisher, the n-gram history
  for (int l = 0; l < c.n_layers; ++l) {
    if (saved_slots[l].empty()) continue;
    for (int64_t pos = kept; pos <= p1 + K; ++pos) {
      std::memcpy(&st.window[l][(pos % W) * wrb], &saved_slots[l][(pos - p1) * wrb], static_cast<size_t>(wrb));
    }
  }
  int keys_layer = saved_keys_layer;
  for (size_t l = 0; l < st.sources.size(); ++l) {
    KvSourceState* src = st.sources[l].get();
    if (!src) continue;
    const int64_t ratio = c.compress_ratios[l], D = c.head_dim;
    src->compressed.truncate(kept / ratio);
    src->index_keys.truncate(kept / ratio);
    if (kept / ratio > p1 / ratio) keys_layer = static_cast<int>(l);  // emitted a row within the kept part
    if (ratio > 1 && !r.compressor_kv[l].empty()) {
      src->tail_kv = saved_tail_kv[l];
      src->tail_score = saved_tail_score[l];
      if (src->tail_kv.empty()) {
        src->tail_kv.assign(static_cast<size_t>(ratio * D), 0.0f);
        src->tail_score.assign(static_cast<size_t>(ratio * D), -INFINITY);
      }
      for (int64_t pos = p1; pos < kept; ++pos) {
        std::copy_n(&r.compressor_kv[l][(pos - p1) * D], D, &src->tail_kv[(pos % ratio) * D]);
        std::copy_n(&r.compressor_score[l][(pos - p1) * D], D, &src->tail_score[(pos % ratio) * D]);
      }
    }
  }
  st.last_index_keys_layer = keys_layer;
  st.length = kept;
  std::vector<int32_t>& history = session_.mutable_history();
  history.insert(history.end(), run.begin(), run.begin() + 1 + a);
  st.engram_recent = model.engram_history(history);
  drafter_.observe(st, r.dspark_taps, 0, p1, 1 + a);

  Step out;
  out.tokens.assign(proposals.begin(), proposals.begin() + a);
  out.tokens.push_back(extra);
  out.rows.assign(r.logits.begin(), r.logits.begin() + (a + 1) * V);
  ++stats_.steps;
  stats_.proposed += K;
  stats_.accepted += a;
  for (int64_t j = 0; j < a; ++j) ++stats_.accepted_per_position[static_cast<size_t>(j)];
  stats_.emitted += a + 1;
  return out;
}

}  // namespace dsv41
