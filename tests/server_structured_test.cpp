// Structured outputs through the server on the trained tiny model (models/brown-tiny): sampled
// answers under a JSON Schema all parse and validate (checked by Ajv from npm, not by dsv41's own
// grammar), while the same prompts answered freely do not; json_object, choice, the completions and
// Responses routes, streaming, and requests the subset does not cover.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <vector>

#include "server_util.h"
#include "test_util.h"

namespace dsv41::server {
namespace {

LiveServer& brown_server() {
  static LiveServer server([] {
    EngineOptions eo;
    eo.model_dir = test::source_dir() + "/models/brown-tiny";
    eo.parallel = 8;
    return eo;
  }());
  return server;
}

const json kFlags = json::parse(R"({"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"}, "ok": {"type": "boolean"}},
  "required": ["color", "count", "ok"], "additionalProperties": false})");
const json kOrders = json::parse(R"({"type": "array", "minItems": 1, "maxItems": 2, "items": {
    "type": "object", "properties": {"id": {"type": "integer"},
      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
      "gift": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}},
    "required": ["id", "tags", "gift"], "additionalProperties": false}})");

json chat(int seed, int max_tokens) {
  return {{"messages", {{{"role", "user"}, {"content", "Answer in JSON."}}}},
          {"max_tokens", max_tokens},
          {"temperature", 1.0},
          {"seed", seed},
          {"thinking", false}};
}

json with_schema(json body, const json& schema) {
  body["response_format"] = {{"type", "json_schema"}, {"json_schema", {{"name", "answer"}, {"schema", schema}}}};
  return body;
}

// Ajv's verdict on each output (tests/npm/validate_json.mjs): parsed, valid.
struct Verdicts {
  std::vector<bool> parsed, valid;
  std::vector<std::string> errors;
};
std::optional<Verdicts> ajv(const json& schema, const std::vector<std::string>& outputs) {
  const std::filesystem::path npm = std::filesystem::path(test::source_dir()) / "tests" / "npm";
  const char* require = std::getenv("DSV41_REQUIRE_NPM");
  const bool required = require != nullptr && std::string(require) == "1";
  if (!std::filesystem::exists(npm / "node_modules" / "ajv" / "package.json") ||
      std::system("node --version > /dev/null 2>&1") != 0) {
    if (required) ADD_FAILURE() << "DSV41_REQUIRE_NPM=1 but node or tests/npm/node_modules/ajv is missing";
    return std::nullopt;
  }
  test::TempDir dir;
  const std::string input = dir / "input.json";
  std::ofstream(input) << json{{"schema", schema}, {"outputs", outputs}}.dump();
  const test::CommandResult r = test::run_shell("cd '" + npm.string() + "' && node validate_json.mjs < '" + input + "'");
  EXPECT_EQ(r.status, 0) << r.out;
  const json out = json::parse(r.out, nullptr, false);
  if (out.is_discarded()) {
    ADD_FAILURE() << r.out;
    return std::nullopt;
  }
  return Verdicts{out["parsed"].get<std::vector<bool>>(), out["valid"].get<std::vector<bool>>(),
                  out["errors"].get<std::vector<std::string>>()};
}

std::string content(const Reply& r) {
  EXPECT_EQ(r.status, 200) << r.raw << r.error;
  return r.status == 200 ? r.body["choices"][0]["message"]["content"].get<std::string>() : "";
}

// Posts the requests in waves of the server's 8 slots, so none waits in its queue longer than one
// wave takes (under the sanitizers a wave of 400-token answers takes tens of seconds) and every
// batch holds 8 sequences, each with its own mask.
std::vector<Reply> in_waves(int port, const std::vector<json>& bodies) {
  std::vector<Reply> replies;
  for (size_t first = 0; first < bodies.size(); first += 8) {
    std::vector<std::future<Reply>> wave;
    for (size_t i = first; i < std::min(bodies.size(), first + 8); ++i) {
      wave.push_back(std::async(std::launch::async, [&, i] { return post(port, "/v1/chat/completions", bodies[i]); }));
    }
    for (auto& f : wave) replies.push_back(f.get());
  }
  return replies;
}

