#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>

#include "util/error.h"

namespace dsv41 {

int32_t argmax(const float* logits, int64_t vocab) {
  return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
}

Sampler::Sampler(const SamplingParams& p) : params_(p) {
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature)) fail("temperature", "must be a finite number >= 0");
  if (!(p.top_p > 0 && p.top_p <= 1)) fail("top_p", "must be in (0, 1]");
  if (p.top_k < 0) fail("top_k", "must be >= 0 (0: no limit)");
  uint64_t seed = p.seed;
  for (auto& s : state_) {  // splitmix64 seeding of xoshiro256**
    seed += 0x9E3779B97F4A7C15ull;
    uint64_t z = seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    s = z ^ (z >> 31);
  }
}

double Sampler::uniform() {
  auto rotl = [](uint64_t x, int k) { return (x << k) | (x >> (64 - k)); };
  const uint64_t result = rotl(state_[1] * 5, 7) * 9, t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = rotl(state_[3], 45);
  return static_cast<double>(result >> 11) * 0x1.0p-53;
}

std::vector<double> Sampler::distribution(const float* logits, int64_t vocab) {
  std::vector<double> p(static_cast<size_t>(vocab), 0.0);
  if (params_.temperature == 0) {
    p[static_cast<size_t>(argmax(logits, vocab))] = 1.0;
    return p;
  }
  sample_prepare(logits, vocab);
  double kept = 0;
  for (int64_t i = 0; i < keep_; ++i) kept += probs_[i];
  for (int64_t i = 0; i < keep_; ++i) p[static_cast<size_t>(order_[i])] = probs_[i] / kept;
  return p;
}

int32_t Sampler::draw(const std::vector<double>& w) {
  double total = 0;
  for (double x : w) total += x;
  double u = uniform() * total;
  int32_t last = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    if (w[i] <= 0) continue;
    last = static_cast<int32_t>(i);
    u -= w[i];
    if (u < 0) return last;
  }
  return last;
}

void Sampler::sample_prepare(const float* logits, int64_t vocab) {
  // probabilities in double, most likely first
  logit_order_.sort(logits, vocab, order_);  // largest first, equal logits by ascending id
  probs_.resize(static_cast<size_t>(vocab));
  const double mx = logits[order_[0]];
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += probs_[i] = std::exp((logits[order_[i]] - mx) / params_.temperature);
  // top-k first, then the nucleus within it (vLLM's and Hugging Face's order): the shortest prefix
  // whose share of the kept mass reaches top_p
  keep_ = params_.top_k > 0 ? std::min(vocab, params_.top_k) : vocab;
  if (keep_ < vocab) {
    sum = 0;
    for (int64_t i = 0; i < keep_; ++i) sum += probs_[i];
  }
  if (params_.top_p < 1) {
    double cum = 0;
    for (int64_t i = 0; i < keep_; ++i) {
      cum += probs_[i] / sum;
      if (cum >= params_.top_p) {
        keep_ = i + 1;
        break;
      }
    }
  }
}

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  if (params_.temperature == 0) return argmax(logits, vocab);
  sample_prepare(logits, vocab);
  const int64_t keep = keep_;
  double kept = 0;
  for (int64_t i = 0; i < keep; ++i) kept += probs_[i];
  double u = uniform() * kept;
  for (int64_t i = 0; i < keep; ++i) {
    u -= probs_[i];
    if (u < 0) return order_[i];
  }
  return order_[keep - 1];
}

}  // namespace dsv41
