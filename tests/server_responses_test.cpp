// The Responses API (/v1/responses): its requests render the same prompt as the chat request they
// translate to, its Responses-only rules are 400s naming the Responses field, its builder turns
// reasoning, text and DSML tool calls into output items and typed stream events, and the live route
// answers plain and streamed with the same text.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/responses_api.h"
#include "server/responses_output.h"
#include "server_api_util.h"
#include "server_util.h"

namespace dsv41::server {
namespace {

using json = nlohmann::json;

ApiRequest responses(const json& body) { return parse_responses_request(body.dump(), tiny_info()); }
ApiRequest chat(const json& body) { return parse_request(Endpoint::ChatCompletions, body.dump(), tiny_info()); }

// Every kind of input item renders exactly the prompt of the chat messages it stands for.
TEST(ResponsesApi, InputItemsRenderTheChatPromptTheyStandFor) {
  const json tool = {{"type", "function"}, {"name", "lookup"}, {"description", "Looks a word up."},
                     {"parameters", {{"type", "object"}, {"properties", {{"word", {{"type", "string"}}}}}}}};
  const json r = {
      {"model", "tiny"},
      {"instructions", "Be brief."},
      {"input",
       {{{"role", "user"}, {"content", "What is a harbor?"}},
        {{"type", "reasoning"}, {"content", {{{"type", "reasoning_text"}, {"text", "I should look it up."}}}}},
        {{"type", "function_call"}, {"call_id", "call_1"}, {"name", "lookup"}, {"arguments", "{\"word\":\"harbor\"}"}},
        {{"type", "function_call_output"}, {"call_id", "call_1"}, {"output", "a sheltered port"}},
        {{"type", "message"}, {"role", "assistant"}, {"content", {{{"type", "output_text"}, {"text", "A sheltered port."}}}}},
        {{"role", "developer"}, {"content", {{{"type", "input_text"}, {"text", "Answer in French next."}}}}},
        {{"role", "user"}, {"content", "And a quay?"}}}},
      {"tools", {tool}},
      {"tool_choice", {{"type", "function"}, {"name", "lookup"}}},
      {"reasoning", {{"effort", "high"}}},
      {"max_output_tokens", 7},
      {"temperature", 0.5},
  };
  const json c = {
      {"model", "tiny"},
      {"messages",
       {{{"role", "system"}, {"content", "Be brief."}},
        {{"role", "user"}, {"content", "What is a harbor?"}},
        {{"role", "assistant"},
         {"content", ""},
         {"reasoning_content", "I should look it up."},
         {"tool_calls",
          {{{"id", "call_1"}, {"type", "function"}, {"function", {{"name", "lookup"}, {"arguments", "{\"word\":\"harbor\"}"}}}}}}},
        {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "a sheltered port"}},
        {{"role", "assistant"}, {"content", {{{"type", "text"}, {"text", "A sheltered port."}}}}},
        {{"role", "developer"}, {"content", {{{"type", "text"}, {"text", "Answer in French next."}}}}},
        {{"role", "user"}, {"content", "And a quay?"}}}},
      {"tools", {{{"type", "function"}, {"function", {{"name", "lookup"}, {"description", "Looks a word up."},
                                                     {"parameters", tool["parameters"]}}}}}},
      {"tool_choice", {{"type", "function"}, {"function", {{"name", "lookup"}}}}},
      {"reasoning_effort", "high"},
      {"max_tokens", 7},
      {"temperature", 0.5},
  };
  const ApiRequest a = responses(r), b = chat(c);
  EXPECT_EQ(a.endpoint, Endpoint::Responses);
  EXPECT_EQ(a.prompt_text, b.prompt_text);
  EXPECT_EQ(a.params.prompt, b.params.prompt);
  EXPECT_EQ(a.params.max_tokens, 7);
  EXPECT_EQ(a.thinking, b.thinking);
  EXPECT_DOUBLE_EQ(a.params.sampling.temperature, 0.5);
  EXPECT_EQ(a.responses_echo["instructions"], "Be brief.");
  EXPECT_EQ(a.responses_echo["max_output_tokens"], 7);
  EXPECT_EQ(a.responses_echo["reasoning"]["effort"], "high");
  EXPECT_EQ(a.responses_echo["tools"][0]["name"], "lookup");