// 20 sampled answers per schema (8 under the sanitizers, whose job here is the memory and not the
// statistics): every one ends because its value is whole, and Ajv finds each valid; the same prompts
// answered freely are not JSON.
TEST(StructuredOutputs, TwentySampledAnswersPerSchemaAllValidate) {
  LiveServer& s = brown_server();
  const int samples = test::kSanitized ? 8 : 20;
  for (const json* schema : {&kFlags, &kOrders}) {
    std::vector<json> constrained_bodies, free_bodies;
    for (int seed = 1; seed <= samples; ++seed) {
      constrained_bodies.push_back(with_schema(chat(seed, 400), *schema));
      free_bodies.push_back(chat(seed, 60));
    }
    std::vector<std::string> outputs, free_outputs;
    for (const Reply& r : in_waves(s.port(), constrained_bodies)) {
      outputs.push_back(content(r));
      if (r.status == 200) {
        EXPECT_EQ(r.body["choices"][0]["finish_reason"], "stop") << outputs.back();
      }
    }
    for (const Reply& r : in_waves(s.port(), free_bodies)) free_outputs.push_back(content(r));
    const std::optional<Verdicts> v = ajv(*schema, outputs), u = ajv(*schema, free_outputs);
    if (!v || !u) GTEST_SKIP() << "node and ajv are not installed (npm ci in tests/npm)";
    int free_valid = 0, failures = 0;
    for (size_t i = 0; i < outputs.size(); ++i) {
      EXPECT_TRUE(v->valid[i]) << outputs[i] << "\n" << v->errors[i];
      failures += !v->valid[i];
      free_valid += u->valid[i];
    }
    std::printf("[ structured ] %s: %d of %d constrained answers valid; %d of %d free answers\n",
                schema == &kFlags ? "flags" : "orders", samples - failures, samples, free_valid, samples);
    EXPECT_LE(free_valid, samples / 10) << "the model writes this JSON unaided: the check proves nothing";
  }
}

TEST(StructuredOutputs, JsonObjectChoiceCompletionsResponsesAndStreams) {
  LiveServer& s = brown_server();
  // json_object: a free key is prose to this model, so answers run out of tokens inside it; each
  // is an object's start, and one that ends is an object
  for (int seed = 1; seed <= 3; ++seed) {
    json body = chat(seed, 40);
    body["response_format"] = {{"type", "json_object"}};
    const Reply r = post(s.port(), "/v1/chat/completions", body);
    const std::string text = content(r);
    EXPECT_EQ(text.substr(text.find_first_not_of(" \n\t"), 1), "{") << text;
    if (r.status == 200 && r.body["choices"][0]["finish_reason"] == "stop") {
      EXPECT_TRUE(json::parse(text, nullptr, false).is_object()) << text;
    }
  }

  const std::vector<std::string> choices = {"yes", "no", "maybe not"};
  for (int seed = 1; seed <= 5; ++seed) {
    json c = chat(seed, 20);
    c["structured_outputs"] = {{"choice", choices}};
    const Reply r = post(s.port(), "/v1/chat/completions", c);
    EXPECT_NE(std::find(choices.begin(), choices.end(), content(r)), choices.end()) << r.raw;
  }

  const Reply completion = post(s.port(), "/v1/completions",
                                {{"prompt", "The answer:"}, {"max_tokens", 300}, {"seed", 4}, {"temperature", 1.0},
                                 {"structured_outputs", {{"json", kFlags.dump()}}}});
  ASSERT_EQ(completion.status, 200) << completion.raw;
  const std::string completion_text = completion.body["choices"][0]["text"];

  const Reply response = post(s.port(), "/v1/responses",
                              {{"input", "Answer in JSON."}, {"max_output_tokens", 300}, {"seed", 5}, {"temperature", 1.0},
                               {"thinking", false},
                               {"text", {{"format", {{"type", "json_schema"}, {"name", "flags"}, {"schema", kFlags}}}}}});
  ASSERT_EQ(response.status, 200) << response.raw;
  std::string response_text;
  for (const json& item : response.body["output"]) {
    if (item["type"] == "message") response_text = item["content"][0]["text"];
  }

  json streamed = with_schema(chat(6, 300), kFlags);
  streamed["stream"] = true;
  const Stream st = post_stream(s.port(), "/v1/chat/completions", streamed);
  std::string stream_text;
  for (const json& e : st.events) {
    if (e.contains("choices") && !e["choices"].empty() && e["choices"][0]["delta"].contains("content")) {
      stream_text += e["choices"][0]["delta"]["content"].get<std::string>();
    }
  }
  EXPECT_EQ(stream_text, content(post(s.port(), "/v1/chat/completions", with_schema(chat(6, 300), kFlags))))
      << "streamed and plain constrained answers differ for one seed";

  const std::optional<Verdicts> v = ajv(kFlags, {completion_text, response_text, stream_text});
  if (!v) GTEST_SKIP() << "node and ajv are not installed (npm ci in tests/npm)";
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(v->valid[i]) << i << ": " << v->errors[i];
}

