// Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): its requests render the same
// prompt as the chat request they translate to, its own rules are 400s naming the Messages field,
// its builder turns thinking, text and DSML tool calls into content blocks and named stream events,
// and the live route answers plain and streamed alike, with Anthropic's errors, stop reasons and
// x-api-key.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "runtime/sampler.h"
#include "server/messages_api.h"
#include "server/messages_output.h"
#include "server_api_util.h"
#include "server_util.h"

namespace dsv41::server {
namespace {

using json = nlohmann::json;

using ojson = nlohmann::ordered_json;

ApiRequest messages(const ojson& body) { return parse_messages_request(body.dump(), tiny_info()); }
ApiRequest chat(const ojson& body) { return parse_request(Endpoint::ChatCompletions, body.dump(), tiny_info()); }

const ojson kWeatherSchema = {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}, {"required", {"city"}}};

// Every kind of block renders exactly the prompt of the chat messages it stands for (tool schemas
// in the client's key order).
TEST(MessagesApi, BlocksRenderTheChatPromptTheyStandFor) {
  const ojson m = {
      {"model", "tiny"},
      {"system", {{{"type", "text"}, {"text", "Be brief."}}, {{"type", "text"}, {"text", "Use tools."}}}},
      {"messages",
       {{{"role", "user"}, {"content", "Weather in Paris?"}},
        {{"role", "assistant"},
         {"content",
          {{{"type", "thinking"}, {"thinking", "I should look."}, {"signature", "sig"}},
           {{"type", "text"}, {"text", "Checking."}},
           {{"type", "tool_use"}, {"id", "toolu_1"}, {"name", "get_weather"}, {"input", {{"city", "Paris"}}}}}}},
        {{"role", "user"},
         {"content",
          {{{"type", "tool_result"}, {"tool_use_id", "toolu_1"}, {"content", "Sunny, 21 C"}},
           {{"type", "text"}, {"text", "And tomorrow?"}}}}}}},
      {"tools", {{{"name", "get_weather"}, {"description", "The weather."}, {"input_schema", kWeatherSchema}}}},
      {"tool_choice", {{"type", "any"}}},
      {"thinking", {{"type", "enabled"}, {"budget_tokens", 1024}}},
      {"max_tokens", 2048},
      {"stop_sequences", {"END"}},
      {"temperature", 0.5},
      {"top_k", 40},
  };
  const ojson c = {
      {"model", "tiny"},
      {"messages",
       {{{"role", "system"}, {"content", "Be brief.\nUse tools."}},
        {{"role", "user"}, {"content", "Weather in Paris?"}},
        {{"role", "assistant"},
         {"content", "Checking."},
         {"reasoning_content", "I should look."},
         {"tool_calls",
          {{{"id", "toolu_1"}, {"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", {{"city", "Paris"}}}}}}}}},
        {{"role", "tool"}, {"tool_call_id", "toolu_1"}, {"content", "Sunny, 21 C"}},
        {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "And tomorrow?"}}}}}}},
      {"tools", {{{"type", "function"},
                  {"function", {{"name", "get_weather"}, {"description", "The weather."}, {"parameters", kWeatherSchema}}}}}},
      {"tool_choice", "required"},
      {"thinking", {{"type", "enabled"}}},
      {"max_tokens", 2048},
  };
  const ApiRequest a = messages(m), b = chat(c);
  EXPECT_EQ(a.endpoint, Endpoint::Messages);
  EXPECT_EQ(a.prompt_text, b.prompt_text);
  EXPECT_EQ(a.params.prompt, b.params.prompt);
  EXPECT_TRUE(a.thinking);
  EXPECT_EQ(a.tool_names, std::vector<std::string>{"get_weather"});
  EXPECT_EQ(a.params.stop, std::vector<std::string>{"END"});
  EXPECT_DOUBLE_EQ(a.params.sampling.temperature, 0.5);
  EXPECT_EQ(a.params.sampling.top_k, 40);
  EXPECT_EQ(a.params.max_tokens, 2048);

  // Anthropic's default is no thinking, whatever the server's default for OpenAI clients
  const json plain = {{"model", "tiny"}, {"max_tokens", 5}, {"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
  EXPECT_FALSE(messages(plain).thinking);
  EXPECT_EQ(messages(plain).prompt_text,
            chat({{"model", "tiny"}, {"max_tokens", 5}, {"thinking", false}, {"messages", {{{"role", "user"}, {"content", "Hi"}}}}})
                .prompt_text);
  // tool_choice tool and none; a counting body needs no max_tokens
  ojson named = m;
  named["tool_choice"] = {{"type", "tool"}, {"name", "get_weather"}};
  EXPECT_EQ(messages(named).tool_names, std::vector<std::string>{"get_weather"});
  named["tool_choice"] = {{"type", "none"}};
  EXPECT_TRUE(messages(named).tool_names.empty());
  json counting = plain;
  counting.erase("max_tokens");
  EXPECT_EQ(parse_messages_request(counting.dump(), tiny_info(), /*counting=*/true).params.prompt, messages(plain).params.prompt);
}

TEST(MessagesApi, MessagesOnlyRulesNameTheirField) {
  const json user = {{"role", "user"}, {"content", "x"}};
  const auto body = [&](json extra) {
    json b = {{"model", "tiny"}, {"max_tokens", 8}, {"messages", {user}}};
    for (auto& [k, v] : extra.items()) b[k] = v;
    return b;
  };
  const json call = {{"role", "assistant"}, {"content", {{{"type", "tool_use"}, {"id", "t1"}, {"name", "f"}, {"input", json::object()}}}}};
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"model", "tiny"}, {"messages", {user}}}, "max_tokens"},
      {body({{"messages", json::array()}}), "messages"},
      {body({{"messages", {{{"role", "system"}, {"content", "x"}}}}}), "messages[0].role"},
      {body({{"messages", {{{"role", "user"}}}}}), "messages[0].content"},
      {body({{"messages", {{{"role", "user"}, {"content", {{{"type", "document"}}}}}}}}), "messages[0].content[0].type"},
      {body({{"messages", {{{"role", "user"}, {"content", {{{"type", "image"}, {"source", {{"type", "url"}, {"url", "https://x"}}}}}}}}}}),
       "messages[0].content[0].source.type"},
      {body({{"messages", {{{"role", "user"}, {"content", {{{"type", "tool_result"}, {"tool_use_id", "nope"}}}}}}}}),
       "messages[0].content[0].tool_use_id"},
      {body({{"messages", {user, call, {{"role", "user"}, {"content", {{{"type", "tool_result"}, {"tool_use_id", "t1"}, {"is_error", "no"}}}}}}}}),
       "messages[2].content[0].is_error"},
      {body({{"messages", {user, {{"role", "assistant"}, {"content", {{{"type", "tool_use"}, {"id", "t1"}, {"name", "f"}}}}}}}}),
       "messages[1].content[0].input"},
      {body({{"messages", {user, {{"role", "assistant"}, {"content", {{{"type", "tool_use"}, {"id", "t1"}, {"name", "f<x>"}, {"input", json::object()}}}}}}}}),
       "messages[1].content[0].name"},
      {body({{"system", 4}}), "system"},
      {body({{"system", {{{"type", "image"}}}}}), "system[0].type"},
      {body({{"tools", {{{"type", "web_search_20250305"}, {"name", "web_search"}}}}}), "tools[0].type"},
      {body({{"tools", {{{"name", "f"}}}}}), "tools[0].input_schema"},
      {body({{"tools", {{{"name", "f"}, {"input_schema", kWeatherSchema}, {"description", 5}}}}}), "tools[0].description"},
      {body({{"tool_choice", {{"type", "whatever"}}}}), "tool_choice.type"},
      {body({{"tool_choice", "auto"}}), "tool_choice"},
      {body({{"thinking", {{"type", "enabled"}}}}), "thinking.budget_tokens"},
      {body({{"thinking", {{"type", "enabled"}, {"budget_tokens", 100}}}}), "thinking.budget_tokens"},
      {body({{"thinking", {{"type", "enabled"}, {"budget_tokens", 2000}}}}), "thinking.budget_tokens"},  // not below max_tokens
      {body({{"temperature", 1.5}}), "temperature"},
      {body({{"top_k", 0}}), "top_k"},
      {body({{"stop_sequences", "END"}}), "stop_sequences"},
      {body({{"stop_sequences", {""}}}), "stop_sequences"},
      {body({{"mcp_servers", json::array()}}), "mcp_servers"},
      {body({{"metadata", "x"}}), "metadata"},
      {body({{"max_tokens", 0}}), "max_tokens"},
      {body({{"model", "claude-opus"}}), "model"},
  };
  for (const auto& [b, param] : cases) {
    SCOPED_TRACE(b.dump());
    expect_error([&] { messages(b); }, param == "model" ? 404 : 400, param);
  }
  const json error = messages_error_body(ApiError(404, "invalid_request_error", "no such model", "model"));
  EXPECT_EQ(error, json::parse(R"({"type":"error","error":{"type":"not_found_error","message":"no such model"}})"));
  EXPECT_EQ(messages_error_body(ApiError(503, "server_error", "busy"))["error"]["type"], "overloaded_error");
  EXPECT_EQ(messages_error_body(ApiError(401, "invalid_request_error", "key"))["error"]["type"], "authentication_error");
}

