// Speculative decoding with DSpark: greedy output identical to plain decoding, forced drafts that are
// accepted in full, in part or not at all, rollback leaving every state class as if the rejected tokens
// had never run, and sampling that keeps the target's distribution.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "model/dspark.h"
#include "runtime/speculative.h"
#include "test_util.h"
#include "util/error.h"

namespace dsv41 {
namespace {

const Model& tiny() { return test::tiny_model(); }

std::vector<int32_t> ids(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<int32_t>(rng() % 1000);
  return v;
}

struct Decoded {
  std::vector<int32_t> tokens;
  std::vector<float> rows;
  SpeculativeStats stats;
};

// Plain greedy decoding: n tokens after the prompt, and each token's logits row.
Decoded plain(const std::vector<int32_t>& prompt, int n, SamplingParams sp = {}) {
  const Model& m = tiny();
  Session s(m, test::pools_for(m), {});
  Sampler sampler(sp);
  Decoded out;
  std::vector<float> logits = s.prefill(prompt);
  for (int i = 0; i < n; ++i) {
    const int32_t t = sampler.sample(logits.data(), m.config().vocab_size);
    out.tokens.push_back(t);
    out.rows.insert(out.rows.end(), logits.begin(), logits.end());
    if (i + 1 < n) logits = s.decode(t);
  }
  return out;
}

// The same with speculation; `check` runs after every step with the session.
Decoded speculative(const std::vector<int32_t>& prompt, int n, SpeculativeOptions opt, SamplingParams sp = {},
                const std::function<void(Session&)>& check = {}) {
  const Model& m = tiny();
  Drafter drafter(m);
  Session s(m, test::pools_for(m), {});
  attach_drafter(s, drafter);
  Sampler sampler(sp);
  SpeculativeDecoder spec(s, drafter, sampler, opt);
  Decoded out;
  std::vector<float> logits = s.prefill(prompt);
  int32_t t = sampler.sample(logits.data(), m.config().vocab_size);
  out.tokens.push_back(t);
  out.rows = logits;
  while (static_cast<int>(out.tokens.size()) < n) {
    SpeculativeDecoder::Step st = spec.step(t);
    if (check) check(s);
    for (size_t i = 0; i < st.tokens.size() && static_cast<int>(out.tokens.size()) < n; ++i) {
      out.tokens.push_back(st.tokens[i]);
      out.rows.insert(out.rows.end(), st.rows.begin() + static_cast<long>(i) * m.config().vocab_size,
                      st.rows.begin() + static_cast<long>(i + 1) * m.config().vocab_size);
      t = st.tokens[i];
    }
  }
  out.stats = spec.stats();
  return out;
}

TEST(Speculative, GreedyMatchesPlainDecodingOnManyPrompts) {
  for (uint32_t seed = 0; seed < (test::kSanitized ? 2u : 6u); ++seed) {
    const std::vector<int32_t> prompt = ids(5 + static_cast<int>(seed) * 13, seed);
    Decoded a = plain(prompt, 30);
    for (int length : {0, 2, 4}) {  // adaptive and fixed draft lengths
      SpeculativeOptions opt;
      opt.fixed_length = length;
      Decoded b = speculative(prompt, 30, opt);
      EXPECT_EQ(a.tokens, b.tokens) << "seed " << seed << " length " << length;
      EXPECT_EQ(a.rows, b.rows) << "seed " << seed << " length " << length;
    }
  }
}

// Drafts forced to the target's own greedy continuation: everything is accepted, so each step emits
// block_size + 1 tokens for one target forward.
TEST(Speculative, PerfectDraftsAreAcceptedInFull) {
  const std::vector<int32_t> prompt = ids(37, 11);
  Decoded truth = plain(prompt, 60);
  const int64_t start = static_cast<int64_t>(prompt.size());
  SpeculativeOptions opt;
  opt.force_drafts = [&](int64_t pos, const std::vector<int32_t>&) {
    std::vector<int32_t> d;
    for (int64_t i = pos - start + 1; i < static_cast<int64_t>(truth.tokens.size()) && d.size() < 4; ++i) d.push_back(truth.tokens[i]);
    return d;
  };
  Decoded b = speculative(prompt, 60, opt);
  EXPECT_EQ(b.tokens, truth.tokens);
  EXPECT_EQ(b.rows, truth.rows);
  EXPECT_EQ(b.stats.accepted, b.stats.proposed);
  EXPECT_NEAR(b.stats.mean_accept_len(), 5.0, 0.5);
  EXPECT_LT(b.stats.target_forwards, 15);
}

// Every state class the verify forward touched (every layer's ring, the drafter's included), compared
// with a plain run at the same length.
void expect_same_state(const SequenceState& a, const SequenceState& b, const std::string& where) {
  EXPECT_EQ(first_difference(a, b), "") << where;
}

// Drafts right up to position k and wrong from there, for every k: exactly k accepted per step, the
// output unchanged, and after every rollback the state equals a plain run's. The prompt lengths make
// the verify windows start on both sides of ratio-2 pairs and of 4-row candidate blocks.
TEST(Speculative, RollbackAtEveryPositionRestoresEveryStateClass) {
  const Model& m = tiny();
  for (int prompt_len : test::kSanitized ? std::vector<int>{38} : std::vector<int>{37, 38, 64}) {
    const std::vector<int32_t> prompt = ids(prompt_len, 21);
    Decoded truth = plain(prompt, 40);
    const int64_t start = prompt_len;
    for (int k = 0; k < 4; ++k) {
      SpeculativeOptions opt;
      opt.guard.enabled = false;  // k = 0 never pays: the guard would stop the verifications counted here
      opt.force_drafts = [&](int64_t pos, const std::vector<int32_t>&) {
        std::vector<int32_t> d;
        for (int64_t i = pos - start + 1; i < static_cast<int64_t>(truth.tokens.size()) && d.size() < 4; ++i) {
          d.push_back(truth.tokens[i]);
        }
        if (static_cast<int>(d.size()) > k) d[k] = (d[k] + 1) % 1000;  // wrong from position k on
        return d;
      };
      auto check = [&](Session& s) {
        // a plain session run over exactly the tokens the speculative one kept
        Drafter drafter(m);
        Session ref(m, test::pools_for(m), {});
        attach_drafter(ref, drafter);
        const std::vector<int32_t>& h = s.history();
        ref.prefill(prompt);
        for (size_t i = prompt.size(); i < h.size(); ++i) ref.decode(h[i]);
        expect_same_state(s.state(), ref.state(), "prompt " + std::to_string(prompt_len) + ", wrong at " + std::to_string(k));
      };
      Decoded b = speculative(prompt, 40, opt, {}, k == 1 || prompt_len == 37 ? check : std::function<void(Session&)>{});
      EXPECT_EQ(b.tokens, truth.tokens) << prompt_len << " " << k;
      EXPECT_EQ(b.rows, truth.rows) << prompt_len << " " << k;
      // Every step accepts exactly the k right drafts and adds the target's own token, so the 39
      // tokens after the prefill's take ceil(39 / (k + 1)) steps of one verify forward each; the
      // forced drafts run out near the end of `truth` (never below k of them).
      const int64_t steps = (39 + k) / (k + 1);
      int64_t proposed = 0;
      for (int64_t st = 0; st < steps; ++st) proposed += std::min<int64_t>(4, 39 - st * (k + 1));
      EXPECT_EQ(b.stats.steps, steps) << prompt_len << " " << k;
      EXPECT_EQ(b.stats.target_forwards, steps) << prompt_len << " " << k;
      EXPECT_EQ(b.stats.proposed, proposed) << prompt_len << " " << k;
      EXPECT_EQ(b.stats.accepted, k * steps) << prompt_len << " " << k;
      EXPECT_EQ(b.stats.emitted, (k + 1) * steps) << prompt_len << " " << k;
      ASSERT_EQ(b.stats.accepted_per_position.size(), 4u);
      for (int j = 0; j < 4; ++j) {
        EXPECT_EQ(b.stats.accepted_per_position[j], j < k ? steps : 0) << prompt_len << " " << k << " position " << j;
      }
    }
  }
}

// A guard pause longer than the window leaves the drafter out of its first steps (no taps, no ring
// writes) and lets it observe only the last window of them: when drafting resumes, its drafts are
// exactly those of a drafter that observed every step, and the output is plain decoding's.
TEST(Speculative, APauseLongerThanTheWindowResumesWithTheWholeWindow) {
  const Model& m = tiny();
  const int64_t W = m.config().window_size;
  const std::vector<int32_t> prompt = ids(30, 8);
  const int n = 90;
  Decoded truth = plain(prompt, n);
  const int64_t start = static_cast<int64_t>(prompt.size());
  SpeculativeOptions opt;
  opt.fixed_length = 4;
  opt.guard.window = 2;
  opt.guard.probe_steps = 1;
  opt.guard.pause_steps = static_cast<int>(W) + 24;
  opt.guard.max_pause_steps = opt.guard.pause_steps;
  // a verification costs twice a plain step whatever the machine is doing, so a window of wrong
  // drafts always pauses (measured times made the pause's start depend on the load)
  opt.step_seconds = [](bool verification, double) { return verification ? 2.0 : 1.0; };
  std::vector<std::pair<int64_t, std::vector<int32_t>>> calls;
  opt.force_drafts = [&](int64_t pos, const std::vector<int32_t>& drafted) {
    calls.push_back({pos, drafted});
    if (pos >= start + 10) return drafted;  // the drafter's own from here on
    std::vector<int32_t> wrong;             // before: never accepted, so the guard pauses
    for (size_t i = 0; i < 4; ++i) wrong.push_back((truth.tokens[static_cast<size_t>(pos - start) + 1 + i] + 1) % 1000);
    return wrong;
  };
  Decoded b = speculative(prompt, n, opt);
  EXPECT_EQ(b.tokens, truth.tokens);
  EXPECT_EQ(b.rows, truth.rows);
  EXPECT_GE(b.stats.guard_pauses, 1);  // the drafter's own (random) drafts fail later too
  ASSERT_GE(calls.size(), 4u);
  // calls 0-2 were before the pause; call 3 is the first draft after it
  const auto& [pos, drafted] = calls[3];
  EXPECT_GE(pos, start + 3 + static_cast<int64_t>(opt.guard.pause_steps));
  Drafter drafter(m);
  Session ref(m, test::pools_for(m), {});
  attach_drafter(ref, drafter);
  ref.prefill(prompt);
  for (int64_t p = start; p < pos; ++p) ref.decode(truth.tokens[static_cast<size_t>(p - start)]);
  Sampler greedy(SamplingParams{});
  const Draft d = drafter.draft(ref.state(), truth.tokens[static_cast<size_t>(pos - start)], greedy);
  EXPECT_EQ(drafted, std::vector<int32_t>(d.tokens.begin(), d.tokens.begin() + 4));
}

// The acceptance rule keeps the target's distribution: over many draws with the drafter's and the
// target's real distributions from the tiny model (restricted to a slice of 8 tokens), the first
// emitted token follows the target. Chi-square with 7 degrees of freedom at a false-alarm rate of
// 0.1%: critical value 24.32.
TEST(Speculative, RejectionSamplingPreservesTheTargetDistribution) {
  const Model& m = tiny();
  const int64_t V = m.config().vocab_size;
  Session s(m, test::pools_for(m), {});
  Drafter drafter(m);
  attach_drafter(s, drafter);
  std::vector<float> logits = s.prefill(ids(40, 31));
  Sampler greedy(SamplingParams{});
  Draft d = drafter.draft(s.state(), 5, greedy);
  // the slice: the target's 8 most likely tokens; both distributions renormalised on it
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + 8, order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  auto restrict = [&](const float* l) {
    std::vector<double> p(8);
    double z = 0;
    for (int i = 0; i < 8; ++i) z += p[i] = std::exp(static_cast<double>(l[order[i]] - l[order[0]]));
    for (double& x : p) x /= z;
    return p;
  };
  const std::vector<double> target = restrict(logits.data()), draft = restrict(d.logits.data());
  double tv = 0;
  for (int i = 0; i < 8; ++i) tv += std::fabs(target[i] - draft[i]) / 2;
  ASSERT_GT(tv, 0.05);  // the two really differ, so acceptance and resampling both happen
  const int trials = 40000;
  std::vector<int> count(8, 0);
  Sampler rng(SamplingParams{1.0, 1.0, 77});
  int accepted = 0;
  for (int t = 0; t < trials; ++t) {
    const int32_t y = rng.draw(draft);
    int32_t next = 0;
    const int a = accept_drafts({target, target}, {draft}, {y}, rng, next);
    accepted += a;
    ++count[a == 1 ? y : next];
  }
  double chi2 = 0;
  for (int i = 0; i < 8; ++i) {
    const double e = target[i] * trials;
    chi2 += (count[i] - e) * (count[i] - e) / e;
  }
  std::printf("[spec] chi-square %.2f (7 dof), acceptance rate %.3f, total variation %.3f\n", chi2,
              static_cast<double>(accepted) / trials, tv);
  EXPECT_LT(chi2, 24.32);
  EXPECT_NEAR(static_cast<double>(accepted) / trials, 1 - tv, 0.02);  // the acceptance rate is 1 − TV
}

// With sampling on, speculation changes which random numbers are drawn but not what is sampled from,
// so the tokens differ from plain sampling's (the statistics are RejectionSampling...'s). What must
// hold for a sampled run: it stops where told, each emitted row is exactly the target's row for the
// tokens kept before it (a plain session teacher-forced with them gives the same rows bit for bit, so
// no rejected draft leaked into the state), each token lies in its row's top-p nucleus, and the same
// seed gives the same tokens. Two kinds of drafts: the drafter's own samples at temperature 0.8 (a
// random tiny drafter against a flat target: nearly all rejected), and the target's own greedy
// continuation of the kept tokens at temperature 0.1, which the target often but not always samples,
// so steps accept some drafts and reject others.
TEST(Speculative, SamplingRunsWithForcedDrafts) {
  const Model& m = tiny();
  const int64_t V = m.config().vocab_size;
  const std::vector<int32_t> prompt = ids(20, 41);
  struct Case {
    const char* name;
    SamplingParams sp;
    bool greedy_drafts;
  };
  for (const Case& c : {Case{"drafter's drafts", {0.8, 0.95, 5}, false}, Case{"greedy drafts", {0.1, 0.95, 5}, true}}) {
    const auto run = [&] {
      Drafter drafter(m);
      Session s(m, test::pools_for(m), {});
      attach_drafter(s, drafter);
      Sampler sampler(c.sp);
      int32_t next = 0;
      SpeculativeOptions opt;
      // Every step verifies: the guard decides by timing, and at temperature > 0 which steps verify
      // changes what the seeded stream draws, so two runs agree only when their guards did.
      opt.guard.enabled = false;
      opt.force_drafts = [&](int64_t, const std::vector<int32_t>& drafted) {
        if (!c.greedy_drafts) return drafted;
        std::vector<int32_t> h = s.history();  // the kept tokens; `next` is not run yet
        h.push_back(next);
        Session g(m, test::pools_for(m), {});
        std::vector<float> l = g.prefill(h);
        std::vector<int32_t> d;
        for (int j = 0; j < 4; ++j) {
          d.push_back(argmax(l.data(), V));
          if (j < 3) l = g.decode(d.back());
        }
        return d;
      };
      SpeculativeDecoder spec(s, drafter, sampler, opt);
      Decoded out;
      out.rows = s.prefill(prompt);
      next = sampler.sample(out.rows.data(), V);
      out.tokens.push_back(next);
      while (out.tokens.size() < 25) {
        const SpeculativeDecoder::Step st = spec.step(next);
        for (size_t i = 0; i < st.tokens.size() && out.tokens.size() < 25; ++i) {
          out.tokens.push_back(st.tokens[i]);
          out.rows.insert(out.rows.end(), st.rows.begin() + static_cast<long>(i) * V, st.rows.begin() + static_cast<long>(i + 1) * V);
          next = st.tokens[i];
        }
      }
      out.stats = spec.stats();
      return out;
    };
    const Decoded a = plain(prompt, 25, c.sp);
    const Decoded b = run();
    ASSERT_EQ(b.tokens.size(), 25u) << c.name;
    ASSERT_EQ(b.rows.size(), 25u * static_cast<size_t>(V)) << c.name;
    EXPECT_EQ(a.tokens[0], b.tokens[0]) << c.name;  // the first token comes from the prefill, before any draft
    std::printf("[spec] sampling, %s: %lld proposed, %lld accepted in %lld steps\n", c.name,
                static_cast<long long>(b.stats.proposed), static_cast<long long>(b.stats.accepted),
                static_cast<long long>(b.stats.steps));
    EXPECT_LT(b.stats.accepted, b.stats.proposed) << c.name;
    if (c.greedy_drafts) {
      EXPECT_GT(b.stats.accepted, 0) << c.name;
    }
    EXPECT_EQ(b.stats.emitted, b.stats.accepted + b.stats.steps) << c.name;
    EXPECT_EQ(b.stats.target_forwards, b.stats.steps) << c.name;

    Session ref(m, test::pools_for(m), {});
    std::vector<float> row = ref.prefill(prompt);
    Sampler nucleus(c.sp);
    for (size_t i = 0; i < b.tokens.size(); ++i) {
      ASSERT_EQ(row, std::vector<float>(b.rows.begin() + static_cast<long>(i) * V, b.rows.begin() + static_cast<long>(i + 1) * V))
          << c.name << ", row " << i;
      EXPECT_GT(nucleus.distribution(row.data(), V)[static_cast<size_t>(b.tokens[i])], 0.0) << c.name << ", token " << i;
      if (i + 1 < b.tokens.size()) row = ref.decode(b.tokens[i]);
    }
    EXPECT_EQ(run().tokens, b.tokens) << c.name;
  }
}

}  // namespace
}  // namespace dsv41