  // a string input is one user message; text.format json_schema is the chat response_format
  const json schema = {{"type", "object"}, {"properties", {{"n", {{"type", "integer"}}}}}};
  nlohmann::ordered_json format = {{"type", "json_schema"}, {"json_schema", {{"name", "N"}, {"schema", schema}}}};
  EXPECT_EQ(responses({{"input", "Hi"}, {"text", {{"format", {{"type", "json_schema"}, {"name", "N"}, {"schema", schema}}}}}})
                .prompt_text,
            parse_request(Endpoint::ChatCompletions,
                          nlohmann::ordered_json{{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"response_format", format}}.dump(),
                          tiny_info())
                .prompt_text);
  // extension fields pass through
  EXPECT_EQ(responses({{"input", "Hi"}, {"prefill_mode", "tail"}}).params.prefill_mode, PrefillMode::Tail);
}

TEST(ResponsesApi, ResponsesOnlyRulesNameTheirField) {
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"previous_response_id", "resp_1"}, {"input", "x"}}, "previous_response_id"},
      {{{"conversation", "c"}, {"input", "x"}}, "conversation"},
      {{{"background", true}, {"input", "x"}}, "background"},
      {json::object(), "input"},
      {{{"input", 5}}, "input"},
      {{{"input", json::array()}}, "input"},
      {{{"input", {7}}}, "input[0]"},
      {{{"input", {{{"role", "bot"}, {"content", "x"}}}}}, "input[0].role"},
      {{{"input", {{{"role", "user"}}}}}, "input[0].content"},
      {{{"input", {{{"role", "user"}, {"content", {{{"type", "input_audio"}}}}}}}}, "input[0].content[0].type"},
      {{{"input", {{{"type", "item_reference"}, {"id", "msg_1"}}}}}, "input[0].type"},
      {{{"input", {{{"type", "web_search_call"}}}}}, "input[0].type"},
      {{{"input", {{{"type", "function_call"}, {"call_id", "c"}, {"name", "f"}}}}}, "input[0].arguments"},
      {{{"input", {{{"type", "function_call_output"}, {"call_id", "nope"}, {"output", "x"}}}}}, "input[0].call_id"},
      {{{"input", {{{"type", "function_call"}, {"call_id", "c"}, {"name", "f"}, {"arguments", "city=Paris"}}}}},
       "input[0].arguments"},
      {{{"input", {{{"type", "function_call"}, {"call_id", "c"}, {"name", "f"}, {"arguments", "[1]"}}}}}, "input[0].arguments"},
      {{{"input", {{{"type", "function_call"}, {"call_id", ""}, {"name", "f"}, {"arguments", "{}"}}}}}, "input[0].call_id"},
      {{{"input", {{{"type", "function_call"}, {"call_id", "c"}, {"name", "f"}, {"arguments", "{}"}},
                   {{"type", "function_call"}, {"call_id", "c"}, {"name", "g"}, {"arguments", "{}"}}}}},
       "input[1].call_id"},
      {{{"input", {{{"type", "function_call"}, {"call_id", "c"}, {"name", "f\"x"}, {"arguments", "{}"}}}}}, "input[0].name"},
      {{{"input", "x"}, {"tools", {{{"type", "function"}, {"name", "f"}, {"parameters", "object"}}}}}, "tools[0].parameters"},
      {{{"input", "x"}, {"tools", {{{"type", "function"}, {"name", "get<weather>"}}}}}, "tools[0].name"},
      {{{"input", "x"}, {"tools", {{{"type", "function"}, {"name", "f"}}, {{"type", "function"}, {"name", "f"}}}}},
       "tools[1].name"},
      {{{"input", "x"}, {"instructions", 3}}, "instructions"},
      {{{"input", "x"}, {"tools", {{{"type", "web_search"}}}}}, "tools[0].type"},
      {{{"input", "x"}, {"tools", {{{"type", "function"}}}}}, "tools[0].name"},
      {{{"input", "x"}, {"tool_choice", {{"type", "file_search"}}}}, "tool_choice.type"},
      {{{"input", "x"}, {"max_output_tokens", 0}}, "max_output_tokens"},
      {{{"input", "x"}, {"max_output_tokens", 5000}}, "max_output_tokens"},  // past the context
      {{{"input", "x"}, {"reasoning", {{"effort", 3}}}}, "reasoning.effort"},
      {{{"input", "x"}, {"reasoning", {{"effort", "extreme"}}}}, "reasoning.effort"},
      {{{"input", "x"}, {"text", {{"format", {{"type", "xml"}}}}}}, "text.format.type"},
      {{{"input", "x"}, {"parallel_tool_calls", "yes"}}, "parallel_tool_calls"},
      {{{"input", "x"}, {"temperature", 3}}, "temperature"},
      {{{"input", "x"}, {"model", "gpt-5"}}, "model"},
  };
  for (const auto& [body, param] : cases) {
    SCOPED_TRACE(body.dump());
    expect_error([&] { responses(body); }, param == "model" ? 404 : 400, param);
  }
}