std::vector<MessagesBuilder::Event> feed(MessagesBuilder& b, const std::vector<TokenEvent>& events) {
  std::vector<MessagesBuilder::Event> out = b.start();
  for (const TokenEvent& e : events) {
    for (auto& ev : b.add(e)) out.push_back(std::move(ev));
  }
  return out;
}

// Thinking, then text, then a DSML tool call: three content blocks, each started, filled by deltas
// and stopped in turn, and the message the deltas built, with stop_reason tool_use.
TEST(MessagesOutput, ThinkingTextAndAToolCallBecomeBlocksAndNamedEvents) {
  const std::string dsml =
      "<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
      "<｜DSML｜ parameter name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n"
      "</｜DSML｜ invoke>\n</｜DSML｜ calls>";
  const ApiRequest req = messages({{"model", "tiny"}, {"max_tokens", 2048}, {"stream", true},
                                   {"thinking", {{"type", "enabled"}, {"budget_tokens", 1024}}},
                                   {"messages", {{{"role", "user"}, {"content", "Weather?"}}}},
                                   {"tools", {{{"name", "get_weather"}, {"input_schema", kWeatherSchema}}}}});
  ASSERT_TRUE(req.thinking);
  MessagesBuilder b(req, "msg_t", fixed_ids());
  TokenEvent done = done_event(FinishReason::Stop, 9, 5, 4);
  done.report.cache_tokens_stored = 6;
  const std::vector<MessagesBuilder::Event> events =
      feed(b, {token_event(1, "Let me"), token_event(2, " check.</think>"), token_event(3, "Checking."),
               token_event(4, "\n\n" + dsml.substr(0, 40)), token_event(5, dsml.substr(40)), done});
  std::vector<std::string> types;
  for (const auto& e : events) {
    EXPECT_EQ(e.data["type"], e.type);
    if (types.empty() || types.back() != e.type) types.push_back(e.type);
  }
  const std::vector<std::string> want = {"message_start", "ping",
                                         "content_block_start", "content_block_delta", "content_block_stop",
                                         "content_block_start", "content_block_delta", "content_block_stop",
                                         "content_block_start", "content_block_delta", "content_block_stop",
                                         "message_delta", "message_stop"};
  EXPECT_EQ(types, want);
  EXPECT_EQ(events[0].data["message"]["content"], json::array());
  EXPECT_EQ(events[0].data["message"]["usage"]["output_tokens"], 0);
  std::string thinking, text, input;
  for (const auto& e : events) {
    if (e.type != "content_block_delta") continue;
    const json& d = e.data["delta"];
    if (d["type"] == "thinking_delta") thinking += d["thinking"].get<std::string>();
    if (d["type"] == "text_delta") text += d["text"].get<std::string>();
    if (d["type"] == "input_json_delta") input += d["partial_json"].get<std::string>();
  }
  EXPECT_EQ(thinking, "Let me check.");
  EXPECT_EQ(text, "Checking.");
  EXPECT_EQ(json::parse(input), json({{"city", "Paris"}}));
  const json& delta = events[events.size() - 2].data;
  EXPECT_EQ(delta["delta"]["stop_reason"], "tool_use");
  EXPECT_TRUE(delta["delta"]["stop_sequence"].is_null());
  // 9 prompt tokens: 4 read from the cache, 2 more stored in it, 3 neither
  EXPECT_EQ(delta["usage"], json({{"input_tokens", 3}, {"cache_creation_input_tokens", 2},
                                  {"cache_read_input_tokens", 4}, {"output_tokens", 5}}));
  const json m = b.message();
  EXPECT_EQ(m["type"], "message");
  EXPECT_EQ(m["role"], "assistant");
  EXPECT_EQ(m["id"], "msg_t");
  ASSERT_EQ(m["content"].size(), 3u);
  EXPECT_EQ(m["content"][0], json({{"type", "thinking"}, {"thinking", "Let me check."}, {"signature", ""}}));
  EXPECT_EQ(m["content"][1], json({{"type", "text"}, {"text", "Checking."}}));
  EXPECT_EQ(m["content"][2], json({{"type", "tool_use"}, {"id", "call_0"}, {"name", "get_weather"}, {"input", {{"city", "Paris"}}}}));
  EXPECT_EQ(m["stop_reason"], "tool_use");
}

