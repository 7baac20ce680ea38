// Tests for the V4.1 chat prompt renderer and output parser against docs/chat-encoding.md: every
// rendered example of the document byte for byte, its parsing examples, streaming at every split
// point, and rejected requests.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <iterator>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "text/chat_encoding.h"
#include "text/chat_output.h"
#include "util/error.h"

namespace dsv41 {
namespace {

using ojson = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------------
// Strings copied verbatim from docs/chat-encoding.md (§3.1, §3.2, §6). Apart from the tools block,
// the document writes them as JSON string literals; doc() decodes one.
const char* const kDocToolsBlock = R"doc(## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:

<｜DSML｜ calls>
<｜DSML｜ invoke name="$TOOL_NAME">
<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>
...
</｜DSML｜ invoke>
<｜DSML｜ invoke name="$TOOL_NAME2">
...
</｜DSML｜ invoke>
</｜DSML｜ calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{TOOL_SCHEMAS}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.)doc";

const char* const kDocArgumentsBlock = R"doc("\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"x\" string=\"false\">1.5</｜DSML｜ parameter>\n<｜DSML｜ parameter name=\"s\" string=\"true\">hi</｜DSML｜ parameter>\n<｜DSML｜ parameter name=\"o\" string=\"false\">{\"k\": [1, null]}</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>")doc";

const char* const kDocExample1Golden = R"doc("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\nYou are a helpful assistant.\n\n## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<｜DSML｜ calls>\" block like the following:\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"$TOOL_NAME\">\n<｜DSML｜ parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜ parameter>\n...\n</｜DSML｜ invoke>\n<｜DSML｜ invoke name=\"$TOOL_NAME2\">\n...\n</｜DSML｜ invoke>\n</｜DSML｜ calls>\n\nString parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n{\"name\": \"get_weather\", \"description\": \"Get the weather for a specific location\", \"parameters\": {\"type\": \"object\", \"properties\": {\"location\": {\"type\": \"string\", \"description\": \"The city name\"}, \"unit\": {\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"], \"description\": \"Temperature unit\"}}, \"required\": [\"location\"]}}\n{\"name\": \"search\", \"description\": \"Search the web for information\", \"parameters\": {\"type\": \"object\", \"properties\": {\"query\": {\"type\": \"string\", \"description\": \"Search query\"}, \"num_results\": {\"type\": \"integer\", \"description\": \"Number of results to return\"}}, \"required\": [\"query\"]}}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n<｜User｜>What's the weather in Beijing?<｜Assistant｜><think>The user wants to know the weather in Beijing. I should use the get_weather tool.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter name=\"location\" string=\"true\">Beijing</｜DSML｜ parameter>\n<｜DSML｜ parameter name=\"unit\" string=\"true\">celsius</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜><｜User｜><tool_result>{\"temperature\": 22, \"condition\": \"sunny\", \"humidity\": 45}</tool_result><｜Assistant｜><think>Got the weather data. Let me format a nice response.</think>The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity.<｜end▁of▁sentence｜>")doc";

const char* const kDocExample1Live = R"doc("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\nYou are a helpful assistant.\n\n## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<｜DSML｜ calls>\" block like the following:\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"$TOOL_NAME\">\n<｜DSML｜ parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜ parameter>\n...\n</｜DSML｜ invoke>\n<｜DSML｜ invoke name=\"$TOOL_NAME2\">\n...\n</｜DSML｜ invoke>\n</｜DSML｜ calls>\n\nString parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n{\"name\": \"get_weather\", \"description\": \"Get the weather for a specific location\", \"parameters\": {\"type\": \"object\", \"properties\": {\"location\": {\"type\": \"string\", \"description\": \"The city name\"}, \"unit\": {\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"], \"description\": \"Temperature unit\"}}, \"required\": [\"location\"]}}\n{\"name\": \"search\", \"description\": \"Search the web for information\", \"parameters\": {\"type\": \"object\", \"properties\": {\"query\": {\"type\": \"string\", \"description\": \"Search query\"}, \"num_results\": {\"type\": \"integer\", \"description\": \"Number of results to return\"}}, \"required\": [\"query\"]}}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n<｜User｜>What's the weather in Beijing?<｜Assistant｜><think>The user wants to know the weather in Beijing. I should use the get_weather tool.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter name=\"location\" string=\"true\">Beijing</｜DSML｜ parameter>\n<｜DSML｜ parameter name=\"unit\" string=\"true\">celsius</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜><｜User｜><tool_result>{\"temperature\": 22, \"condition\": \"sunny\", \"humidity\": 45}</tool_result><｜Assistant｜><think>")doc";

const char* const kDocExample1Output = R"doc("The user wants to know the weather in Beijing. I should use the get_weather tool.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter name=\"location\" string=\"true\">Beijing</｜DSML｜ parameter>\n<｜DSML｜ parameter name=\"unit\" string=\"true\">celsius</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>")doc";

const char* const kDocExample2Golden = R"doc("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\nYou are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I help you?<｜end▁of▁sentence｜><｜User｜>What is the capital of France?<｜Assistant｜><think>The user asks about the capital of France. It is Paris.</think>The capital of France is Paris.<｜end▁of▁sentence｜>")doc";

const char* const kDocExample3Chat = R"doc("<｜begin▁of▁sentence｜><｜System｜>You are a careful visual assistant.<｜User｜>Which of these two photos shows a cat?\n\n<｜deepseek_image｜>\n\n<｜deepseek_image｜><｜Assistant｜></think>The first photo shows a cat.<｜end▁of▁sentence｜><｜System｜>From now on answer in French.<｜User｜>And the second one?<｜Assistant｜></think>")doc";

const char* const kDocExample3Thinking = R"doc("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 100 (range 1-100, the higher the value, the more thorough the reasoning)\n\nYou are a careful visual assistant.<｜User｜>Which of these two photos shows a cat?\n\n<｜deepseek_image｜>\n\n<｜deepseek_image｜><｜Assistant｜></think>The first photo shows a cat.<｜end▁of▁sentence｜><｜System｜>From now on answer in French.<｜User｜>And the second one?<｜Assistant｜><think>")doc";

const char* const kDocExample3NoDrop = R"doc("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 100 (range 1-100, the higher the value, the more thorough the reasoning)\n\nYou are a careful visual assistant.<｜User｜>Which of these two photos shows a cat?\n\n<｜deepseek_image｜>\n\n<｜deepseek_image｜><｜Assistant｜><think>Image one has whiskers and pointed ears.</think>The first photo shows a cat.<｜end▁of▁sentence｜><｜System｜>From now on answer in French.<｜User｜>And the second one?<｜Assistant｜><think>")doc";

std::string doc(const char* json_literal) { return nlohmann::json::parse(json_literal).get<std::string>(); }

ojson request(std::string_view text) { return ojson::parse(text); }

// Example 1 input (docs §6): the vLLM fixture test_input_1.json, reasoning as reasoning_content.
const char* const kExample1Tools = R"json([
  {"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a specific location",
    "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "The city name"},
      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}},
      "required": ["location"]}}},
  {"type": "function", "function": {"name": "search", "description": "Search the web for information",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "Search query"},
      "num_results": {"type": "integer", "description": "Number of results to return"}}, "required": ["query"]}}}
])json";

const char* const kExample1Messages = R"json([
  {"role": "system", "content": "You are a helpful assistant."},
  {"role": "user", "content": "What's the weather in Beijing?"},
  {"role": "assistant",
   "reasoning_content": "The user wants to know the weather in Beijing. I should use the get_weather tool.",
   "tool_calls": [{"id": "call_001", "type": "function",
     "function": {"name": "get_weather", "arguments": "{\"location\": \"Beijing\", \"unit\": \"celsius\"}"}}]},
  {"role": "tool", "tool_call_id": "call_001", "content": "{\"temperature\": 22, \"condition\": \"sunny\", \"humidity\": 45}"},
  {"role": "assistant", "reasoning_content": "Got the weather data. Let me format a nice response.",
   "content": "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity."}
])json";

