// What a request's client reads of its tokens: the text they complete, held back while it could
// still be the start of a stop string and cut before the first stop string that appears; and each
// token's log-probabilities. The engine decides when a request ends; this says what its tokens read as.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "text/tokenizer.h"

namespace dsv41 {

class OutputText {
 public:
  OutputText(const Tokenizer& tokenizer, std::vector<std::string> stop);

  // Appends the token's text and returns what may go to the client now. Once a stop string appears,
  // stopped() is true, the text returned ends before it and nothing is held.
  std::string push(int32_t token);
  bool stopped() const { return !stop_string_.empty(); }
  const std::string& stop_string() const { return stop_string_; }  // the one that appeared, if any
  // The output ends without a stop string (an end-of-sentence token, max_tokens, a whole structured
  // value): the decoder's last bytes join the text held back, which held() then returns whole.
  void end() { held_ += decoder_.flush(); }
  const std::string& held() const { return held_; }

 private:
  StreamDecoder decoder_;
  std::vector<std::string> stop_;
  std::string held_;  // decoded, not yet sent: it may be the start of a stop string
  std::string stop_string_;
};

// The chosen token's log-probability under a logits row (temperature 1), and the `top` most likely
// tokens with theirs, most likely first.
struct TokenLogprobs {
  double logprob = 0;
  std::vector<std::pair<int32_t, double>> top;
};
TokenLogprobs token_logprobs(const float* logits, size_t vocab, int32_t token, int top);

}  // namespace dsv41