TEST(MessagesOutput, StopReasonsAndFailures) {
  ApiRequest req = messages({{"model", "tiny"}, {"max_tokens", 5}, {"messages", {{{"role", "user"}, {"content", "Hi"}}}}});
  const auto stop_reason = [&](const TokenEvent& done) {
    MessagesBuilder b(req, "msg_a");
    feed(b, {token_event(1, "Hel"), token_event(2, "lo"), done});
    EXPECT_EQ(b.message()["content"][0]["text"], "Hello");
    return std::make_pair(b.message()["stop_reason"], b.message()["stop_sequence"]);
  };
  EXPECT_EQ(stop_reason(done_event(FinishReason::Length, 3, 2, 0)).first, "max_tokens");
  TokenEvent eos = done_event(FinishReason::Stop, 3, 2, 0);
  eos.stop_token = 1;
  EXPECT_EQ(stop_reason(eos).first, "end_turn");
  TokenEvent stopped = done_event(FinishReason::Stop, 3, 2, 0);
  stopped.stop_string = "END";
  EXPECT_EQ(stop_reason(stopped), std::make_pair(json("stop_sequence"), json("END")));

  req.stream = true;
  MessagesBuilder failing(req, "msg_b");
  TokenEvent err = done_event(FinishReason::Error, 3, 0, 0);
  err.error = "the engine failed while running this request";
  const auto events = feed(failing, {err});
  ASSERT_TRUE(failing.failure());
  EXPECT_EQ(events.back().type, "error");
  EXPECT_EQ(events.back().data["error"], json({{"type", "api_error"}, {"message", err.error}}));
}