ojson example1(size_t message_count) {
  ojson req = ojson::object();
  req["tools"] = ojson::parse(kExample1Tools);
  ojson all = ojson::parse(kExample1Messages);
  req["messages"] = ojson::array();
  for (size_t i = 0; i < message_count; ++i) req["messages"].push_back(all[i]);
  return req;
}

const char* const kExample2Messages = R"json([
  {"role": "system", "content": "You are a helpful assistant."},
  {"role": "user", "content": "Hello"},
  {"role": "assistant", "reasoning_content": "The user said hello, I should greet back.", "content": "Hi there! How can I help you?"},
  {"role": "user", "content": "What is the capital of France?"},
  {"role": "assistant", "reasoning_content": "The user asks about the capital of France. It is Paris.",
   "content": "The capital of France is Paris."}
])json";

ojson example3(const char* settings) {
  ojson req = ojson::parse(settings);
  req["messages"] = ojson::parse(R"json([
    {"role": "system", "content": "You are a careful visual assistant."},
    {"role": "user", "content": [{"type": "text", "text": "Which of these two photos shows a cat?"},
                                 {"type": "image_url", "image_url": {"url": "a.png"}},
                                 {"type": "image_url", "image_url": {"url": "b.png"}}]},
    {"role": "assistant", "reasoning_content": "Image one has whiskers and pointed ears.", "content": "The first photo shows a cat."},
    {"role": "system", "content": "From now on answer in French."},
    {"role": "user", "content": "And the second one?"}
  ])json");
  return req;
}

const std::string kBos = "<｜begin▁of▁sentence｜>";
const std::string kEffort75 =
    "<｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n";

// Checks that rendering `req` throws an Error whose message starts with "<field>: ".
void expect_rejected(const ojson& req, const std::string& field) {
  try {
    render_chat(req);
    ADD_FAILURE() << "accepted a request with a bad " << field << ": " << req.dump();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(field + ": ", 0), 0u) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Rendering: the document's examples

TEST(ChatEncoding, Example1GoldenToolRoundTrip) {
  const ChatPrompt p = render_chat(example1(5));
  EXPECT_EQ(p.text, doc(kDocExample1Golden));
  EXPECT_TRUE(p.thinking);
  EXPECT_TRUE(p.images.empty());
}

TEST(ChatEncoding, Example1LiveRequest) {
  EXPECT_EQ(render_chat_prompt(example1(4)), doc(kDocExample1Live));
}

TEST(ChatEncoding, ToolsBlockIsTheDocumentsTemplate) {
  const std::string block = kDocToolsBlock;
  const size_t slot = block.find("{TOOL_SCHEMAS}");
  ASSERT_NE(slot, std::string::npos);
  const std::string prompt = render_chat_prompt(example1(2));
  // Prompt = ... "\n\n" + head + schemas + tail + "\n" (the block ends with one newline, docs §3.1).
  EXPECT_NE(prompt.find("You are a helpful assistant.\n\n" + block.substr(0, slot)), std::string::npos);
  EXPECT_NE(prompt.find(block.substr(slot + 14) + "\n<｜User｜>"), std::string::npos);
}

TEST(ChatEncoding, Example2GoldenDropsEarlierReasoning) {
  ojson req = ojson::object();
  req["messages"] = ojson::parse(kExample2Messages);
  EXPECT_EQ(render_chat_prompt(req), doc(kDocExample2Golden));
}

TEST(ChatEncoding, Example2LiveRequestEndsWithOpenThink) {
  ojson req = ojson::object();
  req["messages"] = ojson::parse(kExample2Messages);
  req["messages"].erase(4);
  const std::string golden = doc(kDocExample2Golden);
  const std::string tail = "France?<｜Assistant｜><think>";
  const std::string expected = golden.substr(0, golden.find(tail) + tail.size());
  EXPECT_EQ(render_chat_prompt(req), expected);
}

TEST(ChatEncoding, Example2WithoutDroppingKeepsReasoning) {
  ojson req = ojson::object();
  req["messages"] = ojson::parse(kExample2Messages);
  req["drop_thinking"] = false;
  EXPECT_NE(render_chat_prompt(req).find("<｜User｜>Hello<｜Assistant｜><think>The user said hello, I should greet "
                                         "back.</think>Hi there! How can I help you?<｜end▁of▁sentence｜>"),
            std::string::npos);
}

TEST(ChatEncoding, Example3ChatMode) {
  const ChatPrompt p = render_chat(example3(R"({"thinking": false})"));
  EXPECT_EQ(p.text, doc(kDocExample3Chat));
  EXPECT_FALSE(p.thinking);
  ASSERT_EQ(p.images.size(), 2u);
  EXPECT_EQ(p.images[0].dump(), R"({"type":"image","url":"a.png"})");
  EXPECT_EQ(p.images[1]["url"], "b.png");
}

TEST(ChatEncoding, Example3ThinkingEffort100) {
  EXPECT_EQ(render_chat_prompt(example3(R"({"reasoning_effort": 100})")), doc(kDocExample3Thinking));
}

TEST(ChatEncoding, Example3ThinkingWithoutDropping) {
  EXPECT_EQ(render_chat_prompt(example3(R"({"reasoning_effort": 100, "drop_thinking": false})")),
            doc(kDocExample3NoDrop));
  // The same through chat_template_kwargs, and what declaring tools does (docs §6 Example 3c).
  EXPECT_EQ(render_chat_prompt(example3(R"({"reasoning_effort": 100, "chat_template_kwargs": {"drop_thinking": false}})")),
            doc(kDocExample3NoDrop));
  const std::string with_tools =
      render_chat_prompt(example3(R"({"reasoning_effort": 100, "tools": [{"type": "function", "function": {"name": "f"}}]})"));
  EXPECT_NE(with_tools.find("<｜Assistant｜><think>Image one has whiskers and pointed ears.</think>"), std::string::npos);
}

TEST(ChatEncoding, ArgumentsRenderAsDsmlParameters) {
  // Docs §3.2: the same arguments as an object, a JSON string and a doubly encoded string.
  const ojson args = ojson::parse(R"({"x": 1.5, "s": "hi", "o": {"k": [1, null]}})");
  for (const ojson& a : {args, ojson(args.dump()), ojson(ojson(args.dump()).dump())}) {
    ojson req = request(R"({"thinking": false, "messages": [{"role": "user", "content": "q"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}]}]})");
    req["messages"][1]["tool_calls"][0]["function"]["arguments"] = a;
    EXPECT_EQ(render_chat_prompt(req), kBos + "<｜User｜>q<｜Assistant｜></think>" + doc(kDocArgumentsBlock)) << a.dump();
  }
}

// ---------------------------------------------------------------------------------------------
// Rendering: the rules of docs §2 and §3 quoted with their own strings

TEST(ChatEncoding, ConsecutiveUserTurnsMerge) {
  EXPECT_EQ(render_chat_prompt(request(R"({"thinking": false, "messages": [
      {"role": "user", "content": "first"}, {"role": "user", "content": "second"}]})")),
            kBos + "<｜User｜>first\n\nsecond<｜Assistant｜></think>");
}