// DSpark under a grammar: each draft is verified against the masked target, so greedy answers are
// the plain constrained run's token for token, and sampled ones validate.
TEST(StructuredOutputs, DSparkDraftsAreVerifiedAgainstTheGrammar) {
  LiveServer& s = brown_server();
  const uint64_t verified_before = s.engine().metrics().spec_verify_steps;
  for (const char* prompt : {"Answer in JSON.", "List the orders.", "What did they buy?", "Reply as data."}) {
    json body = with_schema(chat(1, 300), kOrders);
    body["messages"][0]["content"] = prompt;
    body["temperature"] = 0;
    body["speculative"] = "off";
    const std::string plain = content(post(s.port(), "/v1/chat/completions", body));
    body["speculative"] = "dspark";
    EXPECT_EQ(content(post(s.port(), "/v1/chat/completions", body)), plain) << prompt;
  }
  EXPECT_GT(s.engine().metrics().spec_verify_steps, verified_before) << "no draft was verified";
  std::vector<std::future<Reply>> sampled;
  for (int seed = 1; seed <= 8; ++seed) {
    json body = with_schema(chat(seed, 400), kOrders);
    body["speculative"] = "dspark";
    sampled.push_back(std::async(std::launch::async, [&, body] { return post(s.port(), "/v1/chat/completions", body); }));
  }
  std::vector<std::string> outputs;
  for (auto& f : sampled) outputs.push_back(content(f.get()));
  const std::optional<Verdicts> v = ajv(kOrders, outputs);
  if (!v) GTEST_SKIP() << "node and ajv are not installed (npm ci in tests/npm)";
  for (size_t i = 0; i < outputs.size(); ++i) EXPECT_TRUE(v->valid[i]) << outputs[i] << "\n" << v->errors[i];
}

// (a string parameter is raw prose to this model, which seldom ends within the test's tokens: the
// free raw text is walked in json_grammar_test; here the strings are enums)
const json kReadFile = json::parse(R"({"type": "object", "properties": {"path": {"enum": ["README.md", "src/main.cpp"]},
  "lines": {"type": "integer"}, "mode": {"enum": ["text", "hex"]}}, "required": ["path", "mode"]})");

json tools_body(int seed, const json& tool_choice) {
  json body = chat(seed, 300);
  body["messages"][0]["content"] = "Read the file.";
  body["tools"] = {{{"type", "function"}, {"function", {{"name", "read_file"}, {"parameters", kReadFile}}}},
                   {{"type", "function"}, {"function", {{"name", "list_dir"}, {"parameters", {{"type", "object"}, {"properties", json::object()}}}}}}};
  body["tool_choice"] = tool_choice;
  return body;
}

