// The committed trained model (models/brown-tiny, docs/training.md): it loads, it scores the held-out
// text at the documented perplexity, it writes words of the corpus, and speculative decoding with its
// trained DSpark stages gives exactly the plain greedy tokens.
#include <gtest/gtest.h>

#include <cctype>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "engine_util.h"
#include "runtime/engine.h"
#include "test_util.h"
#include "text/tokenizer.h"

namespace dsv41 {
namespace {

using nlohmann::json;

std::string model_dir() { return test::source_dir() + "/models/brown-tiny"; }

// docs/training.md: `dsv41 ppl -m models/brown-tiny -f models/brown-tiny/heldout.txt --ctx 256
// --stride 128 --chunks 24` in exact mode.
constexpr double kDocumentedPpl = 127.53;
constexpr int kChunks = 24;

std::set<std::string> words_of(const std::string& text) {
  std::set<std::string> words;
  std::string w;
  for (char c : text + " ") {
    if (std::isalpha(static_cast<unsigned char>(c))) {
      w += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else if (!w.empty()) {
      words.insert(w);
      w.clear();
    }
  }
  return words;
}

TEST(TrainedModel, LoadsAndInspects) {
  auto r = test::run_dsv41("inspect --json " + model_dir());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(json::parse(r.out)["checkpoint"]["valid"].get<bool>());
}

TEST(TrainedModel, HeldOutPerplexityIsTheDocumentedOne) {
  ASSERT_GT(kDocumentedPpl, 0);
  for (const char* mode : {"exact", "tail"}) {
    auto r = test::run_dsv41("ppl -m " + model_dir() + " -f " + model_dir() + "/heldout.txt --ctx 256 --stride 128 --chunks " +
                             std::to_string(kChunks) + " --prefill-mode " + mode + " --json");
    ASSERT_EQ(r.status, 0) << r.out;
    const json j = json::parse(r.out.substr(r.out.find('{')));
    const double ppl = j["ppl"].get<double>();
    std::printf("[trained] held-out ppl (%s, %d chunks of 256): %.3f\n", mode, kChunks, ppl);
    // Within 2% of the documented value in exact mode; tail mode may cost a little more.
    if (std::string(mode) == "exact") {
      EXPECT_NEAR(ppl, kDocumentedPpl, 0.02 * kDocumentedPpl);
    } else {
      EXPECT_LT(ppl, 1.10 * kDocumentedPpl);
    }
  }
}

// Each window's context restored from the prompt cache (docs/training.md): an exact restore scores
// every token exactly as a whole prefill does; a replay restore (the windows rebuilt from the last
// window of tokens before the boundary) moves perplexity by a few thousandths of a percent here, and
// re-runs exactly one window per chunk. Bad values are refused naming the flag.
TEST(TrainedModel, ContextsRestoredFromThePromptCache) {
  constexpr int kWindows = 8;
  const auto run = [&](const std::string& restore) {
    auto r = test::run_dsv41("ppl -m " + model_dir() + " -f " + model_dir() + "/heldout.txt --ctx 512 --stride 128 --chunks " +
                             std::to_string(kWindows) + " --restore " + restore + " --json");
    EXPECT_EQ(r.status, 0) << r.out;
    return json::parse(r.out.substr(r.out.find('{')));
  };
  const json none = run("none"), exact = run("exact"), replay = run("replay");
  std::printf("[trained] ppl over %d windows of 512, context from a prefill / an exact restore / a replay restore: "
              "%.4f / %.4f / %.4f (replayed %lld of %lld restored tokens)\n",
              kWindows, none["ppl"].get<double>(), exact["ppl"].get<double>(), replay["ppl"].get<double>(),
              static_cast<long long>(replay["replayed_tokens"].get<int64_t>()),
              static_cast<long long>(replay["restored_tokens"].get<int64_t>()));
  EXPECT_EQ(none["restored_tokens"], 0);
  // a window's 384 context tokens hold 6 cache blocks; the last stays to prefill (a hit leaves a token)
  EXPECT_EQ(exact["restored_tokens"], kWindows * 320);
  EXPECT_EQ(replay["restored_tokens"], kWindows * 320);
  EXPECT_EQ(exact["replayed_tokens"], 0);
  std::ifstream config_file(model_dir() + "/inference/config.json");
  const json config = json::parse(config_file);
  EXPECT_EQ(replay["replayed_tokens"], kWindows * config["window_size"].get<int64_t>());
  EXPECT_EQ(exact["mean_nll"].get<double>(), none["mean_nll"].get<double>()) << "an exact restore is exact";
  EXPECT_NE(replay["mean_nll"].get<double>(), none["mean_nll"].get<double>()) << "replay rebuilds windows, not bits";
  EXPECT_NEAR(replay["ppl"].get<double>(), none["ppl"].get<double>(), 0.01 * none["ppl"].get<double>());

  auto bad = test::run_dsv41("ppl -m " + model_dir() + " -f " + model_dir() + "/heldout.txt --restore sometimes");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("--restore: must be exact or replay, got \"sometimes\""), std::string::npos) << bad.out;
  bad = test::run_dsv41("ppl -m " + model_dir() + " -f " + model_dir() + "/heldout.txt --ctx 100 --stride 60 --restore exact");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("--restore: needs a context"), std::string::npos) << bad.out;
  bad = test::run_dsv41("ppl -m " + model_dir() + " -f " + model_dir() + "/heldout.txt --restore exact --prefill-mode tail");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("--restore: exact needs --prefill-mode exact"), std::string::npos) << bad.out;
}

