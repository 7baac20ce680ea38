#include "runtime/output_text.h"

#include <algorithm>
#include <cmath>

namespace dsv41 {

OutputText::OutputText(const Tokenizer& tokenizer, std::vector<std::string> stop)
    : decoder_(tokenizer), stop_(std::move(stop)) {}

std::string OutputText::push(int32_t token) {
  held_ += decoder_.push(token);
  // end before the first stop string; hold back a tail that could still start one
  size_t cut = std::string::npos, keep = 0;
  for (const std::string& s : stop_) {
    if (s.empty()) continue;
    if (const size_t at = held_.find(s); at < cut) {  // the earliest; of two starting there, the first listed
      cut = at;
      stop_string_ = s;
    }
    for (size_t l = std::min(s.size() - 1, held_.size()); l > keep; --l) {
      if (held_.compare(held_.size() - l, l, s, 0, l) == 0) {
        keep = l;
        break;
      }
    }
  }
  std::string out;
  if (cut != std::string::npos) {
    out = held_.substr(0, cut);
    held_.clear();
    return out;
  }
  out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

TokenLogprobs token_logprobs(const float* logits, size_t vocab, int32_t token, int top) {
  // log-softmax in double
  double mx = *std::max_element(logits, logits + vocab), z = 0;
  for (size_t i = 0; i < vocab; ++i) z += std::exp(static_cast<double>(logits[i]) - mx);
  const double lz = mx + std::log(z);
  std::vector<double> lp(vocab);
  for (size_t i = 0; i < vocab; ++i) lp[i] = logits[i] - lz;
  TokenLogprobs out;
  out.logprob = lp[static_cast<size_t>(token)];
  std::vector<int32_t> order(vocab);
  for (size_t i = 0; i < vocab; ++i) order[i] = static_cast<int32_t>(i);
  const size_t k = std::min(vocab, static_cast<size_t>(std::max(top, 0)));
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    [&](int32_t a, int32_t b) { return lp[static_cast<size_t>(a)] > lp[static_cast<size_t>(b)]; });
  for (size_t i = 0; i < k; ++i) out.top.push_back({order[i], lp[static_cast<size_t>(order[i])]});
  return out;
}

}  // namespace dsv41