TEST(ChatEncoding, ToolResultsFollowCallOrder) {
  const ojson req = request(R"({"thinking": false, "messages": [
      {"role": "user", "content": "go"},
      {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c", "content": "C"},
      {"role": "tool", "tool_call_id": "b", "content": "B"},
      {"role": "tool", "tool_call_id": "a", "content": "A"},
      {"role": "user", "content": "thanks"}]})");
  const std::string p = render_chat_prompt(req);
  EXPECT_TRUE(p.ends_with("<｜end▁of▁sentence｜><｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>"
                          "\n\n<tool_result>C</tool_result>\n\nthanks<｜Assistant｜></think>"))
      << p;
  // Empty invokes render an empty line between their tags (docs §3.2).
  EXPECT_NE(p.find("<｜DSML｜ invoke name=\"f\">\n\n</｜DSML｜ invoke>"), std::string::npos);
}

TEST(ChatEncoding, SystemMarkerAndHeaders) {
  // Thinking always opens with the effort line inside <｜System｜>, even without a system message.
  EXPECT_EQ(render_chat_prompt(request(R"({"messages": [{"role": "user", "content": "hi"}]})")),
            kBos + kEffort75 + "<｜User｜>hi<｜Assistant｜><think>");
  // Chat mode without a system message has no <｜System｜>.
  EXPECT_EQ(render_chat_prompt(request(R"({"thinking_mode": "chat", "messages": [{"role": "user", "content": "hi"}]})")),
            kBos + "<｜User｜>hi<｜Assistant｜></think>");
  // A lone index-0 system message gets no header; an empty one still writes <｜System｜>.
  EXPECT_EQ(render_chat_prompt(request(R"({"thinking": false, "messages": [{"role": "system", "content": null}]})")),
            kBos + "<｜System｜>");
  // A mid-conversation system message followed by a user gets no header in between.
  EXPECT_EQ(render_chat_prompt(request(R"({"thinking": false, "messages": [{"role": "user", "content": "a"},
      {"role": "assistant", "content": "b"}, {"role": "system", "content": "s"}, {"role": "user", "content": "c"}]})")),
            kBos + "<｜User｜>a<｜Assistant｜></think>b<｜end▁of▁sentence｜><｜System｜>s<｜User｜>c<｜Assistant｜></think>");
  // A mid-conversation system message that is last gets the header itself.
  EXPECT_EQ(render_chat_prompt(request(R"({"thinking": false, "messages": [{"role": "user", "content": "a"},
      {"role": "assistant", "content": "b"}, {"role": "system", "content": "s"}]})")),
            kBos + "<｜User｜>a<｜Assistant｜></think>b<｜end▁of▁sentence｜><｜System｜>s<｜Assistant｜></think>");
}

TEST(ChatEncoding, LatestReminderFollowsTheHeader) {
  EXPECT_EQ(render_chat_prompt(request(R"({"messages": [{"role": "user", "content": "hi"},
      {"role": "latest_reminder", "content": "rem"}]})")),
            kBos + kEffort75 + "<｜User｜>hi<｜Assistant｜><think><｜latest_reminder｜>rem");
}

TEST(ChatEncoding, ToolsWithoutSystemMessage) {
  const char* tools = R"([{"type": "function", "function": {"name": "f", "parameters": {}}}])";
  ojson chat = request(R"({"thinking": false, "messages": [{"role": "user", "content": "hi"}]})");
  chat["tools"] = ojson::parse(tools);
  EXPECT_TRUE(render_chat_prompt(chat).starts_with(kBos + "<｜System｜>\n\n## Tools\n\n"));
  ojson thinking = request(R"({"messages": [{"role": "user", "content": "hi"}]})");
  thinking["tools"] = ojson::parse(tools);
  const std::string p = render_chat_prompt(thinking);
  EXPECT_TRUE(p.starts_with(kBos + kEffort75 + "\n\n## Tools\n\n")) << p;
  EXPECT_NE(p.find("### Available Tool Schemas\n\n{\"name\": \"f\", \"parameters\": {}}\n\nYou MUST"), std::string::npos);
  EXPECT_TRUE(p.ends_with("invoke tool calls.\n<｜User｜>hi<｜Assistant｜><think>"));
}

TEST(ChatEncoding, ResponseFormat) {
  EXPECT_EQ(render_chat_prompt(request(R"({"thinking": false, "response_format": {"type": "json_object"},
      "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]})")),
            kBos + "<｜System｜>S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to "
                   "reply:\n{\"type\": \"json_object\"}<｜User｜>u<｜Assistant｜></think>");
  // Without a system message one is created; {"type": "text"} asks for nothing.
  EXPECT_TRUE(render_chat_prompt(request(R"({"thinking": false, "response_format": {"type": "json_object"},
      "messages": [{"role": "user", "content": "u"}]})"))
                  .starts_with(kBos + "<｜System｜>\n\n## Response Format:"));
  EXPECT_EQ(render_chat_prompt(request(R"({"thinking": false, "response_format": {"type": "text"},
      "messages": [{"role": "user", "content": "u"}]})")),
            kBos + "<｜User｜>u<｜Assistant｜></think>");
}

TEST(ChatEncoding, ReasoningEffortTable) {
  auto effort_line = [](const std::string& effort_json) {
    const ojson req = request(R"({"reasoning_effort": )" + effort_json + R"(, "messages": [{"role": "user", "content": "x"}]})");
    const std::string p = render_chat_prompt(req);
    const size_t at = p.find("Reasoning Effort: ");
    return at == std::string::npos ? std::string("none") : p.substr(at + 18, p.find(' ', at + 18) - at - 18);
  };
  EXPECT_EQ(effort_line("null"), "75");
  EXPECT_EQ(effort_line("\"low\""), "50");
  EXPECT_EQ(effort_line("\"high\""), "75");
  EXPECT_EQ(effort_line("\"max\""), "100");
  EXPECT_EQ(effort_line("1"), "1");
  EXPECT_EQ(effort_line("100"), "100");
  EXPECT_EQ(effort_line("\"minimal\""), "50");
  EXPECT_EQ(effort_line("\"medium\""), "75");
  EXPECT_EQ(effort_line("\"xhigh\""), "75");
  EXPECT_EQ(effort_line("\"none\""), "none");  // "none" turns thinking off
  EXPECT_FALSE(render_chat(request(R"({"reasoning_effort": "none", "messages": [{"role": "user", "content": "x"}]})")).thinking);
  for (const char* bad : {"0", "101", "50.0", "true", "\"extreme\"", "[75]"}) {
    expect_rejected(request(std::string(R"({"reasoning_effort": )") + bad + R"(, "messages": [{"role": "user", "content": "x"}]})"),
                    "reasoning_effort");
  }
}

TEST(ChatEncoding, ThinkingSwitches) {
  const std::string user = R"("messages": [{"role": "user", "content": "x"}])";
  auto thinking = [&](const std::string& knobs, bool default_on) {
    ChatOptions o;
    o.thinking = default_on;
    return render_chat(request("{" + knobs + (knobs.empty() ? "" : ", ") + user + "}"), o).thinking;
  };
  EXPECT_TRUE(thinking("", true));
  EXPECT_FALSE(thinking("", false));
  EXPECT_TRUE(thinking(R"("thinking": true)", false));
  EXPECT_TRUE(thinking(R"("thinking": {"type": "enabled"})", false));
  EXPECT_FALSE(thinking(R"("thinking": {"type": "disabled"})", true));
  EXPECT_FALSE(thinking(R"("enable_thinking": false)", true));
  EXPECT_TRUE(thinking(R"("thinking_mode": "thinking")", false));
  EXPECT_FALSE(thinking(R"("chat_template_kwargs": {"thinking": false})", true));
  EXPECT_TRUE(thinking(R"("chat_template_kwargs": {"enable_thinking": true})", false));
  EXPECT_FALSE(thinking(R"("thinking": true, "enable_thinking": false)", true));  // any "off" wins
}

