#include "runtime/session.h"

#include <algorithm>
#include <exception>

#include "util/error.h"

namespace dsv41 {

Session::Session(const Model& model, StatePools& pools, SessionOptions options, PrefixCache* cache)
    : model_(model), options_(options), state_(model.new_sequence(pools)), cache_(cache) {
  if (options_.chunk < 0) fail("chunk", "must be >= 0");
}

void Session::begin_prefill(const std::vector<int32_t>& tokens, const CacheEntry* handed,
                            std::shared_ptr<const PromptImages> images) {
  if (tokens.empty()) fail("prompt", "is empty");
  if (images && images->empty()) images.reset();
  if (images && images->spans().back().start + images->spans().back().length > static_cast<int64_t>(tokens.size())) {
    fail("images", "a span reaches past the prompt's end");
  }
  if (prefill_pending()) fail("prefill", "the previous prompt is still being prefilled");
  const int64_t n = static_cast<int64_t>(tokens.size()), origin = state_.length();
  pending_opt_ = {};
  pending_opt_.index_keys = options_.index_keys;
  pending_opt_.dspark_taps = static_cast<bool>(observer_);
  pending_opt_.prefill_length = origin + n;  // every chunk, and a restored prompt's rest, as one-shot
  if (options_.prefill_mode == PrefillMode::Tail) {
    // CED: the layers after the last KV source only need the prompt's last `window` rows
    pending_opt_.tail_start = std::max<int64_t>(origin, origin + n - model_.config().window_size);
  }
  hit_ = {};
  disk_bytes_ = 0;
  stored_tokens_ = 0;
  const bool caching = cache_ && origin == 0;
  // the prompt as the cache and the Engram history see it: image spans by their content
  const std::vector<int32_t> keys = images ? images->key_tokens(tokens) : tokens;
  handover_refusal_.clear();
  if (caching && handed != nullptr && images) {
    handover_refusal_ = "a prompt with images is prefilled here";  // a prefill server gets token ids only
  } else if (caching && handed != nullptr) {
    try {
      hit_ = cache_->restore_handed(tokens, *handed, state_, pending_opt_.tail_start, options_.cache_namespace);
    } catch (const Error& e) {
      handover_refusal_ = e.what();
    }
  }
  if (caching && hit_.cached_tokens == 0) hit_ = cache_->restore(keys, state_, pending_opt_.tail_start, images.get(), options_.cache_namespace);
  // With a cache, one call ends exactly at the last block boundary so the state there can be stored.
  // A tail-mode prompt's decoder windows hold only its last rows, so its state at a boundary is not
  // what an exact prefill leaves there: an exact-mode cache (which promises bit-identical restores)
  // does not take it; a replay-mode one keeps only the global rows, which tail mode computes exactly.
  const bool storable =
      caching && (options_.prefill_mode == PrefillMode::Exact || cache_->mode() == CacheMode::Replay);
  store_at_ = storable ? cache_->store_boundary(n) : -1;
  while (images && store_at_ > 0 && images->cut_at_or_before(store_at_) != store_at_) {
    store_at_ = cache_->store_boundary(images->cut_at_or_before(store_at_));  // a span is stored whole or not at all
  }
  // Where the prompt leaves blocks another prompt stored (a shared system prompt) and no snapshot
  // marks them: a chunk ends there too, and the state there is stored for the prompts to come.
  shared_stores_.clear();
  storable_ = storable;
  const int64_t fork = storable ? cache_->fork_boundary(keys, images.get(), options_.cache_namespace) : -1;
  if (fork > hit_.cached_tokens && fork < store_at_) shared_stores_.push_back(fork);
  if (hit_.source == CacheSource::Peer && store_at_ == hit_.cached_tokens) {
    // a prefill server's state is this server's to reuse: the next turn of the conversation finds
    // its history here instead of asking for it again
    disk_bytes_ = cache_->store({keys.begin(), keys.begin() + store_at_}, state_, options_.cache_namespace);
    stored_tokens_ = store_at_;
  }
  pending_ = tokens;
  pending_keys_ = keys;
  pending_images_ = std::move(images);
  pending_origin_ = origin;
  pending_done_ = state_.length() - origin;
  last_logits_.clear();
  history_.insert(history_.end(), keys.begin(), keys.end());
}

bool Session::store_also_at(int64_t boundary) {
  if (!storable_ || !prefill_pending() || boundary <= pending_done_ || boundary > store_at_) return false;
  if (boundary % kTokensPerPage != 0 || boundary < model_.config().window_size) return false;
  if (pending_images_ && pending_images_->cut_at_or_before(boundary) != boundary) return false;
  if (boundary != store_at_ && std::find(shared_stores_.begin(), shared_stores_.end(), boundary) == shared_stores_.end()) {
    shared_stores_.insert(std::upper_bound(shared_stores_.begin(), shared_stores_.end(), boundary), boundary);
  }
  return true;
}

int64_t Session::prefill_step(int64_t max_tokens) {
  if (!prefill_pending()) return 0;
  const int64_t n = plan_prefill(max_tokens);
  run_planned({this});
  return n;
}

int64_t Session::plan_prefill(int64_t max_tokens) {
  if (!prefill_pending()) fail("prefill", "no prompt is pending");
  if (planned_ != Planned::None && planned_ != Planned::Verified) fail("prefill", "another step is planned and not yet run");
  const int64_t n = static_cast<int64_t>(pending_.size()), done = pending_done_;
  int64_t end = std::min(n, done + std::max<int64_t>(max_tokens, 1));
  if (done < store_at_ && store_at_ < end) end = store_at_;
  for (const int64_t at : shared_stores_) {
    if (done < at && at < end) end = at;
  }
  planned_prefill_ = pending_opt_;
  if (pending_images_) {
    // a span is prefilled in one piece: the chunk stops before it, or takes all of it
    const int64_t before = pending_images_->cut_at_or_before(end);
    end = before > done ? before : pending_images_->cut_at_or_after(end);
    planned_prefill_.spans = pending_images_->slice(done, end);
  }
  planned_ = Planned::Prefill;
  planned_tokens_.assign(pending_.begin() + done, pending_.begin() + end);
  return end - done;
}

void Session::finish_prefill_chunk() {
  const int64_t done = pending_done_, end = done + static_cast<int64_t>(planned_tokens_.size());
  if (observer_) observer_(state_, result_, pending_origin_ + done, end - done);
  pending_done_ = end;
  if (end == static_cast<int64_t>(pending_.size())) last_logits_ = std::move(result_.logits);
  if (std::find(shared_stores_.begin(), shared_stores_.end(), end) != shared_stores_.end()) {
    disk_bytes_ += cache_->store({pending_keys_.begin(), pending_keys_.begin() + end}, state_, options_.cache_namespace);
  }
  if (end == store_at_ && store_at_ > hit_.cached_tokens) {
    disk_bytes_ += cache_->store({pending_keys_.begin(), pending_keys_.begin() + store_at_}, state_, options_.cache_namespace);
    stored_tokens_ = store_at_;
  }
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
  plan_decode(token);
  run_planned({this});
  return std::move(result_.logits);
}

std::vector<std::vector<float>> Session::decode_batch(const std::vector<Session*>& sessions,
                                                      const std::vector<int32_t>& tokens) {
  if (sessions.size() != tokens.size()) fail("decode_batch", "needs one token per session");
  for (size_t i = 0; i < sessions.size(); ++i) sessions[i]->plan_decode(tokens[i]);
  run_planned(sessions);
  std::vector<std::vector<float>> out;
  for (Session* s : sessions) out.push_back(std::move(s->result_.logits));
  return out;
}

void Session::plan_decode(int32_t token, Observe observe) {
  if (prefill_pending()) fail("decode", "the prompt is still being prefilled");
  if (planned_ == Planned::Verify) fail("decode", "a verification is planned and not yet run");
  planned_ = Planned::Decode;
  planned_tokens_ = {token};
  planned_observe_ = observe;
}

void Session::plan_verify(std::vector<int32_t> run) {
  if (prefill_pending()) fail("speculative", "the prompt is still being prefilled");
  if (planned_ == Planned::Verify) fail("speculative", "a verification is planned and not yet run");
  if (run.empty()) fail("speculative", "nothing to verify");
  observe_deferred();  // a drafter flushes before it drafts; this is for callers that do not draft
  checkpoint_ = VerifyCheckpoint(model_.config(), state_, static_cast<int64_t>(run.size()));
  planned_ = Planned::Verify;
  planned_observe_ = Observe::Now;
  planned_tokens_ = std::move(run);
}

void Session::run_planned(const std::vector<Session*>& sessions) {
  if (sessions.empty()) return;
  std::vector<ForwardCall> calls;
  for (Session* s : sessions) {
    if (s->planned_ != Planned::Decode && s->planned_ != Planned::Verify && s->planned_ != Planned::Prefill)
      fail("session", "nothing planned to run");
    if (&s->model_ != &sessions[0]->model_) fail("session", "sessions of different models cannot share a forward");
    if (s->planned_ == Planned::Prefill) {
      calls.push_back({&s->state_, s->planned_tokens_, s->planned_prefill_});
      continue;
    }
    ForwardOptions opt;
    opt.index_keys = s->options_.index_keys;
    opt.dspark_taps = s->observer_ && s->planned_observe_ != Observe::No;
    if (s->planned_ == Planned::Verify) {
      opt.all_logits = true;
      opt.record_compressor_rows = true;
    }
    calls.push_back({&s->state_, s->planned_tokens_, opt});
  }
  std::vector<ForwardResult> results;
  try {
    results = sessions[0]->model_.forward(calls);
  } catch (...) {
    // the forward may have advanced some states part way: nothing planned stays pending, and the
    // sessions are not to be run again (the caller fails their requests)
    for (Session* s : sessions) s->planned_ = Planned::None;
    throw;
  }
  // every session takes its result, even when an observer or a store fails for one of them; the
  // first failure is then thrown, as the forward's would be
  std::exception_ptr failed;
  for (size_t i = 0; i < sessions.size(); ++i) {
    Session& s = *sessions[i];
    s.result_ = std::move(results[i]);
    const Planned planned = s.planned_;
    s.planned_ = planned == Planned::Verify ? Planned::Verified : Planned::None;
    try {
      if (planned == Planned::Prefill) {
        s.finish_prefill_chunk();
      } else if (planned == Planned::Decode) {
        s.history_.push_back(s.planned_tokens_[0]);
        if (s.observer_) s.observe_step();
      }
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
}

void Session::observe_step() {
  const int64_t position = state_.length() - 1;
  if (planned_observe_ == Observe::Now) {
    observe_deferred();
    observer_(state_, result_, position, 1);
    return;
  }
  if (planned_observe_ == Observe::No) return;
  // Observe::Later: keep the step's taps row, and only a window's worth of the newest (the drafter's
  // rings hold no more); a row that does not follow the kept ones starts them anew
  const int64_t width = tap_width(), keep = model_.config().window_size;
  int64_t rows = static_cast<int64_t>(deferred_taps_.size()) / width;
  if (deferred_from_ + rows != position) {
    deferred_taps_.clear();
    deferred_from_ = position;
    rows = 0;
  }
  deferred_taps_.insert(deferred_taps_.end(), result_.dspark_taps.begin(), result_.dspark_taps.begin() + width);
  if (++rows > keep) {
    deferred_taps_.erase(deferred_taps_.begin(), deferred_taps_.begin() + (rows - keep) * width);
    deferred_from_ += rows - keep;
  }
}

int64_t Session::tap_width() const {
  return static_cast<int64_t>(model_.config().dspark_target_layer_ids.size()) * model_.config().dim;
}

void Session::observe_deferred() {
  if (deferred_taps_.empty() || !observer_) return;
  ForwardResult r;
  r.dspark_taps = std::move(deferred_taps_);
  r.rows = static_cast<int64_t>(r.dspark_taps.size()) / tap_width();
  deferred_taps_.clear();
  observer_(state_, r, deferred_from_, r.rows);
}

void Session::keep_verified(int64_t n) {
  if (planned_ != Planned::Verified) fail("speculative", "no verification has run");
  const int64_t first = checkpoint_.first();
  if (n < 1 || n > static_cast<int64_t>(planned_tokens_.size())) fail("speculative", "kept tokens outside the verified ones");
  history_.insert(history_.end(), planned_tokens_.begin(), planned_tokens_.begin() + n);
  checkpoint_.roll_back(state_, first + n, result_.compressor_kv, result_.compressor_score,
                        model_.engram_history(history_));
  if (observer_) observer_(state_, result_, first, n);
  planned_ = Planned::None;
}

}  // namespace dsv41
