// Drives a running `dsv41 serve` with the official @anthropic-ai/sdk client, the way coding agents
// talk to it: messages plain and streamed, thinking, a tool call and its result, stop sequences,
// count_tokens, the API key in x-api-key and errors in Anthropic's shape. With DSV41_IMAGE set (a
// model with a vision tower), it sends that image as a base64 block instead, plain and streamed.
// Exits non-zero on the first mismatch. The model is random, so checks compare the server with
// itself (plain vs streamed) and force the text a check needs through "dsv41_forced_output".
//
// usage: DSV41_BASE_URL=http://127.0.0.1:PORT DSV41_MODEL=NAME [DSV41_API_KEY=K] [DSV41_IMAGE=FILE.png]
//        node anthropic_client.mjs
import { readFileSync } from "node:fs";
import Anthropic from "@anthropic-ai/sdk";

const baseURL = process.env.DSV41_BASE_URL;
const model = process.env.DSV41_MODEL;
const image = process.env.DSV41_IMAGE;
if (!baseURL || !model) {
  console.error("set DSV41_BASE_URL and DSV41_MODEL");
  process.exit(2);
}
const client = new Anthropic({ apiKey: process.env.DSV41_API_KEY ?? "unused", baseURL, maxRetries: 0, timeout: 60_000 });

function check(cond, what, detail) {
  if (!cond) {
    console.error(`FAIL: ${what}` + (detail === undefined ? "" : `\n  ${JSON.stringify(detail)}`));
    process.exit(1);
  }
  console.log(`ok: ${what}`);
}

const textOf = (message) => message.content.filter((b) => b.type === "text").map((b) => b.text).join("");

async function textChecks() {
  // plain and streamed: the same text, max_tokens reached
  const req = { model, max_tokens: 10, temperature: 0, ignore_eos: true, messages: [{ role: "user", content: "Write about the sea." }] };
  const plain = await client.messages.create(req);
  check(plain.type === "message" && plain.role === "assistant", "a message from the assistant", plain);
  check(plain.stop_reason === "max_tokens", "stop_reason max_tokens", plain);
  check(plain.usage.output_tokens === 10, "usage.output_tokens", plain.usage);
  const stream = client.messages.stream(req);
  const events = [];
  for await (const event of stream) events.push(event.type);
  const streamed = await stream.finalMessage();
  check(textOf(streamed) === textOf(plain), "streamed text equals plain text", [textOf(streamed), textOf(plain)]);
  check(events[0] === "message_start" && events.at(-1) === "message_stop", "the stream's events in order", events);
  check(streamed.stop_reason === "max_tokens" && streamed.usage.output_tokens === 10, "the stream's stop_reason and usage",
        streamed);

  // count_tokens counts the prompt the message's usage counted
  const counted = await client.messages.countTokens({ model, messages: req.messages });
  const u = plain.usage;
  check(counted.input_tokens === u.input_tokens + (u.cache_read_input_tokens ?? 0) + (u.cache_creation_input_tokens ?? 0),
        "count_tokens equals the usage's prompt", [counted, u]);

  // thinking: a random model in thinking mode answers in its reasoning
  const thought = await client.messages.create({ ...req, max_tokens: 2000, ignore_eos: false,
                                                 thinking: { type: "enabled", budget_tokens: 1024 },
                                                 dsv41_forced_output: "Hmm, waves.</think>The sea is wide.<｜end▁of▁sentence｜>" });
  check(thought.content[0].type === "thinking" && thought.content[0].thinking === "Hmm, waves.", "a thinking block", thought.content);
  check(thought.content[1].type === "text" && thought.content[1].text === "The sea is wide.", "then the text", thought.content);
  check(thought.stop_reason === "end_turn", "stop_reason end_turn", thought);

  // a stop sequence
  const stopped = await client.messages.create({ ...req, max_tokens: 30, stop_sequences: ["END"],
                                                 dsv41_forced_output: "one two END three" });
  check(stopped.stop_reason === "stop_sequence" && stopped.stop_sequence === "END", "stop_sequence", stopped);
  check(textOf(stopped) === "one two ", "the text before the stop sequence", stopped.content);

  // a tool call (forced: the model writes DSML), streamed and plain, then its result
  const tools = [{ name: "get_weather", description: "The weather in a city.",
                   input_schema: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } }];
  const dsml = '<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n' +
               '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n' +
               "</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>";
  const ask = { model, max_tokens: 200, tools, tool_choice: { type: "any" },
                messages: [{ role: "user", content: "Weather in Paris?" }], dsv41_forced_output: dsml };
  const called = await client.messages.create(ask);
  const use = called.content.find((b) => b.type === "tool_use");
  check(called.stop_reason === "tool_use", "stop_reason tool_use", called);
  check(use && use.name === "get_weather" && use.input.city === "Paris" && use.id.startsWith("toolu_"), "a tool_use block",
        called.content);
  const calledStream = await client.messages.stream(ask).finalMessage();
  const streamedUse = calledStream.content.find((b) => b.type === "tool_use");
  check(streamedUse && streamedUse.input.city === "Paris" && calledStream.stop_reason === "tool_use",
        "the streamed tool_use block's input from input_json_delta", calledStream.content);
  const answered = await client.messages.create({
    model, max_tokens: 4, tools,
    messages: [...ask.messages, { role: "assistant", content: called.content },
               { role: "user", content: [{ type: "tool_result", tool_use_id: use.id, content: "Sunny, 21 C" }] }],
  });
  check(answered.type === "message", "the tool's result is taken", answered);

  // errors in Anthropic's shape
  try {
    await client.messages.create({ ...req, model: "claude-nonexistent" });
    check(false, "an unknown model is refused");
  } catch (e) {
    check(e.status === 404 && e.error?.error?.type === "not_found_error", "an unknown model: 404 not_found_error", e.error);
  }
  try {
    await client.messages.create({ ...req, messages: [{ role: "user", content: [{ type: "document", source: {} }] }] });
    check(false, "a document block is refused");
  } catch (e) {
    check(e.status === 400 && e.error?.error?.type === "invalid_request_error", "a document block: 400", e.error);
  }
}

