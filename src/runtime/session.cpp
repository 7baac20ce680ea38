#include "runtime/session.h"

#include <algorithm>

#include "util/error.h"

namespace dsv41 {

Session::Session(const Model& model, StatePools& pools, SessionOptions options, PrefixCache* cache)
    : model_(model), options_(options), state_(model.new_sequence(pools)), cache_(cache) {
  if (options_.chunk < 0) fail("chunk", "must be >= 0");
}

void Session::begin_prefill(const std::vector<int32_t>& tokens) {
  if (tokens.empty()) fail("prompt", "is empty");
  if (prefill_pending()) fail("prefill", "the previous prompt is still being prefilled");
  const int64_t n = static_cast<int64_t>(tokens.size()), origin = state_.length;
  pending_opt_ = {};
  pending_opt_.index_keys = options_.index_keys;
  pending_opt_.dspark_taps = static_cast<bool>(observer_);
  if (options_.prefill_mode == PrefillMode::Tail) {
    // CED: the layers after the last KV source only need the prompt's last `window` rows
    pending_opt_.tail_start = std::max<int64_t>(origin, origin + n - model_.config().window_size);
  }
  hit_ = {};
  disk_bytes_ = 0;
  stored_tokens_ = 0;
  const bool caching = cache_ && origin == 0;
  if (caching) hit_ = cache_->restore(tokens, state_, pending_opt_.tail_start);
  // With a cache, one call ends exactly at the last block boundary so the state there can be stored.
  store_at_ = caching ? PrefixCache::usable_boundary(n) : -1;
  pending_ = tokens;
  pending_origin_ = origin;
  pending_done_ = state_.length - origin;
  last_logits_.clear();
  history_.insert(history_.end(), tokens.begin(), tokens.end());
}

int64_t Session::prefill_step(int64_t max_tokens) {
  if (!prefill_pending()) return 0;
  const int64_t n = static_cast<int64_t>(pending_.size()), done = pending_done_;
  int64_t end = std::min(n, done + std::max<int64_t>(max_tokens, 1));
  if (done < store_at_ && store_at_ < end) end = store_at_;
  ForwardResult r = model_.forward(state_, {pending_.begin() + done, pending_.begin() + end}, pending_opt_);
  if (observer_) observer_(state_, r, pending_origin_ + done, end - done);
  pending_done_ = end;
  if (end == n) last_logits_ = std::move(r.logits);
  if (end == store_at_ && store_at_ > hit_.cached_tokens) {
    disk_bytes_ = cache_->store({pending_.begin(), pending_.begin() + store_at_}, state_);
    stored_tokens_ = store_at_;
  }
  return end - done;
}

std::vector<float> Session::prefill(const std::vector<int32_t>& tokens,
                                    const std::function<void(int64_t, int64_t)>& progress) {
  begin_prefill(tokens);
  const int64_t chunk = options_.chunk > 0 ? options_.chunk : kDefaultPrefillChunk;
  while (prefill_pending()) {
    prefill_step(chunk);
    if (progress) progress(pending_done_, static_cast<int64_t>(pending_.size()));
  }
  return last_logits_;
}

std::vector<float> Session::decode(int32_t token) {
  ForwardOptions opt;
  opt.index_keys = options_.index_keys;
  opt.dspark_taps = static_cast<bool>(observer_);
  ForwardResult r = model_.forward(state_, {token}, opt);
  history_.push_back(token);
  if (observer_) observer_(state_, r, state_.length - 1, 1);
  return std::move(r.logits);
}

std::vector<std::vector<float>> Session::decode_batch(const std::vector<Session*>& sessions,
                                                      const std::vector<int32_t>& tokens) {
  if (sessions.empty()) return {};
  bool plain = sessions.size() == 1;
  for (Session* s : sessions) {
    // sessions that observe every forward (a drafter) or use another model or key mode go one by one
    plain = plain || s->observer_ || &s->model_ != &sessions[0]->model_ ||
            s->options_.index_keys != sessions[0]->options_.index_keys || s->prefill_pending();
  }
  if (plain) {
    std::vector<std::vector<float>> out;
    for (size_t i = 0; i < sessions.size(); ++i) out.push_back(sessions[i]->decode(tokens[i]));
    return out;
  }
  std::vector<SequenceState*> states;
  for (Session* s : sessions) states.push_back(&s->state_);
  std::vector<std::vector<float>> out =
      sessions[0]->model_.decode_batch(states, tokens, sessions[0]->options_.index_keys);
  for (size_t i = 0; i < sessions.size(); ++i) sessions[i]->history_.push_back(tokens[i]);
  return out;
}

}  // namespace dsv41
