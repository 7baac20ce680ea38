// The engine's per-request sequence options: DSpark speculation inside continuous batching (verified
// in the same forward as plain sequences' decodes, greedy output and logits identical to plain
// decoding, counters, the acceptance guard), tail-mode prefill, reference index keys and
// prefill-only requests.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <random>

#include "model/dspark.h"
#include "runtime/engine.h"
#include "runtime/session.h"
#include "engine_util.h"
#include "test_util.h"
#include "util/error.h"

namespace dsv41 {
namespace {

RequestParams greedy(int prompt_len, uint32_t seed, int max_tokens) {
  RequestParams p;
  p.prompt = ids(prompt_len, seed);
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  p.return_logits = true;
  p.speculative = SpeculativeMethod::Off;
  return p;
}

EngineOptions tiny_engine() {
  EngineOptions opt;
  opt.model_dir = test::tiny_model_dir();
  opt.parallel = 4;
  return opt;
}

// Drafts that are the true continuation (`truth`, the plain run's tokens after `prompt_len`
// prompt tokens), or wrong everywhere.
std::function<std::vector<int32_t>(int64_t, const std::vector<int32_t>&)> oracle(std::vector<int32_t> truth,
                                                                                int64_t prompt_len, bool wrong) {
  return [truth, prompt_len, wrong](int64_t pos, const std::vector<int32_t>& drafted) {
    std::vector<int32_t> d;
    for (int64_t i = pos - prompt_len + 1; i < static_cast<int64_t>(truth.size()) && d.size() < drafted.size(); ++i) {
      d.push_back(wrong ? (truth[static_cast<size_t>(i)] + 1) % 1000 : truth[static_cast<size_t>(i)]);
    }
    return d;
  };
}

// Four sequences in one engine, two speculating (oracle drafts, accepted in full; the drafter's own,
// adaptive length) and two plain (one with a fixed draft length that it does not use): every one
// gets the tokens and the logits rows of plain decoding alone, the speculating ones in fewer
// verifications than tokens, and the decode steps are shared: fewer batched forwards than the
// sequences' steps added up.
TEST(EngineSpeculative, SpeculatingAndPlainSequencesShareForwardsWithGreedyEquality) {
  const int n = 24;
  std::vector<RequestParams> reqs;
  for (uint32_t i = 0; i < 4; ++i) reqs.push_back(greedy(20 + 29 * static_cast<int>(i), i + 1, n));
  std::vector<Collected> alone(4);
  {
    Engine e(tiny_engine());
    for (size_t i = 0; i < 4; ++i) {
      e.submit(reqs[i], collect(alone[i]));
      wait(alone[i]);
      ASSERT_EQ(alone[i].tokens.size(), static_cast<size_t>(n));
    }
    EXPECT_EQ(e.metrics().spec_verify_steps, 0u);
  }
  reqs[0].speculative = SpeculativeMethod::DSpark;
  reqs[0].force_drafts = oracle(alone[0].tokens, static_cast<int64_t>(reqs[0].prompt.size()), false);
  reqs[1].speculative = SpeculativeMethod::DSpark;  // the drafter's own drafts, adaptive length
  reqs[3].draft_length = 3;                         // plain: a draft length alone changes nothing
  Engine e(tiny_engine());
  std::vector<Collected> got(4);
  for (size_t i = 0; i < 4; ++i) e.submit(reqs[i], collect(got[i]));
  int64_t steps = 0;
  for (size_t i = 0; i < 4; ++i) {
    wait(got[i]);
    EXPECT_EQ(got[i].tokens, alone[i].tokens) << "request " << i;
    EXPECT_EQ(got[i].rows, alone[i].rows) << "request " << i;
    const RequestReport& rep = got[i].last.report;
    steps += reqs[i].speculative == SpeculativeMethod::DSpark ? rep.verify_steps + rep.plain_steps : n - 1;
    if (i >= 2) {
      EXPECT_EQ(rep.verify_steps, 0) << i;
    }
  }
  const RequestReport& full = got[0].last.report;
  EXPECT_GT(full.verify_steps, 0);
  EXPECT_EQ(full.drafts_accepted, full.drafts_proposed);  // oracle drafts: every one accepted
  EXPECT_LT(full.verify_steps + full.plain_steps, n - 1);  // more than one token per forward
  EXPECT_GT(got[1].last.report.verify_steps, 0);
  const EngineMetrics m = e.metrics();
  EXPECT_EQ(m.spec_verify_steps, static_cast<uint64_t>(full.verify_steps + got[1].last.report.verify_steps));
  EXPECT_EQ(m.spec_draft_tokens, static_cast<uint64_t>(full.drafts_proposed + got[1].last.report.drafts_proposed));
  EXPECT_EQ(m.spec_accepted_tokens, static_cast<uint64_t>(full.drafts_accepted + got[1].last.report.drafts_accepted));
  uint64_t per_position = 0;
  for (uint64_t v : m.spec_accepted_per_position) per_position += v;
  EXPECT_EQ(per_position, m.spec_accepted_tokens);
  EXPECT_LT(m.decode_forwards_total, static_cast<uint64_t>(steps)) << "decode steps were not batched";
}

// Drafts that are always wrong: every verification yields one token and costs more than a plain step,
// so the acceptance guard, after its first window and a short probe of plain steps, stops drafting for
// a pause and, failing again, for a longer one; most steps carry no drafts. The output is still plain
// decoding's. (Schedule: 2 verifications, 2 probe steps that end in the decision, 32 plain steps,
// 2 verifications, 64 plain steps cut short by the end: 4 verifications of 59 steps.)
TEST(EngineSpeculative, TheAcceptanceGuardStopsDraftsThatNeverPay) {
  const int n = 60;
  RequestParams p = greedy(30, 9, n);
  Collected plain;
  Engine e(tiny_engine());
  e.submit(p, collect(plain));
  wait(plain);
  p.speculative = SpeculativeMethod::DSpark;
  p.draft_length = 4;
  p.force_drafts = oracle(plain.tokens, 30, true);
  Collected spec;
  e.submit(p, collect(spec));
  wait(spec);
  EXPECT_EQ(spec.tokens, plain.tokens);
  EXPECT_EQ(spec.rows, plain.rows);
  const RequestReport& rep = spec.last.report;
  EXPECT_EQ(rep.drafts_accepted, 0);
  EXPECT_EQ(rep.guard_pauses, 2);
  EXPECT_EQ(rep.verify_steps, 4);
  EXPECT_EQ(rep.verify_steps + rep.plain_steps, n - 1);
  EXPECT_EQ(e.metrics().spec_guard_pauses, 2u);
}

// The random tiny model's drafter never pays (docs/speculative.md), so after one speculating sequence
// has paused for it, the next starts paused where that one ended and, shorter than the pause, never
// verifies; a request with the guard off still drafts at every step. Outputs stay plain decoding's.
TEST(EngineSpeculative, ANewSequenceStartsFromThePauseTheLastOneLearned) {
  Engine e(tiny_engine());
  RequestParams p = greedy(30, 11, 60);
  Collected plain;
  e.submit(p, collect(plain));
  wait(plain);
  p.speculative = SpeculativeMethod::DSpark;
  Collected first;
  e.submit(p, collect(first));
  wait(first);
  EXPECT_EQ(first.tokens, plain.tokens);
  ASSERT_GE(first.last.report.guard_pauses, 1) << "the drafter paid on the random model";
  EXPECT_GT(first.last.report.verify_steps, 0);

  p.max_tokens = 25;  // shorter than any pause the first can have ended with (32 or more)
  Collected plain_short, next;
  RequestParams q = p;
  q.speculative = SpeculativeMethod::Off;
  e.submit(q, collect(plain_short));
  wait(plain_short);
  e.submit(p, collect(next));
  wait(next);
  EXPECT_EQ(next.tokens, plain_short.tokens);
  EXPECT_EQ(next.last.report.verify_steps, 0);
  EXPECT_EQ(next.last.report.plain_steps, 24);

  p.acceptance_guard = false;
  Collected unguarded;
  e.submit(p, collect(unguarded));
  wait(unguarded);
  EXPECT_EQ(unguarded.tokens, plain_short.tokens);
  EXPECT_LE(unguarded.last.report.plain_steps, 1);  // the last token's step, which nothing follows
  EXPECT_GT(unguarded.last.report.verify_steps, 0);
}

// Tail-mode prefill and reference index keys per request: each request gets what a session with the
// same options gives, while other requests in the engine run with the defaults. The exact request
// shares the tail one's prompt: it must not be handed the tail prefill's state from the cache (whose
// decoder windows hold only the prompt's last rows).
TEST(EngineSpeculative, PrefillModeAndIndexKeysArePerRequest) {
  const Model& m = test::tiny_model();
  const int n = 12;
  auto session_run = [&](const std::vector<int32_t>& prompt, SessionOptions so) {
    Session s(m, test::pools_for(m), so);
    std::vector<int32_t> out;
    std::vector<float> logits = s.prefill(prompt);
    for (int i = 0; i < n; ++i) {
      const int32_t t = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      out.push_back(t);
      if (i + 1 < n) logits = s.decode(t);
    }
    return out;
  };
  RequestParams tail = greedy(200, 5, n), keys = greedy(150, 6, n), exact = greedy(200, 5, n);
  tail.prefill_mode = PrefillMode::Tail;
  keys.index_keys = IndexKeysMode::Reference;
  SessionOptions tail_so, keys_so;
  tail_so.prefill_mode = PrefillMode::Tail;
  keys_so.index_keys = IndexKeysMode::Reference;
  Engine e(tiny_engine());
  Collected a, b, c;
  e.submit(tail, collect(a));
  e.submit(keys, collect(b));
  e.submit(exact, collect(c));
  wait(a);
  wait(b);
  wait(c);
  EXPECT_EQ(a.tokens, session_run(tail.prompt, tail_so));
  EXPECT_EQ(b.tokens, session_run(keys.prompt, keys_so));
  EXPECT_EQ(c.tokens, session_run(exact.prompt, {}));
  EXPECT_NE(a.rows, c.rows);  // a 200-token prompt is past the window: tail mode is its own numerics
}

// max_tokens 0 runs the prompt only: no token, finish "length", and its state stored in the prefix
// cache, where the next request with that prompt finds it.
TEST(EngineSpeculative, APrefillOnlyRequestWarmsTheCache) {
  Engine e(tiny_engine());
  RequestParams p = greedy(150, 7, 0);
  Collected warm;
  e.submit(p, collect(warm));
  wait(warm);
  EXPECT_TRUE(warm.tokens.empty());
  EXPECT_EQ(warm.last.finish_reason, FinishReason::Length);
  EXPECT_EQ(warm.last.completion_tokens, 0);
  p.max_tokens = 4;
  Collected hit;
  e.submit(p, collect(hit));
  wait(hit);
  EXPECT_EQ(hit.tokens.size(), 4u);
  EXPECT_EQ(hit.last.cached_tokens, 128);
}

TEST(EngineSpeculative, BadSequenceOptionsAreRefusedAtSubmit) {
  Engine e(tiny_engine());
  const int block = e.draft_block_size();
  ASSERT_GT(block, 0);
  RequestParams p = greedy(10, 1, 4);
  p.speculative = SpeculativeMethod::DSpark;
  p.draft_length = block + 1;
  EXPECT_THROW(e.submit(p, [](const TokenEvent&) {}), Error);
  p.draft_length = -2;
  EXPECT_THROW(e.submit(p, [](const TokenEvent&) {}), Error);
  p.draft_length = 0;
  p.max_tokens = -1;
  EXPECT_THROW(e.submit(p, [](const TokenEvent&) {}), Error);
  EngineOptions bad = tiny_engine();
  bad.draft_length = block + 1;
  EXPECT_THROW(Engine{bad}, Error);
}

}  // namespace
}  // namespace dsv41
