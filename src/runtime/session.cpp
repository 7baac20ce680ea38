#include "runtime/session.h"

#include <algorithm>

#include "util/error.h"

namespace dsv41 {

Session::Session(const Model& model, StatePools& pools, SessionOptions options)
    : model_(model), options_(options), state_(model.new_sequence(pools)) {
  if (options_.chunk < 0) fail("chunk", "must be >= 0");
}

std::vector<float> Session::prefill(const std::vector<int32_t>& tokens,
                                    const std::function<void(int64_t, int64_t)>& progress) {
  if (tokens.empty()) fail("prompt", "is empty");
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t chunk = options_.chunk > 0 ? options_.chunk : kDefaultPrefillChunk;
  ForwardOptions opt;
  opt.index_keys = options_.index_keys;
  if (options_.prefill_mode == PrefillMode::Tail) {
    // CED: the layers after the last KV source only need the prompt's last `window` rows
    opt.tail_start = std::max<int64_t>(state_.length, state_.length + n - model_.config().window_size);
  }
  std::vector<float> logits;
  for (int64_t done = 0; done < n;) {
    const int64_t take = std::min(chunk, n - done);
    ForwardResult r = model_.forward(state_, {tokens.begin() + done, tokens.begin() + done + take}, opt);
    done += take;
    if (done == n) logits = std::move(r.logits);
    if (progress) progress(done, n);
  }
  return logits;
}

std::vector<float> Session::decode(int32_t token) {
  ForwardOptions opt;
  opt.index_keys = options_.index_keys;
  return model_.forward(state_, {token}, opt).logits;
}

}  // namespace dsv41