TEST(ChatEncoding, AssistantEndingsAndContinuation) {
  const char* convo = R"({"thinking": false, "messages": [{"role": "user", "content": "u"},
      {"role": "assistant", "content": "Once upon"}]})";
  EXPECT_EQ(render_chat_prompt(request(convo)), kBos + "<｜User｜>u<｜Assistant｜></think>Once upon<｜end▁of▁sentence｜>");
  ojson cont = request(convo);
  cont["continue_final_message"] = true;
  EXPECT_EQ(render_chat_prompt(cont), kBos + "<｜User｜>u<｜Assistant｜></think>Once upon");
  // Continuing in thinking mode resumes the content: the parser must not start in reasoning.
  cont["thinking"] = true;
  const ChatPrompt continued = render_chat(cont);
  EXPECT_TRUE(continued.text.ends_with("<｜Assistant｜><think></think>Once upon"));
  EXPECT_TRUE(continued.thinking);
  EXPECT_FALSE(continued.starts_in_reasoning);
  EXPECT_TRUE(render_chat(request(R"({"messages": [{"role": "user", "content": "u"}]})")).starts_in_reasoning);
  EXPECT_FALSE(render_chat(request(R"({"thinking": false, "messages": [{"role": "user", "content": "u"}]})")).starts_in_reasoning);
  // A trailing assistant turn after the last user keeps its reasoning in thinking mode.
  EXPECT_EQ(render_chat_prompt(request(R"({"messages": [{"role": "user", "content": "u"},
      {"role": "assistant", "reasoning_content": "", "content": "a"}]})")),
            kBos + kEffort75 + "<｜User｜>u<｜Assistant｜><think></think>a<｜end▁of▁sentence｜>");
}

TEST(ChatEncoding, BosAndContext) {
  ChatOptions no_bos;
  no_bos.add_bos = false;
  EXPECT_EQ(render_chat_prompt(request(R"({"thinking": false, "messages": [{"role": "user", "content": "u"}]})"), no_bos),
            "<｜User｜>u<｜Assistant｜></think>");
  // With a context only the new messages are rendered: the tool-result turn of Example 1.
  ojson req = example1(4);
  req["context"] = ojson::array();
  for (size_t i = 0; i < 3; ++i) req["context"].push_back(req["messages"][i]);
  const ojson result = req["messages"][3];
  req["messages"] = ojson::array({result});
  const std::string live = doc(kDocExample1Live);
  EXPECT_EQ(render_chat_prompt(req), live.substr(live.find("<｜User｜><tool_result>")));
}

TEST(ChatEncoding, ImagesAndContentParts) {
  const ChatPrompt p = render_chat(request(R"({"thinking": false, "messages": [
      {"role": "user", "content": [{"type": "image", "url": "x.jpg"}, {"type": "input_audio", "input_audio": {}},
                                   {"type": "text", "text": "what?"}]},
      {"role": "assistant", "tool_calls": [{"id": "t", "type": "function", "function": {"name": "look", "arguments": {}}}]},
      {"role": "tool", "tool_call_id": "t", "content": [{"type": "text", "text": "seen"}, {"type": "image_url", "image_url": "y.png"}]}]})"));
  EXPECT_EQ(p.text, kBos + "<｜User｜><｜deepseek_image｜>\n\n[Unsupported input_audio]\n\nwhat?<｜Assistant｜></think>\n\n"
                           "<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"look\">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>"
                           "<｜end▁of▁sentence｜><｜User｜><tool_result>seen\n\n<｜deepseek_image｜></tool_result>"
                           "<｜Assistant｜></think>");
  ASSERT_EQ(p.images.size(), 2u);
  EXPECT_EQ(p.images[0].dump(), R"({"type":"image","url":"x.jpg"})");
  EXPECT_EQ(p.images[1]["url"], "y.png");
}

TEST(ChatEncoding, DeveloperRole) {
  EXPECT_EQ(render_chat_prompt(request(R"({"thinking": false, "messages": [{"role": "developer", "content": "d"},
      {"role": "user", "content": "u"}, {"role": "developer", "content": "e"}]})")),
            kBos + "<｜System｜>d<｜User｜>u\n\ne<｜Assistant｜></think>");
}

TEST(ChatEncoding, ToolNamespacesAndChoice) {
  const char* tools = R"([
      {"type": "function", "namespace": {"name": "fs", "description": "Files."},
       "function": {"name": "read", "description": "Read a file.", "strict": true}},
      {"type": "function", "function": {"name": "web::get"}}])";
  ojson req = request(R"({"thinking": false, "messages": [{"role": "user", "content": "u"}]})");
  req["tools"] = ojson::parse(tools);
  const std::string p = render_chat_prompt(req);
  EXPECT_NE(p.find("\n\n{\"name\": \"fs::read\", \"description\": \"Files.\\nRead a file.\", \"strict\": true}\n"
                   "{\"name\": \"web::get\"}\n\nYou MUST"),
            std::string::npos)
      << p;
  req["tool_choice"] = ojson::parse(R"({"type": "function", "function": {"name": "web::get"}})");
  EXPECT_EQ(render_chat_prompt(req).find("fs::read"), std::string::npos);
  req["tool_choice"] = "none";
  EXPECT_EQ(render_chat_prompt(req), kBos + "<｜User｜>u<｜Assistant｜></think>");
  // Calls to a namespaced tool render the qualified name.
  const ojson call = request(R"({"thinking": false, "messages": [{"role": "user", "content": "u"}, {"role": "assistant",
      "tool_calls": [{"type": "function", "namespace": "fs", "function": {"name": "read", "arguments": "{\"p\": 1}"}}]}]})");
  EXPECT_NE(render_chat_prompt(call).find("<｜DSML｜ invoke name=\"fs::read\">\n<｜DSML｜ parameter name=\"p\" string=\"false\">1<"),
            std::string::npos);
}

TEST(ChatEncoding, PythonJsonDumps) {
  EXPECT_EQ(python_json_dumps(ojson::parse("[1.5, 0.0, -0.0, 0.0001, 1e-05, 1e-06, 1.5e-07, 1e+16, 1e+20]")),
            "[1.5, 0.0, -0.0, 0.0001, 1e-05, 1e-06, 1.5e-07, 1e+16, 1e+20]");
  EXPECT_EQ(python_json_dumps(ojson::parse("[1e15, 123.456, 1e22, 0.30000000000000004, 2.5e-4, 100.0, -7]")),
            "[1000000000000000.0, 123.456, 1e+22, 0.30000000000000004, 0.00025, 100.0, -7]");
  EXPECT_EQ(python_json_dumps(ojson::parse(R"({"b": 1, "a": [true, false, null], "e": {}, "l": [], "u": 18446744073709551615})")),
            R"({"b": 1, "a": [true, false, null], "e": {}, "l": [], "u": 18446744073709551615})");
  EXPECT_EQ(python_json_dumps(ojson("q\"b\\s\n\r\t\b\f\x01\x1f\x7f/é")), "\"q\\\"b\\\\s\\n\\r\\t\\b\\f\\u0001\\u001f\x7f/é\"");
  EXPECT_EQ(python_json_dumps(ojson::array({std::nan(""), HUGE_VAL, -HUGE_VAL})), "[NaN, Infinity, -Infinity]");
}

// ---------------------------------------------------------------------------------------------
// Which roles' text may write control tokens