// top_k keeps the k most likely tokens, and top_p then works within them.
TEST(MessagesSampling, TopKKeepsTheKMostLikely) {
  const std::vector<float> logits = {0.0f, 3.0f, 1.0f, 2.0f, -1.0f};
  Sampler two(SamplingParams{1.0, 1.0, 3, 2});
  std::vector<double> p = two.distribution(logits.data(), 5);
  EXPECT_GT(p[1], 0);
  EXPECT_GT(p[3], 0);
  EXPECT_EQ(p[0] + p[2] + p[4], 0);
  EXPECT_NEAR(p[1], 1 / (1 + std::exp(-1.0)), 1e-12);
  for (int i = 0; i < 200; ++i) {
    const int32_t t = two.sample(logits.data(), 5);
    EXPECT_TRUE(t == 1 || t == 3) << t;
  }
  Sampler nucleus(SamplingParams{1.0, 0.5, 3, 2});  // the top token alone holds 0.73 of the top two
  p = nucleus.distribution(logits.data(), 5);
  EXPECT_EQ(p[1], 1.0);
  Sampler all(SamplingParams{1.0, 1.0, 3, 0});
  EXPECT_GT(all.distribution(logits.data(), 5)[4], 0);
}

json greedy_body(const std::string& model, const std::string& text, int max_tokens) {
  return {{"model", model}, {"max_tokens", max_tokens}, {"temperature", 0}, {"ignore_eos", true},
          {"messages", {{{"role", "user"}, {"content", text}}}}};
}