std::vector<ResponsesBuilder::Event> feed(ResponsesBuilder& b, const std::vector<TokenEvent>& events) {
  std::vector<ResponsesBuilder::Event> out = b.start();
  for (const TokenEvent& e : events) {
    for (auto& ev : b.add(e)) out.push_back(std::move(ev));
  }
  return out;
}

// Reasoning, then text, then a DSML tool call: three output items, each opened, filled by deltas and
// closed in turn, sequence numbers counting up, and the final response holding what the deltas built.
TEST(ResponsesOutput, ReasoningTextAndAToolCallBecomeItemsAndTypedEvents) {
  const std::string dsml =
      "<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
      "<｜DSML｜ parameter name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n"
      "</｜DSML｜ invoke>\n</｜DSML｜ calls>";
  ApiRequest req = responses({{"input", "Weather?"}, {"stream", true}, {"thinking", true},
                              {"tools", {{{"type", "function"}, {"name", "get_weather"}}}}});
  ASSERT_TRUE(req.thinking);
  ResponsesBuilder b(req, "resp_t", 1700000000, fixed_ids());
  const std::vector<ResponsesBuilder::Event> events =
      feed(b, {token_event(1, "Let me"), token_event(2, " check.</think>"), token_event(3, "Checking."),
               token_event(4, "\n\n" + dsml.substr(0, 40)), token_event(5, dsml.substr(40)), done_event(FinishReason::Stop, 9, 5, 0)});
  std::vector<std::string> types;
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].data["sequence_number"], static_cast<int64_t>(i));
    EXPECT_EQ(events[i].data["type"], events[i].type);
    if (types.empty() || types.back() != events[i].type) types.push_back(events[i].type);
  }
  const std::vector<std::string> want = {
      "response.created", "response.in_progress",
      "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
      "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
      "response.output_item.added", "response.content_part.added", "response.output_text.delta",
      "response.output_text.done", "response.content_part.done", "response.output_item.done",
      "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
      "response.output_item.done", "response.completed"};
  EXPECT_EQ(types, want);
  std::string reasoning, text, args;
  for (const auto& e : events) {
    if (e.type == "response.reasoning_text.delta") reasoning += e.data["delta"].get<std::string>();
    if (e.type == "response.output_text.delta") text += e.data["delta"].get<std::string>();
    if (e.type == "response.function_call_arguments.delta") args += e.data["delta"].get<std::string>();
  }
  EXPECT_EQ(reasoning, "Let me check.");
  EXPECT_EQ(text, "Checking.");
  EXPECT_EQ(args, R"({"city": "Paris"})");
  const json r = events.back().data["response"];
  EXPECT_EQ(r, b.response());
  EXPECT_EQ(r["object"], "response");
  EXPECT_EQ(r["status"], "completed");
  ASSERT_EQ(r["output"].size(), 3u);
  EXPECT_EQ(r["output"][0]["type"], "reasoning");
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "Let me check.");
  EXPECT_EQ(r["output"][1]["type"], "message");
  EXPECT_EQ(r["output"][1]["content"][0]["text"], "Checking.");
  EXPECT_EQ(r["output"][2], json::parse(R"({"type":"function_call","id":")" + r["output"][2]["id"].get<std::string>() +
                                        R"(","status":"completed","call_id":"call_0","name":"get_weather","arguments":"{\"city\": \"Paris\"}"})"));
  EXPECT_EQ(r["usage"]["input_tokens"], 9);
  EXPECT_EQ(r["usage"]["output_tokens"], 5);
  EXPECT_EQ(r["usage"]["output_tokens_details"]["reasoning_tokens"], 2);
  EXPECT_EQ(r["usage"]["total_tokens"], 14);
  // every item id in the events is the one in the final response
  for (const auto& e : events) {
    if (e.data.contains("item_id")) {
      const size_t index = e.data["output_index"];
      EXPECT_EQ(e.data["item_id"], r["output"][index]["id"]) << e.type;
    }
  }
}