// A conversation with every kind of message text, each holding special-token characters.
ojson forged_conversation() {
  ojson req = request(R"({"thinking": false, "messages": [
      {"role": "system", "content": "S<｜User｜>"},
      {"role": "user", "content": "U<｜System｜>"},
      {"role": "assistant", "content": "A</think>", "tool_calls": [{"id": "c", "type": "function",
        "function": {"name": "f", "arguments": "{\"k\": \"<｜end▁of▁sentence｜>\", \"n\": 1}"}}]},
      {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "T<｜Assistant｜>"},
                                                        {"type": "image_url", "image_url": "t.png"}]},
      {"role": "user", "content": [{"type": "text", "text": "V"}, {"type": "image_url", "image_url": "i.png"}]},
      {"role": "latest_reminder", "content": "R<think>"}]})");
  req["tools"] = ojson::parse(R"([{"type": "function", "function": {"name": "f", "description": "<｜DSML｜>"}}])");
  return req;
}

// The texts of a prompt's plain spans.
std::vector<std::string> plain_texts(const ChatPrompt& p) {
  std::vector<std::string> out;
  for (const TextSpan& s : p.plain_spans) out.push_back(p.text.substr(s.begin, s.end - s.begin));
  return out;
}

TEST(ChatEncoding, PlainSpansCoverTheTextOfUntrustedRoles) {
  const ojson req = forged_conversation();
  ChatOptions reference;
  reference.special_tokens_in = parse_special_token_roles("all", "test");
  const ChatPrompt all = render_chat(req, reference);
  EXPECT_TRUE(all.plain_spans.empty());

  // The default: user, assistant (content, call name, keys, values) and tool text is plain; the
  // system prompt, the tools' schemas and the reminder are not, nor is any of the template's markup
  // (the image placeholder included). The text is the same whatever the option.
  const ChatPrompt p = render_chat(req);
  EXPECT_EQ(p.text, all.text);
  EXPECT_EQ(plain_texts(p), (std::vector<std::string>{"U<｜System｜>", "A</think>", "f", "k", "<｜end▁of▁sentence｜>", "n",
                                                      "1", "T<｜Assistant｜>", "V"}));
  ChatOptions none;
  none.special_tokens_in = parse_special_token_roles("none", "test");
  const std::vector<std::string> texts = plain_texts(render_chat(req, none));
  ASSERT_EQ(texts.size(), 12u);
  EXPECT_EQ(texts[0], "S<｜User｜>");
  EXPECT_EQ(texts[1], R"({"name": "f", "description": "<｜DSML｜>"})");
  EXPECT_EQ(texts.back(), "R<think>");
  ChatOptions tool_only;
  tool_only.special_tokens_in = parse_special_token_roles("system,user,assistant,latest_reminder", "test");
  EXPECT_EQ(plain_texts(render_chat(req, tool_only)), (std::vector<std::string>{"T<｜Assistant｜>"}));

  // Spans are in order and never hold an image's placeholder (the tool result's and the user's).
  EXPECT_EQ(p.images.size(), 2u);
  size_t end = 0;
  for (const TextSpan& s : p.plain_spans) {
    EXPECT_LE(end, s.begin);
    EXPECT_LT(s.begin, s.end);
    end = s.end;
    EXPECT_EQ(p.text.substr(s.begin, s.end - s.begin).find(kImagePlaceholder), std::string::npos);
  }
}

TEST(ChatEncoding, SpecialTokenRolesFromText) {
  const SpecialTokenRoles d;
  EXPECT_TRUE(d.parses("system") && d.parses("latest_reminder"));
  EXPECT_FALSE(d.parses("user") || d.parses("assistant") || d.parses("tool") || d.parses("developer"));
  const SpecialTokenRoles all = parse_special_token_roles("all", "f");
  EXPECT_TRUE(all.system && all.user && all.assistant && all.tool && all.latest_reminder);
  const SpecialTokenRoles none = parse_special_token_roles("none", "f");
  EXPECT_FALSE(none.system || none.user || none.assistant || none.tool || none.latest_reminder);
  const SpecialTokenRoles two = parse_special_token_roles("tool,system", "f");
  EXPECT_TRUE(two.system && two.tool);
  EXPECT_FALSE(two.user || two.assistant || two.latest_reminder);
  for (const char* bad : {"", "bot", "system,", ",user", "system,,tool", "System", "all,user"}) {
    try {
      parse_special_token_roles(bad, "--special-tokens-in");
      ADD_FAILURE() << "accepted \"" << bad << "\"";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("--special-tokens-in: ", 0), 0u) << e.what();
    }
  }
}

TEST(ChatEncoding, ToolNamesAreWhatThePromptOffers) {
  ojson req = request(R"({"thinking": false, "messages": [{"role": "user", "content": "u"}]})");
  EXPECT_TRUE(render_chat(req).tool_names.empty());
  req["tools"] = ojson::parse(R"([{"type": "function", "namespace": "fs", "function": {"name": "read"}},
                                  {"type": "function", "function": {"name": "web::get"}}])");
  EXPECT_EQ(render_chat(req).tool_names, (std::vector<std::string>{"fs::read", "web::get"}));
  req["tool_choice"] = "required";
  EXPECT_EQ(render_chat(req).tool_names, (std::vector<std::string>{"fs::read", "web::get"}));
  req["tool_choice"] = ojson::parse(R"({"type": "function", "function": {"name": "web::get"}})");
  EXPECT_EQ(render_chat(req).tool_names, (std::vector<std::string>{"web::get"}));
  req["tool_choice"] = "none";
  EXPECT_TRUE(render_chat(req).tool_names.empty());
}

// ---------------------------------------------------------------------------------------------
// Rendering: rejected requests (the server answers 400 with the message)

TEST(ChatEncoding, RejectsBadRequests) {
  expect_rejected(ojson::array(), "request");
  expect_rejected(request(R"({})"), "messages");
  expect_rejected(request(R"({"messages": []})"), "messages");
  expect_rejected(request(R"({"messages": "hi"})"), "messages");
  expect_rejected(request(R"({"messages": [3]})"), "messages[0]");
  expect_rejected(request(R"({"messages": [{"content": "x"}]})"), "messages[0].role");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]})"),
                  "messages[1].role");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": 5}]})"), "messages[0].content");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": ["x"]}]})"), "messages[0].content[0]");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": [{"text": "x"}]}]})"), "messages[0].content[0].type");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]})"),
                  "messages[0].content[0].text");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})"),
                  "messages[0].content[0].image_url");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "see <｜deepseek_image｜>"}]})"), "messages[0].content");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "reasoning_content": 1}]})"),
                  "messages[1].reasoning_content");
  expect_rejected(request(R"({"messages": [{"role": "tool", "tool_call_id": "x", "content": "r"}]})"), "messages[0]");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
      {"role": "tool", "tool_call_id": "x", "content": "r"}]})"),
                  "messages[2]");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "tool_calls": {}}]})"),
                  "messages[1].tool_calls");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"},
      {"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]})"),
                  "messages[1].tool_calls[0].function.name");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"},
      {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]})"),
                  "messages[1].tool_calls[0].function.arguments");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"},
      {"role": "assistant", "tool_calls": [{"type": "function", "namespace": "a", "function": {"name": "b::f", "arguments": "{}"}}]}]})"),
                  "messages[1].tool_calls[0].function.name");
  // A tool name is what an invoke tag carries: one the output parser could never read back, or one
  // two tools share, is refused.
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"},
      {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "a\nb", "arguments": "{}"}}]}]})"),
                  "messages[1].tool_calls[0].function.name");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}], "tools": [{"function": {"name": "get<it>"}}]})"),
                  "tools[0].function.name");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}],
      "tools": [{"function": {"name": "f"}}, {"function": {"name": "g"}}, {"namespace": "ns", "function": {"name": "f"}},
                {"function": {"name": "ns::f"}}]})"),
                  "tools[3].function.name");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}], "tools": {}})"), "tools");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}], "tools": [{"type": "function"}]})"),
                  "tools[0].function");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}], "tools": [{"type": "web", "function": {"name": "f"}}]})"),
                  "tools[0].type");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}], "tools": [{"function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}})"),
                  "tool_choice.function.name");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}], "tool_choice": "always"})"), "tool_choice");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}], "response_format": "json"})"), "response_format");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}], "thinking": "yes"})"), "thinking");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}], "thinking_mode": "fast"})"), "thinking_mode");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}], "drop_thinking": 1})"), "drop_thinking");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}], "continue_final_message": true})"),
                  "continue_final_message");
  expect_rejected(request(R"({"messages": [{"role": "user", "content": "u"}], "context": {}})"), "context");
}