// tool_choice "required" or a named function: the answer is a DSML block whose calls name offered
// tools and whose arguments Ajv finds valid against each tool's parameters; Anthropic's "any" too.
TEST(StructuredOutputs, ForcedToolCallsNameOfferedToolsWithValidArguments) {
  LiveServer& s = brown_server();
  std::vector<std::future<Reply>> replies;
  for (int seed = 1; seed <= 10; ++seed) {
    const json choice = seed <= 6 ? json("required") : json{{"type", "function"}, {"function", {{"name", "read_file"}}}};
    replies.push_back(std::async(std::launch::async, [&, seed, choice] {
      return post(s.port(), "/v1/chat/completions", tools_body(seed, choice));
    }));
  }
  std::vector<std::string> read_file_args;
  for (size_t i = 0; i < replies.size(); ++i) {
    const Reply r = replies[i].get();
    ASSERT_EQ(r.status, 200) << r.raw;
    const json& choice = r.body["choices"][0];
    EXPECT_EQ(choice["finish_reason"], "tool_calls") << r.raw;
    const json& calls = choice["message"]["tool_calls"];
    ASSERT_TRUE(calls.is_array() && !calls.empty()) << r.raw;
    if (i >= 6) {
      EXPECT_EQ(calls.size(), 1u) << "a named tool_choice makes one call";
    }
    for (const json& call : calls) {
      const std::string name = call["function"]["name"];
      const json args = json::parse(call["function"]["arguments"].get<std::string>(), nullptr, false);
      ASSERT_TRUE(args.is_object()) << call;
      if (name == "read_file") {
        read_file_args.push_back(args.dump());
      } else {
        EXPECT_EQ(name, "list_dir");
        EXPECT_LT(i, 6u) << "a named tool_choice calls only that tool";
        EXPECT_TRUE(args.empty()) << args;
      }
    }
  }
  // Anthropic's tool_choice "any" through /v1/messages
  const Reply m = post(s.port(), "/v1/messages",
                       {{"max_tokens", 300}, {"temperature", 1.0}, {"seed", 3},
                        {"messages", {{{"role", "user"}, {"content", "Read the file."}}}},
                        {"tools", {{{"name", "read_file"}, {"input_schema", kReadFile}}}},
                        {"tool_choice", {{"type", "any"}}}});
  ASSERT_EQ(m.status, 200) << m.raw;
  EXPECT_EQ(m.body["stop_reason"], "tool_use") << m.raw;
  for (const json& block : m.body["content"]) {
    if (block["type"] == "tool_use") read_file_args.push_back(block["input"].dump());
  }
  ASSERT_GE(read_file_args.size(), 5u);
  const std::optional<Verdicts> v = ajv(kReadFile, read_file_args);
  if (!v) GTEST_SKIP() << "node and ajv are not installed (npm ci in tests/npm)";
  for (size_t i = 0; i < read_file_args.size(); ++i) EXPECT_TRUE(v->valid[i]) << read_file_args[i] << "\n" << v->errors[i];
  std::printf("[ structured ] %zu read_file calls, all arguments valid\n", read_file_args.size());
}

TEST(StructuredOutputs, WhatTheSubsetDoesNotCoverIsA400NamingIt) {
  LiveServer& s = brown_server();
  for (const auto& [extra, param, words] : std::vector<std::tuple<json, std::string, std::string>>{
           {{{"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "x"}, {"schema", {{"type", "string"}, {"pattern", "a+"}}}}}}}},
            "response_format.json_schema.schema", "the keyword \"pattern\" is not supported"},
           {{{"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "x"}}}}}},
            "response_format.json_schema.schema", "is required"},
           {{{"structured_outputs", {{"regex", "a+"}}}}, "structured_outputs.regex", "not supported"},
           {{{"structured_outputs", {{"choice", json::array()}}}}, "structured_outputs.choice", "at least one"},
           {{{"structured_outputs", {{"json", "{not json"}}}}, "structured_outputs.json", "is not JSON"},
           {{{"response_format", {{"type", "json_object"}}}, {"structured_outputs", {{"choice", {"a"}}}}},
            "structured_outputs.choice", "cannot both constrain"}}) {
    json body = chat(1, 5);
    for (const auto& [k, v] : extra.items()) body[k] = v;
    const Reply r = post(s.port(), "/v1/chat/completions", body);
    EXPECT_EQ(r.status, 400) << r.raw;
    EXPECT_EQ(r.body["error"]["param"], param) << r.raw;
    EXPECT_NE(r.body["error"]["message"].get<std::string>().find(words), std::string::npos) << r.raw;
  }
}

}  // namespace
}  // namespace dsv41::server