namespace dsv41 {
namespace {

// A guard with a window of 2, a probe of 2 and a first pause of 3 plain steps, up to `max_pause`.
AcceptanceGuardOptions short_guard(int max_pause) {
  AcceptanceGuardOptions o;
  o.window = 2;
  o.probe_steps = 2;
  o.pause_steps = 3;
  o.max_pause_steps = max_pause;
  return o;
}

// Plain steps of 1 s until the guard drafts again: the length of the probe or pause under way.
int plain_run_of(AcceptanceGuard& guard) {
  int n = 0;
  while (!guard.drafting()) {
    guard.plain_step(1.0);
    ++n;
  }
  return n;
}

// The guard's schedule, on made-up times (a plain step 1 s, a verification 2 s): after the first
// window it times a few plain steps, and the probe's end decides on that window; a window yielding
// fewer tokens per second than plain steps pauses drafting, each failure in a row doubling the pause
// up to its cap; a window that pays resets it; a disabled guard never pauses.
TEST(AcceptanceGuard, PausesWhenSpeculatingIsSlowerThanPlainSteps) {
  AcceptanceGuardOptions o = short_guard(8);
  AcceptanceGuard g(o);
  auto plain_run = [&] { return plain_run_of(g); };
  g.verified(1, 2.0);
  EXPECT_TRUE(g.drafting());  // the window is not full yet
  g.verified(1, 2.0);
  EXPECT_FALSE(g.drafting());  // the probe: no plain time known yet
  g.plain_step(1.0);
  EXPECT_EQ(g.plain_steps_left(), 1);
  EXPECT_EQ(g.pauses(), 0);
  g.plain_step(1.0);  // the probe's end decides: 2 tokens in 4 s against 1 token/s plain
  EXPECT_EQ(g.pauses(), 1);
  EXPECT_EQ(plain_run(), 3);
  g.verified(5, 2.0);
  g.verified(4, 2.0);  // 9 tokens in 4 s: pays
  EXPECT_TRUE(g.drafting());
  for (int expected : {3, 6, 8, 8}) {
    g.verified(1, 2.0);
    g.verified(1, 2.0);
    EXPECT_EQ(plain_run(), expected);
  }
  EXPECT_EQ(g.pauses(), 5);
  // break-even counts as paying: 2 tokens per 2 s against 1 per second
  AcceptanceGuard even(o);
  even.verified(2, 2.0);
  even.verified(2, 2.0);
  EXPECT_EQ(plain_run_of(even), 2);  // the probe alone: no pause
  EXPECT_EQ(even.pauses(), 0);
  o.enabled = false;
  AcceptanceGuard off(o);
  for (int i = 0; i < 10; ++i) off.verified(1, 100.0);
  EXPECT_TRUE(off.drafting());
  o.enabled = true;
  o.max_pause_steps = 2;
  EXPECT_THROW(AcceptanceGuard{o}, Error);
}

// A guard can start where an earlier sequence's ended (AcceptanceGuardOptions::start_paused, which
// the engine fills from learned_pause()): plain steps first, timed, so the first window decides
// without a probe; a failure doubles that pause, a window that pays forgets it.
TEST(AcceptanceGuard, StartsFromWhatEarlierSequencesLearned) {
  AcceptanceGuardOptions o = short_guard(16);
  AcceptanceGuard first(o);
  EXPECT_EQ(first.learned_pause(), 0);  // nothing decided yet
  for (int expected : {2 + 3, 6, 12}) {  // the probe and the first pause, then failures in a row
    first.verified(1, 2.0);
    first.verified(1, 2.0);
    EXPECT_EQ(plain_run_of(first), expected);
  }
  EXPECT_EQ(first.learned_pause(), 12);

  o.start_paused = first.learned_pause();
  AcceptanceGuard next(o);
  EXPECT_FALSE(next.drafting());
  EXPECT_EQ(next.learned_pause(), 12);  // a sequence that ends inside it passes it on unchanged
  EXPECT_EQ(plain_run_of(next), 12);
  next.verified(1, 2.0);
  next.verified(1, 2.0);  // decides at once: the start's plain steps were timed
  EXPECT_EQ(next.pauses(), 1);
  EXPECT_EQ(next.learned_pause(), 16);  // twice 12, capped
  EXPECT_EQ(plain_run_of(next), 16);
  next.verified(3, 2.0);
  next.verified(3, 2.0);  // 6 tokens in 4 s: pays
  EXPECT_TRUE(next.drafting());
  EXPECT_EQ(next.learned_pause(), 0);

  o.start_paused = 17;  // beyond max_pause_steps
  EXPECT_THROW(AcceptanceGuard{o}, Error);
  o.start_paused = 5;
  o.enabled = false;
  EXPECT_TRUE(AcceptanceGuard(o).drafting());  // a disabled guard ignores it
}

}  // namespace
}  // namespace dsv41