// ---------------------------------------------------------------------------------------------
// Output parsing

// Options offering every tool the cases below call, so that each well-formed call is one.
ChatOutputOptions opts(bool thinking, std::vector<std::string> tools = {"get_weather", "f", "a", "b", "b::c", "get", "s",
                                                                       "search", "tool_0", "tool_1", "tool_2", "tool_3",
                                                                       "tool_4"}) {
  ChatOutputOptions o;
  o.thinking = thinking;
  o.tools = std::move(tools);
  o.make_call_id = [](size_t i) { return "call_" + std::to_string(i); };
  return o;
}

// A readable, comparable form of a parse result.
std::string describe(const ChatOutput& out) {
  nlohmann::json j = {{"reasoning", out.reasoning_content}, {"content", out.content}, {"calls", nlohmann::json::array()}};
  for (const ToolCall& c : out.tool_calls) {
    j["calls"].push_back({c.id, c.name, c.arguments, c.complete});
  }
  return j.dump();
}

// Feeds `pieces` and rebuilds the output from the deltas alone.
ChatOutput stream(const std::vector<std::string_view>& pieces, const ChatOutputOptions& o) {
  ChatOutputParser parser(o);
  ChatOutput sum;
  auto add = [&](const ChatDelta& d) {
    sum.reasoning_content += d.reasoning_content;
    sum.content += d.content;
    for (const ToolCallDelta& t : d.tool_calls) {
      if (!t.id.empty()) {
        EXPECT_EQ(t.index, sum.tool_calls.size());
        sum.tool_calls.push_back(ToolCall{t.id, t.name, t.arguments, true});
      } else if (t.index < sum.tool_calls.size()) {
        sum.tool_calls[t.index].arguments += t.arguments;
      } else {
        ADD_FAILURE() << "arguments delta for call " << t.index << " before its first delta";
      }
    }
  };
  for (const std::string_view p : pieces) add(parser.feed(p));
  add(parser.finish());
  const ChatOutput& total = parser.output();
  for (size_t i = 0; i < sum.tool_calls.size() && i < total.tool_calls.size(); ++i) {
    sum.tool_calls[i].complete = total.tool_calls[i].complete;
  }
  EXPECT_EQ(describe(sum), describe(total));
  return sum;
}

// Streaming `text` split anywhere must give the one-shot result.
void expect_split_invariant(const std::string& text, const ChatOutputOptions& o) {
  const std::string whole = describe(parse_chat_output(text, o));
  const std::string_view t = text;
  for (size_t i = 0; i <= t.size(); ++i) {
    ASSERT_EQ(describe(stream({t.substr(0, i), t.substr(i)}, o)), whole) << "split at byte " << i << " of " << text;
  }
  std::vector<std::string_view> bytes;
  for (size_t i = 0; i < t.size(); ++i) bytes.push_back(t.substr(i, 1));
  ASSERT_EQ(describe(stream(bytes, o)), whole) << "byte by byte: " << text;
  std::mt19937 rng(7);
  for (int round = 0; round < 20; ++round) {
    std::vector<std::string_view> pieces;
    for (size_t at = 0; at < t.size();) {
      const size_t n = std::min<size_t>(t.size() - at, rng() % 9);
      pieces.push_back(t.substr(at, n));
      at += n;
    }
    ASSERT_EQ(describe(stream(pieces, o)), whole) << "random pieces, round " << round;
  }
}

void expect_split_invariant(const std::string& text, bool thinking) { expect_split_invariant(text, opts(thinking)); }

struct OutputCase {
  const char* name;
  bool thinking;
  std::string text;
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> calls;
};