TEST(ResponsesOutput, LengthIsIncompleteAndFailuresFail) {
  ApiRequest req = responses({{"input", "Hi"}, {"thinking", false}, {"max_output_tokens", 2}});
  ResponsesBuilder plain(req, "resp_a", 1);
  EXPECT_TRUE(feed(plain, {token_event(1, "Hel"), token_event(2, "lo"), done_event(FinishReason::Length, 3, 2, 1)}).size() == 2);
  const json r = plain.response();
  EXPECT_EQ(r["status"], "incomplete");
  EXPECT_EQ(r["incomplete_details"]["reason"], "max_output_tokens");
  EXPECT_EQ(r["max_output_tokens"], 2);
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "Hello");
  EXPECT_EQ(r["usage"]["input_tokens_details"]["cached_tokens"], 1);

  req.stream = true;
  ResponsesBuilder failing(req, "resp_b", 1);
  TokenEvent err = done_event(FinishReason::Error, 3, 0, 0);
  err.error = "the engine failed while running this request";
  const auto events = feed(failing, {err});
  ASSERT_TRUE(failing.failure());
  EXPECT_EQ(events.back().type, "response.failed");
  EXPECT_EQ(events.back().data["response"]["status"], "failed");
  EXPECT_EQ(events.back().data["response"]["error"]["message"], err.error);
}

json greedy_body(const std::string& model, const std::string& input, int max_output_tokens) {
  return {{"model", model}, {"input", input}, {"max_output_tokens", max_output_tokens},
          {"temperature", 0}, {"ignore_eos", true}, {"thinking", false}};
}

// Plain and streamed answers of the live route agree with each other and with the chat route.
TEST(ResponsesLive, PlainStreamedAndChatAgree) {
  LiveServer s(tiny_engine_options());
  const std::string model = s.engine().model_name();
  const json body = greedy_body(model, "Tell me about boats.", 10);
  const Reply plain = post(s.port(), "/v1/responses", body);
  ASSERT_EQ(plain.status, 200) << plain.raw;
  EXPECT_EQ(plain.body["object"], "response");
  EXPECT_EQ(plain.body["status"], "incomplete");  // ignore_eos: it ran to max_output_tokens
  EXPECT_EQ(plain.body["usage"]["output_tokens"], 10);
  ASSERT_FALSE(plain.body["output"].empty());
  const std::string text = plain.body["output"][0]["content"][0]["text"];

  const Reply c = post(s.port(), "/v1/chat/completions",
                       {{"model", model}, {"messages", {{{"role", "user"}, {"content", "Tell me about boats."}}}},
                        {"max_tokens", 10}, {"temperature", 0}, {"ignore_eos", true}, {"thinking", false}});
  ASSERT_EQ(c.status, 200) << c.raw;
  EXPECT_EQ(c.body["choices"][0]["message"]["content"], text);

  json sbody = body;
  sbody["stream"] = true;
  const Stream st = post_stream(s.port(), "/v1/responses", sbody);
  ASSERT_EQ(st.status, 200) << st.raw;
  std::string streamed;
  std::vector<std::string> types;
  for (const json& e : st.events) {
    types.push_back(e["type"]);
    if (e["type"] == "response.output_text.delta") streamed += e["delta"].get<std::string>();
  }
  ASSERT_GE(types.size(), 4u) << st.raw;
  EXPECT_EQ(types.front(), "response.created");
  EXPECT_EQ(types.back(), "response.incomplete");
  EXPECT_EQ(streamed, text);
  EXPECT_NE(st.raw.find("event: response.output_text.delta\ndata: "), std::string::npos);
  EXPECT_EQ(st.raw.find("[DONE]"), std::string::npos);  // the Responses stream has no sentinel

  const Reply bad = post(s.port(), "/v1/responses", {{"model", model}, {"input", "x"}, {"previous_response_id", "resp_1"}});
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(bad.body["error"]["param"], "previous_response_id");
}

}  // namespace
}  // namespace dsv41::server
