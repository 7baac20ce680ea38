#include "runtime/session.h"

#include <algorithm>

#include "util/error.h"

namespace dsv41 {

Session::Session(const Model& model, StatePools& pools, SessionOptions options, PrefixCache* cache)
    : model_(model), options_(options), state_(model.new_sequence(pools)), cache_(cache) {
  if (options_.chunk < 0) fail("chunk", "must be >= 0");
}

std::vector<float> Session::prefill(const std::vector<int32_t>& tokens,
                                    const std::function<void(int64_t, int64_t)>& progress) {
  if (tokens.empty()) fail("prompt", "is empty");
  const int64_t n = static_cast<int64_t>(tokens.size()), origin = state_.length;
  const int64_t chunk = options_.chunk > 0 ? options_.chunk : kDefaultPrefillChunk;
  ForwardOptions opt;
  opt.index_keys = options_.index_keys;
  if (options_.prefill_mode == PrefillMode::Tail) {
    // CED: the layers after the last KV source only need the prompt's last `window` rows
    opt.tail_start = std::max<int64_t>(origin, origin + n - model_.config().window_size);
  }
  hit_ = {};
  disk_bytes_ = 0;
  stored_tokens_ = 0;
  const bool caching = cache_ && origin == 0;
  int64_t done = 0;
  if (caching) {
    hit_ = cache_->restore(tokens, state_, opt.tail_start);
    done = state_.length;
  }
  history_.insert(history_.end(), tokens.begin(), tokens.end());
  // With a cache, one call ends exactly at the last block boundary so the state there can be stored.
  const int64_t store_at = caching ? PrefixCache::usable_boundary(n) : -1;
  std::vector<float> logits;
  while (done < n) {
    int64_t end = std::min(n, done + chunk);
    if (done < store_at && store_at < end) end = store_at;
    ForwardResult r = model_.forward(state_, {tokens.begin() + done, tokens.begin() + end}, opt);
    if (observer_) observer_(state_, r, origin + done, end - done);
    done = end;
    if (done == n) logits = std::move(r.logits);
    if (done == store_at && store_at > hit_.cached_tokens) {
      disk_bytes_ = cache_->store({tokens.begin(), tokens.begin() + store_at}, state_);
      stored_tokens_ = store_at;
    }
    if (progress) progress(done, n);
  }
  return logits;
}

std::vector<float> Session::decode(int32_t token) {
  ForwardOptions opt;
  opt.index_keys = options_.index_keys;
  ForwardResult r = model_.forward(state_, {token}, opt);
  history_.push_back(token);
  if (observer_) observer_(state_, r, state_.length - 1, 1);
  return std::move(r.logits);
}

}  // namespace dsv41