TEST(TrainedModel, WritesWordsOfTheCorpus) {
  std::ifstream in(model_dir() + "/heldout.txt");
  const std::string heldout((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::set<std::string> known = words_of(heldout);
  auto r = test::run_dsv41("generate -m " + model_dir() + " -p 'The jury said that' -n 48 --temp 0 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const std::string text = json::parse(r.out.substr(r.out.find('{')))["text"].get<std::string>();
  const std::set<std::string> said = words_of(text);
  size_t hits = 0;
  for (const std::string& w : said) hits += known.count(w);
  std::printf("[trained] \"%s\": %zu of %zu distinct words occur in the held-out text\n", text.c_str(), hits, said.size());
  ASSERT_GE(said.size(), 5u) << text;
  EXPECT_GE(static_cast<double>(hits), 0.8 * static_cast<double>(said.size())) << text;
}

TEST(TrainedModel, GreedySpeculativeEqualsPlainAndAcceptsDrafts) {
  EngineOptions eo;
  eo.model_dir = model_dir();
  eo.parallel = 2;
  Engine engine(eo);
  const Tokenizer tok = Tokenizer::from_file(model_dir() + "/tokenizer.json");
  std::vector<int32_t> prompt = {static_cast<int32_t>(engine.config().bos_token_id)};
  for (int32_t id : tok.encode("The committee said that the report", false)) prompt.push_back(id);
  auto run = [&](SpeculativeMethod method) {
    RequestParams p;
    p.prompt = prompt;
    p.max_tokens = 64;
    p.ignore_eos = true;
    p.sampling.temperature = 0;
    p.speculative = method;
    p.acceptance_guard = false;
    auto c = std::make_unique<Collected>();
    engine.submit(p, collect(*c));
    wait(*c);
    return c;
  };
  auto plain = run(SpeculativeMethod::Off);
  auto spec = run(SpeculativeMethod::DSpark);
  EXPECT_EQ(spec->tokens, plain->tokens);
  const RequestReport& rep = spec->last.report;
  ASSERT_GT(rep.drafts_proposed, 0);
  std::printf("[trained] DSpark: %lld of %lld drafts accepted over %lld verify steps\n",
              static_cast<long long>(rep.drafts_accepted), static_cast<long long>(rep.drafts_proposed),
              static_cast<long long>(rep.verify_steps));
  EXPECT_GT(rep.drafts_accepted, 0) << "trained drafts are sometimes right";
}

}  // namespace
}  // namespace dsv41