async function imageChecks() {
  const data = readFileSync(image).toString("base64");
  const req = { model, max_tokens: 6, temperature: 0, ignore_eos: true,
                messages: [{ role: "user", content: [{ type: "image", source: { type: "base64", media_type: "image/png", data } },
                                                     { type: "text", text: "Describe it." }] }] };
  const textOnly = await client.messages.countTokens({ model, messages: [{ role: "user", content: "Describe it." }] });
  const plain = await client.messages.create(req);
  check(plain.content.length > 0, "an answer to the image", plain);
  check(plain.usage.input_tokens + (plain.usage.cache_read_input_tokens ?? 0) >= textOnly.input_tokens + 42,
        "usage counts the image's span", [plain.usage, textOnly]);
  const counted = await client.messages.countTokens({ model, messages: req.messages });
  check(counted.input_tokens >= textOnly.input_tokens + 42, "count_tokens counts the image's span", [counted, textOnly]);
  const streamed = await client.messages.stream(req).finalMessage();
  const said = (m) => m.content.map((b) => b.text ?? b.thinking ?? "").join("");
  check(said(streamed) === said(plain), "streamed equals plain", [said(streamed), said(plain)]);
  try {
    await client.messages.create({ ...req, messages: [{ role: "user", content: [{ type: "image", source: { type: "url", url: "https://example.com/cat.png" } }] }] });
    check(false, "a remote image is refused");
  } catch (e) {
    check(e.status === 400, "a remote image is a 400", e.error);
  }
}

async function main() {
  await (image ? imageChecks() : textChecks());
  console.log("all checks passed");
}

main().catch((e) => {
  console.error("FAIL:", e);
  process.exit(1);
});