// The live route: plain and streamed answers agree with each other and with the chat route; errors
// come in Anthropic's shape; count_tokens counts what the request's usage does; stop_sequences end
// the answer with stop_reason stop_sequence; x-api-key is a key.
TEST(MessagesLive, PlainStreamedChatAndCountAgree) {
  ServerOptions so;
  so.test_hooks = true;
  so.api_key = "sk-test";
  LiveServer s(tiny_engine_options(), so);
  const std::string model = s.engine().model_name();
  httplib::Client cli("127.0.0.1", s.port());
  cli.set_read_timeout(std::chrono::seconds(60));
  const httplib::Headers key = {{"x-api-key", "sk-test"}, {"anthropic-version", "2023-06-01"}};
  const auto call = [&](const std::string& path, const json& body, const httplib::Headers& h) {
    return reply_of(cli.Post(path.c_str(), h, body.dump(), "application/json"));
  };

  const json body = greedy_body(model, "Tell me about boats.", 10);
  const Reply plain = call("/v1/messages", body, key);
  ASSERT_EQ(plain.status, 200) << plain.raw;
  EXPECT_EQ(plain.body["type"], "message");
  EXPECT_EQ(plain.body["stop_reason"], "max_tokens");
  EXPECT_EQ(plain.body["usage"]["output_tokens"], 10);
  ASSERT_EQ(plain.body["content"].size(), 1u);
  const std::string text = plain.body["content"][0]["text"];

  const Reply c = reply_of(cli.Post("/v1/chat/completions", {{"Authorization", "Bearer sk-test"}},
                                    json{{"model", model}, {"messages", {{{"role", "user"}, {"content", "Tell me about boats."}}}},
                                         {"max_tokens", 10}, {"temperature", 0}, {"ignore_eos", true}, {"thinking", false}}
                                        .dump(),
                                    "application/json"));
  ASSERT_EQ(c.status, 200) << c.raw;
  EXPECT_EQ(c.body["choices"][0]["message"]["content"], text);

  json counting = body;
  counting.erase("max_tokens");
  const Reply count = call("/v1/messages/count_tokens", counting, key);
  ASSERT_EQ(count.status, 200) << count.raw;
  const json& u = plain.body["usage"];
  EXPECT_EQ(count.body["input_tokens"], u["input_tokens"].get<int64_t>() + u["cache_read_input_tokens"].get<int64_t>() +
                                            u["cache_creation_input_tokens"].get<int64_t>());

  // streamed: the same text, Anthropic's events in order
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/messages";
  json sbody = body;
  sbody["stream"] = true;
  req.body = sbody.dump();
  req.headers = key;
  req.set_header("Content-Type", "application/json");
  std::string raw;
  req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
    raw.append(d, n);
    return true;
  };
  ASSERT_TRUE(cli.send(req));
  std::vector<std::string> names;
  std::string streamed;
  for (size_t at = 0; (at = raw.find("event: ", at)) != std::string::npos;) {
    const size_t eol = raw.find('\n', at);
    names.push_back(raw.substr(at + 7, eol - at - 7));
    const size_t data_end = raw.find("\n\n", eol);
    const json data = json::parse(raw.substr(eol + 7, data_end - eol - 7));
    EXPECT_EQ(data["type"], names.back());
    if (names.back() == "content_block_delta") streamed += data["delta"]["text"].get<std::string>();
    at = data_end;
  }
  ASSERT_GE(names.size(), 6u) << raw;
  EXPECT_EQ(names[0], "message_start");
  EXPECT_EQ(names[names.size() - 2], "message_delta");
  EXPECT_EQ(names.back(), "message_stop");
  EXPECT_EQ(streamed, text);

  // a stop sequence the model writes (forced through the test hook)
  json stop = greedy_body(model, "Count.", 20);
  stop["dsv41_forced_output"] = "one two END three";
  stop["stop_sequences"] = {"END"};
  const Reply stopped = call("/v1/messages", stop, key);
  ASSERT_EQ(stopped.status, 200) << stopped.raw;
  EXPECT_EQ(stopped.body["stop_reason"], "stop_sequence");
  EXPECT_EQ(stopped.body["stop_sequence"], "END");
  EXPECT_EQ(stopped.body["content"][0]["text"], "one two ");

  // Anthropic's error shapes: a wrong key, a bad field, an unknown model, an unknown route
  Reply e = call("/v1/messages", body, {{"x-api-key", "wrong"}});
  EXPECT_EQ(e.status, 401);
  EXPECT_EQ(e.body["type"], "error");
  EXPECT_EQ(e.body["error"]["type"], "authentication_error");
  json bad = body;
  bad.erase("max_tokens");
  e = call("/v1/messages", bad, key);
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.body["error"]["type"], "invalid_request_error");
  EXPECT_NE(e.body["error"]["message"].get<std::string>().find("max_tokens"), std::string::npos);
  bad = body;
  bad["model"] = "claude-x";
  EXPECT_EQ(call("/v1/messages", bad, key).body["error"]["type"], "not_found_error");
  EXPECT_EQ(call("/v1/messages/batches", body, key).body["error"]["type"], "not_found_error");
}

}  // namespace
}  // namespace dsv41::server