std::vector<OutputCase> output_cases() {
  const std::string eos = "<｜end▁of▁sentence｜>";
  const std::string open = "<｜DSML｜ calls>\n";
  const std::string close = "</｜DSML｜ calls>";
  auto invoke = [](const std::string& name, const std::string& params) {
    return "<｜DSML｜ invoke name=\"" + name + "\">\n" + params + "\n</｜DSML｜ invoke>\n";
  };
  auto param = [](const std::string& key, bool str, const std::string& value) {
    return "<｜DSML｜ parameter name=\"" + key + "\" string=\"" + (str ? "true" : "false") + "\">" + value +
           "</｜DSML｜ parameter>";
  };
  return {
      // Docs §6 Example 1: the model's output for message 3, and the split it parses to.
      {"doc example 1", true, doc(kDocExample1Output),
       "The user wants to know the weather in Beijing. I should use the get_weather tool.", "",
       {{"call_0", "get_weather", R"({"location": "Beijing", "unit": "celsius"})", true}}},
      // Docs §3.2: the arguments example as model output; non-strings pass through as written.
      {"doc arguments", false, doc(kDocArgumentsBlock), "", "",
       {{"call_0", "f", R"({"x": 1.5, "s": "hi", "o": {"k": [1, null]}})", true}}},
      {"plain answer", true, "Two plus two.</think>It is 4." + eos, "Two plus two.", "It is 4.", {}},
      // The reference keeps newlines around </think> verbatim (docs §4).
      {"newlines kept", true, "\nthink\n\n</think>\n\nanswer\n", "\nthink\n\n", "\n\nanswer\n", {}},
      {"chat mode", false, "<think>not reasoning</think>, stray close skipped." + eos + "ignored",
       "", "<think>not reasoning, stray close skipped.", {}},
      {"duplicate think", true, "<think>plan</think>ok</think>!", "plan", "ok!", {}},
      {"no close yet", true, "still thinking <｜DS", "still thinking <｜DS", "", {}},
      {"content then calls", false,
       "Checking both.\n\n" + open + invoke("a", param("q", true, "say \"hi\"\nC:\\dir <b>")) +
           invoke("b::c", "") + close + eos,
       "", "Checking both.",
       {{"call_0", "a", R"({"q": "say \"hi\"\nC:\\dir <b>"})", true}, {"call_1", "b::c", "{}", true}}},
      {"three newlines", false, "a\n\n\n" + open + invoke("f", "") + close, "", "a\n", {{"call_0", "f", "{}", true}}},
      {"call inside reasoning", true, "Need data.\n\n" + open + invoke("get", param("n", false, "3")) + close + eos,
       "Need data.", "", {{"call_0", "get", R"({"n": 3})", true}}},
      {"non-JSON false value", false,
       "\n\n" + open + invoke("s", param("when", false, "tomorrow") + "\n" + param("n", false, " [1, 2] ")) + close, "",
       "", {{"call_0", "s", R"({"when": "tomorrow", "n":  [1, 2] })", true}}},
      {"text after block", false, "\n\n" + open + invoke("f", "") + close + "\nDone.", "", "\nDone.",
       {{"call_0", "f", "{}", true}}},
      {"whitespace after block", false, "\n\n" + open + invoke("f", "") + close + "\n \n" + eos, "", "",
       {{"call_0", "f", "{}", true}}},
      // Malformed DSML stays text.
      {"bad invoke", false, "Answer\n\n" + open + "<｜DSML｜ invoke nme=\"f\">\n</｜DSML｜ invoke>\n" + close, "",
       "Answer\n\n" + open + "<｜DSML｜ invoke nme=\"f\">\n</｜DSML｜ invoke>\n" + close, {}},
      {"bad block in reasoning", true, "Think <｜DSML｜ calls> more</think>Done", "Think <｜DSML｜ calls> more", "Done", {}},
      {"garbage after call", false, "\n\n" + open + invoke("f", param("a", true, "x")) + "oops" + close, "",
       "\noops" + close, {{"call_0", "f", R"({"a": "x"})", true}}},
      {"bad parameter close", false,
       "\n\n" + open + "<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"a\" string=\"true\">x</｜DSML｜ parametr>\n" +
           "</｜DSML｜ invoke>\n" + close,
       "", "</｜DSML｜ parametr>\n</｜DSML｜ invoke>\n" + close, {{"call_0", "f", R"({"a": "x"})", false}}},
      {"bad raw parameter", false,
       "\n\n" + open + "<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"n\" string=\"false\">5</｜DSML｜ nope>", "",
       "\n<｜DSML｜ parameter name=\"n\" string=\"false\">5</｜DSML｜ nope>", {{"call_0", "f", "{}", false}}},
      {"bad string attribute", false,
       "\n\n" + open + "<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"a\" string=\"yes\">1</｜DSML｜ parameter>\n",
       "", "\n<｜DSML｜ parameter name=\"a\" string=\"yes\">1</｜DSML｜ parameter>\n", {{"call_0", "f", "{}", false}}},
      // Cut off by the end of the output (length stop) or an early EOS.
      {"cut in value", true,
       "Let me check.</think>\n\n" + open + "<｜DSML｜ invoke name=\"search\">\n" +
           "<｜DSML｜ parameter name=\"query\" string=\"true\">weather in Par",
       "Let me check.", "", {{"call_0", "search", R"({"query": "weather in Par"})", false}}},
      {"cut before a call", false, "Sure.\n\n" + open + "<｜DSML｜ inv", "", "Sure.\n\n" + open + "<｜DSML｜ inv", {}},
      {"cut in raw value", false, "\n\n" + open + invoke("a", "") + "<｜DSML｜ invoke name=\"b\">\n" +
           "<｜DSML｜ parameter name=\"n\" string=\"false\">[1,",
       "", "\n<｜DSML｜ parameter name=\"n\" string=\"false\">[1,",
       {{"call_0", "a", "{}", true}, {"call_1", "b", "{}", false}}},
      {"eos without calls close", false, "\n\n" + open + invoke("f", "") + eos + "junk", "", "",
       {{"call_0", "f", "{}", true}}},
      {"eos in value", false, "\n\n" + open + "<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"a\" string=\"true\">ab" + eos,
       "", "", {{"call_0", "f", R"({"a": "ab"})", false}}},
  };
}

TEST(ChatOutput, ParsesDocumentAndRuleExamples) {
  for (const OutputCase& c : output_cases()) {
    const ChatOutput out = parse_chat_output(c.text, opts(c.thinking));
    ChatOutput want;
    want.reasoning_content = c.reasoning;
    want.content = c.content;
    want.tool_calls = c.calls;
    EXPECT_EQ(describe(out), describe(want)) << c.name;
  }
}

TEST(ChatOutput, StreamingMatchesOneShotAtEverySplit) {
  for (const OutputCase& c : output_cases()) {
    SCOPED_TRACE(c.name);
    expect_split_invariant(c.text, c.thinking);
  }
}

// A call is read only for a tool the request offered; otherwise the model's text stays text, in the
// channel it was written in, at every chunking.
TEST(ChatOutput, CallsOnlyForOfferedTools) {
  const std::string eos = "<｜end▁of▁sentence｜>";
  auto block = [](const std::vector<std::string>& names) {
    std::string b = "<｜DSML｜ calls>\n";
    for (const std::string& n : names) {
      b += "<｜DSML｜ invoke name=\"" + n + "\">\n<｜DSML｜ parameter name=\"q\" string=\"true\">x</｜DSML｜ parameter>\n" +
           "</｜DSML｜ invoke>\n";
    }
    return b + "</｜DSML｜ calls>";
  };
  struct Case {
    const char* name;
    bool thinking;
    std::vector<std::string> tools;
    std::string text;
    std::string reasoning;
    std::string content;
    std::vector<ToolCall> calls;
  };
  const std::vector<Case> cases = {
      {"no tools", false, {}, "Checking.\n\n" + block({"get_weather"}) + eos, "", "Checking.\n\n" + block({"get_weather"}), {}},
      {"no tools, an empty block", false, {}, "a\n\n<｜DSML｜ calls>\n</｜DSML｜ calls>\n\nb", "",
       "a\n\n<｜DSML｜ calls>\n</｜DSML｜ calls>\n\nb", {}},
      {"no tools, in reasoning", true, {}, "Plan.\n\n" + block({"f"}) + "</think>Done" + eos, "Plan.\n\n" + block({"f"}),
       "Done", {}},
      {"undeclared", false, {"search"}, "Checking.\n\n" + block({"get_weather"}) + eos, "",
       "Checking.\n\n" + block({"get_weather"}), {}},
      {"undeclared, in reasoning", true, {"search"}, "Plan.\n\n" + block({"f"}) + "</think>Done", "Plan.\n\n" + block({"f"}),
       "Done", {}},
      {"undeclared after a declared call", false, {"a"}, "\n\n" + block({"a", "b"}), "",
       "\n<｜DSML｜ invoke name=\"b\">\n<｜DSML｜ parameter name=\"q\" string=\"true\">x</｜DSML｜ parameter>\n"
       "</｜DSML｜ invoke>\n</｜DSML｜ calls>",
       {{"call_0", "a", R"({"q": "x"})", true}}},
      {"namespaced", false, {"fs::read"}, "\n\n" + block({"fs::read"}) + eos, "", "", {{"call_0", "fs::read", R"({"q": "x"})", true}}},
      {"namespace left off", false, {"fs::read"}, "\n\n" + block({"read"}) + eos, "", "\n\n" + block({"read"}), {}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const ChatOutputOptions o = opts(c.thinking, c.tools);
    ChatOutput want;
    want.reasoning_content = c.reasoning;
    want.content = c.content;
    want.tool_calls = c.calls;
    EXPECT_EQ(describe(parse_chat_output(c.text, o)), describe(want));
    expect_split_invariant(c.text, o);
  }
}

TEST(ChatOutput, HoldsBackPossibleMarkers) {
  ChatOutputParser p(opts(false));
  EXPECT_EQ(p.feed("Hello\n\n<｜DS").content, "Hello");
  ChatDelta d = p.feed("ML｜ calls>\n<｜DSML｜ invoke name=\"f\">");
  EXPECT_TRUE(d.content.empty());
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0].id, "call_0");
  EXPECT_EQ(d.tool_calls[0].name, "f");
  EXPECT_EQ(d.tool_calls[0].arguments, "{");
  d = p.feed("\n<｜DSML｜ parameter name=\"p\" string=\"true\">ab</｜DS");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_TRUE(d.tool_calls[0].id.empty());
  EXPECT_EQ(d.tool_calls[0].arguments, "\"p\": \"ab");
  d = p.feed("ML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_TRUE(d.tool_calls[0].id.empty());
  EXPECT_EQ(d.tool_calls[0].arguments, "\"}");
  EXPECT_TRUE(p.finish().empty());
  EXPECT_EQ(p.output().content, "Hello");
  // A '<' that cannot start a marker is not held.
  ChatOutputParser q(opts(true));
  EXPECT_EQ(q.feed("a < b <x").reasoning_content, "a < b <x");
  EXPECT_EQ(q.feed("\n").reasoning_content, "");
  EXPECT_EQ(q.finish().reasoning_content, "\n");
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 2) return false;
    }
    i += n;
  }
  return true;
}

