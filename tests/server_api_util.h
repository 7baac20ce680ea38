// Helpers for tests of the request parsers and response builders: the tiny checkpoint's tokenizer
// and model info, made-up engine events, and an expectation on the ApiError a parser throws.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "runtime/engine.h"
#include "server/api_error.h"
#include "server/openai_api.h"
#include "test_util.h"
#include "text/chat_output.h"
#include "text/tokenizer.h"

namespace dsv41::server {

inline const Tokenizer& tiny_tokenizer() {
  static const Tokenizer tok = Tokenizer::from_file(test::tiny_model_dir() + "/tokenizer.json");
  return tok;
}

inline ModelInfo tiny_info() {
  ModelInfo m;
  m.name = "tiny";
  m.context_length = 4096;
  m.bos_id = 0;
  m.tokenizer = &tiny_tokenizer();
  return m;
}

// Expects `f` to throw ApiError with this status and param (and code, when given); returns it.
template <typename F>
ApiError expect_error(F f, int status, const std::string& param, const std::string& code = "") {
  try {
    f();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, status) << e.message;
    EXPECT_EQ(e.param, param) << e.message;
    if (!code.empty()) {
      EXPECT_EQ(e.code, code) << e.message;
    }
    EXPECT_FALSE(e.message.empty());
    return e;
  }
  ADD_FAILURE() << "no ApiError (expected status " << status << " about '" << param << "')";
  return {};
}

inline TokenEvent token_event(int32_t token, std::string text, double logprob = -0.5) {
  TokenEvent e;
  e.token = token;
  e.text = std::move(text);
  e.logprob = logprob;
  return e;
}

inline TokenEvent done_event(FinishReason reason, int64_t prompt, int64_t completion, int64_t cached) {
  TokenEvent e;
  e.done = true;
  e.finish_reason = reason;
  e.prompt_tokens = prompt;
  e.completion_tokens = completion;
  e.cached_tokens = cached;
  return e;
}

inline ChatOutputOptions fixed_ids() {
  ChatOutputOptions o;
  o.make_call_id = [](size_t i) { return "call_" + std::to_string(i); };
  return o;
}

}  // namespace dsv41::server