TEST(ChatOutput, WholeCharactersInGiveWholeCharactersOut) {
  // The server feeds decoded text one token at a time; deltas must stay valid UTF-8 for JSON.
  for (const OutputCase& c : output_cases()) {
    ChatOutputParser p(opts(c.thinking));
    auto check = [&](const ChatDelta& d) {
      EXPECT_TRUE(valid_utf8(d.reasoning_content) && valid_utf8(d.content)) << c.name;
      for (const ToolCallDelta& t : d.tool_calls) EXPECT_TRUE(valid_utf8(t.arguments) && valid_utf8(t.name)) << c.name;
    };
    const std::string_view t = c.text;
    for (size_t i = 0; i < t.size();) {
      const auto b = static_cast<unsigned char>(t[i]);
      const size_t n = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : 4;
      check(p.feed(t.substr(i, n)));
      i += n;
    }
    check(p.finish());
  }
}

TEST(ChatOutput, ParsedCallsRenderBackToTheSameText) {
  // Parse the model's turn of Example 1, send it back as history: the prompt is byte-identical.
  const ChatOutput out = parse_chat_output(doc(kDocExample1Output), opts(true));
  ojson req = example1(2);
  req["messages"].push_back(ojson::parse(chat_output_message_json(out).dump()));
  const std::string live = doc(kDocExample1Live);
  EXPECT_EQ(render_chat_prompt(req), live.substr(0, live.find("<｜User｜><tool_result>")));
}

// A random well-formed V4.1 assistant turn as the model writes it (reasoning, content, DSML calls,
// EOS), using only text that the format can carry.
std::string random_turn(std::mt19937& rng) {
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  auto text = [&](size_t max_len) {
    static const char* const kPieces[] = {"a", "b", " ", "\n", "<", ">", "\"", "\\", "é", "{", "/", "｜", "\t"};
    std::string t;
    for (size_t n = pick(max_len + 1); n > 0; --n) t += kPieces[pick(std::size(kPieces))];
    return t;
  };
  static const char* const kJson[] = {"1", "-2", "1.5", "0.0", "true", "null", "[1, 2]", "{\"k\": [1, null]}", "1e-05"};
  std::string out = text(12) + "</think>" + text(12);
  const size_t calls = pick(3);
  if (calls > 0) {
    out += "\n\n<｜DSML｜ calls>\n";
    for (size_t c = 0; c < calls; ++c) {
      out += "<｜DSML｜ invoke name=\"tool_" + std::to_string(pick(5)) + "\">\n";
      std::vector<std::string> params;
      for (size_t k = pick(4); k > 0; --k) {
        const bool str = pick(2) == 0;
        params.push_back("<｜DSML｜ parameter name=\"p" + std::to_string(k) + "\" string=\"" + (str ? "true" : "false") + "\">" +
                         (str ? text(10) : std::string(kJson[pick(std::size(kJson))])) + "</｜DSML｜ parameter>");
      }
      for (size_t k = 0; k < params.size(); ++k) out += (k > 0 ? "\n" : "") + params[k];
      out += "\n</｜DSML｜ invoke>\n";
    }
    out += "</｜DSML｜ calls>";
  }
  return out + "<｜end▁of▁sentence｜>";
}

TEST(ChatOutput, RandomTurnsRoundTripThroughTheRenderer) {
  std::mt19937 rng(1234);
  for (int round = 0; round < 300; ++round) {
    const std::string turn = random_turn(rng);
    const ChatOutput out = parse_chat_output(turn, opts(true));
    ojson req = request(R"({"messages": [{"role": "user", "content": "u"}]})");
    req["messages"].push_back(ojson::parse(chat_output_message_json(out).dump()));
    const std::string prompt = render_chat_prompt(req);
    const std::string head = kBos + kEffort75 + "<｜User｜>u<｜Assistant｜><think>";
    ASSERT_EQ(prompt, head + turn) << "round " << round;
  }
}

TEST(ChatOutput, DamagedTurnsNeverBreakTheParser) {
  std::mt19937 rng(99);
  static const char* const kFragments[] = {"<｜DSML｜ calls>", "</｜DSML｜ calls>", "<｜DSML｜ invoke name=\"f\">",
                                           "</｜DSML｜ invoke>", "</｜DSML｜ parameter>", "<｜DSML｜", "\n", "\"", ">",
                                           "</think>", "<think>", "<｜end▁of▁sentence｜>", "<", "x"};
  for (int round = 0; round < 150; ++round) {
    std::string turn = random_turn(rng);
    // Edits land on character boundaries: the server feeds decoded text, never half a character.
    auto boundary = [&](size_t at) {
      while (at < turn.size() && (static_cast<unsigned char>(turn[at]) & 0xC0) == 0x80) --at;
      return at;
    };
    for (int edits = 1 + static_cast<int>(rng() % 3); edits > 0; --edits) {
      const size_t at = boundary(rng() % (turn.size() + 1));
      switch (rng() % 3) {
        case 0: turn.insert(at, kFragments[rng() % std::size(kFragments)]); break;
        case 1: turn.erase(at, boundary(std::min(turn.size(), at + rng() % 12)) - at); break;
        default: turn.resize(at); break;
      }
    }
    const bool thinking = rng() % 2 == 0;
    const ChatOutput out = parse_chat_output(turn, opts(thinking));
    for (const ToolCall& c : out.tool_calls) {
      const nlohmann::json args = nlohmann::json::parse(c.arguments, nullptr, false);
      EXPECT_TRUE(args.is_object()) << c.arguments << " from " << turn;
    }
    SCOPED_TRACE("round " + std::to_string(round));
    expect_split_invariant(turn, thinking);
  }
}

TEST(ChatOutput, OpenAiShapes) {
  const ChatOutput out = parse_chat_output(doc(kDocExample1Output), opts(true));
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(tool_call_json(out.tool_calls[0]),
            nlohmann::json::parse(R"({"id": "call_0", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"location\": \"Beijing\", \"unit\": \"celsius\"}"}})"));
  const nlohmann::json msg = chat_output_message_json(out);
  EXPECT_TRUE(msg["content"].is_null());
  EXPECT_EQ(msg["reasoning_content"], out.reasoning_content);
  EXPECT_EQ(tool_call_delta_json(ToolCallDelta{0, "call_0", "f", "{"}),
            nlohmann::json::parse(R"({"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{"}})"));
  EXPECT_EQ(tool_call_delta_json(ToolCallDelta{1, "", "", "}"}),
            nlohmann::json::parse(R"({"index": 1, "function": {"arguments": "}"}})"));
  // Default ids are "call_" plus 24 random characters, distinct per call.
  const ChatOutput two = parse_chat_output(
      "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"a\">\n\n</｜DSML｜ invoke>\n<｜DSML｜ invoke name=\"b\">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",
      ChatOutputOptions{.thinking = false, .tools = {"a", "b"}, .make_call_id = {}});
  ASSERT_EQ(two.tool_calls.size(), 2u);
  EXPECT_EQ(two.tool_calls[0].id.size(), 29u);
  EXPECT_NE(two.tool_calls[0].id, two.tool_calls[1].id);
}

}  // namespace
}  // namespace dsv41
