// Drives a running `dsv41 serve` with the official openai npm client, the way applications talk to
// it: chat (plain and streamed), completions, stop, seed, usage with cached tokens, tools,
// speculative decoding through the extension field, the Responses API, a json_schema response_format,
// and an unknown model. Exits
// non-zero on the first mismatch. The model is random, so checks compare the server with itself
// (plain vs streamed, same seed twice) rather than with fixed text.
//
// usage: DSV41_BASE_URL=http://127.0.0.1:PORT/v1 DSV41_MODEL=NAME node openai_client.mjs
import OpenAI from "openai";

const baseURL = process.env.DSV41_BASE_URL;
const model = process.env.DSV41_MODEL;
if (!baseURL || !model) {
  console.error("set DSV41_BASE_URL and DSV41_MODEL");
  process.exit(2);
}
const client = new OpenAI({ apiKey: "unused", baseURL, maxRetries: 0, timeout: 60_000 });

function check(cond, what, detail) {
  if (!cond) {
    console.error(`FAIL: ${what}` + (detail === undefined ? "" : `\n  ${JSON.stringify(detail)}`));
    process.exit(1);
  }
  console.log(`ok: ${what}`);
}

// Greedy, fixed-length, chat mode: the answer is in `content` and depends only on the prompt.
const greedy = (content, max_tokens) => ({
  model,
  messages: [{ role: "user", content }],
  max_tokens,
  temperature: 0,
  ignore_eos: true,
  thinking: false,
});

async function collectChat(stream) {
  let text = "";
  let role = null;
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    const choice = chunk.choices[0];
    if (!choice) continue;
    role ??= choice.delta.role ?? null;
    text += (choice.delta.reasoning_content ?? "") + (choice.delta.content ?? "");
    finish = choice.finish_reason ?? finish;
  }
  return { text, role, finish, usage };
}

async function main() {
  const models = await client.models.list();
  check(models.data.some((m) => m.id === model), "models.list names the served model", models.data);

  // chat, plain and streamed
  const req = greedy("Write one line about the sea.", 10);
  const plain = await client.chat.completions.create(req);
  check(plain.object === "chat.completion", "chat object", plain.object);
  check(plain.choices[0].message.role === "assistant", "chat role", plain.choices[0].message);
  check(plain.choices[0].finish_reason === "length", "chat finish_reason length", plain.choices[0]);
  check(plain.usage.completion_tokens === 10, "chat usage.completion_tokens", plain.usage);
  check(plain.usage.total_tokens === plain.usage.prompt_tokens + 10, "chat usage.total_tokens", plain.usage);
  const streamed = await collectChat(
    await client.chat.completions.create({ ...req, stream: true, stream_options: { include_usage: true } }),
  );
  check(streamed.role === "assistant", "stream starts with the role", streamed);
  check(streamed.text === (plain.choices[0].message.content ?? ""), "streamed chat equals plain chat", {
    streamed: streamed.text,
    plain: plain.choices[0].message.content,
  });
  check(streamed.finish === "length", "stream finish_reason", streamed);
  check(streamed.usage?.completion_tokens === 10, "stream usage chunk", streamed.usage);

  // completions, plain and streamed
  const creq = { model, prompt: "In a quiet village", max_tokens: 12, temperature: 0, ignore_eos: true };
  const comp = await client.completions.create(creq);
  check(comp.object === "text_completion", "completion object", comp.object);
  check(comp.usage.completion_tokens === 12, "completion usage", comp.usage);
  let ctext = "";
  for await (const chunk of await client.completions.create({ ...creq, stream: true })) {
    ctext += chunk.choices[0]?.text ?? "";
  }
  check(ctext === comp.choices[0].text, "streamed completion equals plain", { ctext, plain: comp.choices[0].text });

  // stop: a printable piece of the text, not at its start, ends the text before it
  const full = comp.choices[0].text;
  let stop = null;
  for (let i = Math.floor(full.length / 3); i + 2 <= full.length && !stop; i++) {
    const piece = full.slice(i, i + 2);
    if (/^[\x20-\x7e]{2}$/.test(piece) && full.indexOf(piece) > 0) stop = piece;
  }
  check(stop !== null, "found a stop string in the completion", full);
  const stopped = await client.completions.create({ ...creq, stop: [stop] });
  check(stopped.choices[0].text === full.slice(0, full.indexOf(stop)), "stop ends the text", {
    stop,
    got: stopped.choices[0].text,
  });
  check(stopped.choices[0].finish_reason === "stop", "stop finish_reason", stopped.choices[0]);

  // seed: the same seed samples the same text
  const sreq = { ...greedy("Say something random.", 12), temperature: 1, seed: 77 };
  const s1 = await client.chat.completions.create(sreq);
  const s2 = await client.chat.completions.create(sreq);
  check(s1.choices[0].message.content === s2.choices[0].message.content, "same seed, same text", [
    s1.choices[0].message.content,
    s2.choices[0].message.content,
  ]);

  // usage: a long prompt sent twice is partly served from the prefix cache
  const long = Array.from({ length: 50 }, (_, i) => `Line ${i} of a long shared document for the npm client.`).join(" ");
  const u1 = await client.chat.completions.create(greedy(long, 2));
  const u2 = await client.chat.completions.create(greedy(long, 2));
  check(u1.usage.prompt_tokens > 128, "long prompt", u1.usage);
  check((u2.usage.prompt_tokens_details?.cached_tokens ?? 0) > 0, "second request reports cached_tokens", u2.usage);

  // tools: accepted, rendered (checked through the debug route) and answered in shape
  const tools = [
    {
      type: "function",
      function: {
        name: "lookup",
        description: "Look a word up",
        parameters: { type: "object", properties: { word: { type: "string" } }, required: ["word"] },
      },
    },
  ];
  const treq = { ...greedy("Look up the word 'harbor'.", 6), tools, tool_choice: "auto" };
  const tres = await client.chat.completions.create(treq);
  check(["length", "stop", "tool_calls"].includes(tres.choices[0].finish_reason), "tools request answered", tres.choices[0]);
  const render = await fetch(`${baseURL}/debug/render`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(treq),
  }).then((r) => r.json());
  check(render.prompt.includes('{"name": "lookup", "description": "Look a word up"'), "tool schema rendered", render.prompt);
  check(render.prompt_tokens === tres.usage.prompt_tokens, "rendered prompt is what ran", [render.prompt_tokens, tres.usage]);

  // tool-call parsing end to end: the server (started with --test-hooks) emits this text as the
  // model's output, token for token; the client must see reasoning, content and a parsed tool call
  const forced =
    "Let me look it up.</think>I will check.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"lookup\">\n" +
    "<｜DSML｜ parameter name=\"word\" string=\"true\">harbor</｜DSML｜ parameter>\n" +
    "</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>";
  const freq = { ...treq, max_tokens: 400, thinking: true, ignore_eos: false, dsv41_forced_output: forced };
  const fres = await client.chat.completions.create(freq);
  const fmsg = fres.choices[0].message;
  check(fres.choices[0].finish_reason === "tool_calls", "forced tool call finishes with tool_calls", fres.choices[0]);
  check(fmsg.tool_calls?.length === 1 && fmsg.tool_calls[0].function.name === "lookup", "tool call parsed", fmsg);
  check(JSON.parse(fmsg.tool_calls[0].function.arguments).word === "harbor", "tool call arguments", fmsg.tool_calls);
  check(fmsg.content === "I will check.", "content before the call", fmsg.content);
  check(fmsg.reasoning_content === "Let me look it up.", "reasoning split off", fmsg.reasoning_content);
  const fstream = await client.chat.completions.create({ ...freq, stream: true });
  let streamedArgs = "", streamedName = "", streamedContent = "", streamedFinish = null;
  for await (const chunk of fstream) {
    const d = chunk.choices[0]?.delta ?? {};
    streamedContent += d.content ?? "";
    for (const tc of d.tool_calls ?? []) {
      streamedName += tc.function?.name ?? "";
      streamedArgs += tc.function?.arguments ?? "";
    }
    streamedFinish = chunk.choices[0]?.finish_reason ?? streamedFinish;
  }
  check(streamedName === "lookup" && JSON.parse(streamedArgs).word === "harbor", "streamed tool call", [streamedName, streamedArgs]);
  check(streamedContent === "I will check." && streamedFinish === "tool_calls", "streamed content and finish", [streamedContent, streamedFinish]);

  // dsv41's extension field, passed through the client's body as applications pass vLLM's:
  // speculative decoding gives the plain greedy text, streamed and not
  const specReq = { ...greedy("Write one line about the wind.", 16), speculative: "off" };
  const specPlain = await client.chat.completions.create(specReq);
  const specOn = await client.chat.completions.create({ ...specReq, speculative: "dspark" });
  check(specOn.choices[0].message.content === specPlain.choices[0].message.content,
        "speculative dspark gives the plain greedy text", [specOn.choices[0].message, specPlain.choices[0].message]);
  const specStream = await collectChat(await client.chat.completions.create({ ...specReq, speculative: "dspark", stream: true }));
  check(specStream.text === specPlain.choices[0].message.content, "streamed speculative text", specStream.text);
  try {
    await client.chat.completions.create({ ...specReq, speculative: "eagle" });
    check(false, "an unknown speculative method is refused");
  } catch (e) {
    check(e instanceof OpenAI.BadRequestError && e.param === "speculative", "unknown method is a 400 naming speculative", String(e));
  }

  // the Responses API, plain and streamed (the SDK's output_text joins the message text)
  const respReq = { model, input: "Write one line about a lighthouse.", max_output_tokens: 8, temperature: 0,
                    ignore_eos: true, thinking: false };
  const resp = await client.responses.create(respReq);
  check(resp.object === "response" && resp.status === "incomplete", "responses object, incomplete at max_output_tokens", resp);
  check(resp.usage.output_tokens === 8, "responses usage", resp.usage);
  check(typeof resp.output_text === "string" && resp.output_text.length > 0, "responses output_text", resp.output);
  let respText = "";
  let lastType = null;
  for await (const ev of await client.responses.create({ ...respReq, stream: true })) {
    if (ev.type === "response.output_text.delta") respText += ev.delta;
    lastType = ev.type;
  }
  check(respText === resp.output_text, "streamed responses text equals the plain one", [respText, resp.output_text]);
  check(lastType === "response.incomplete", "the stream ends with response.incomplete", lastType);
  try {
    await client.responses.create({ ...respReq, previous_response_id: "resp_unknown" });
    check(false, "previous_response_id is refused");
  } catch (e) {
    check(e instanceof OpenAI.BadRequestError && e.param === "previous_response_id", "previous_response_id is a 400 naming it", String(e));
  }

  // structured outputs: however random the model, the answer is JSON that fits the schema
  const schema = {
    type: "object",
    properties: { ok: { type: "boolean" }, level: { enum: ["low", "high"] } },
    required: ["ok", "level"],
    additionalProperties: false,
  };
  const structured = await client.chat.completions.create({
    model,
    messages: [{ role: "user", content: "Status?" }],
    max_tokens: 200,
    temperature: 0,
    thinking: false,
    response_format: { type: "json_schema", json_schema: { name: "status", schema, strict: true } },
  });
  check(structured.choices[0].finish_reason === "stop", "a json_schema answer ends when its value does", structured.choices[0]);
  const value = JSON.parse(structured.choices[0].message.content);
  check(typeof value.ok === "boolean" && ["low", "high"].includes(value.level) && Object.keys(value).length === 2,
        "a json_schema answer parses and fits its schema", value);

  // errors come back as OpenAI errors
  try {
    await client.chat.completions.create({ ...req, model: "no-such-model" });
    check(false, "unknown model is refused");
  } catch (e) {
    check(e instanceof OpenAI.APIError && e.status === 404, "unknown model is a 404 APIError", String(e));
    check(e.code === "model_not_found", "error code model_not_found", e.error);
  }
  try {
    await client.chat.completions.create({ ...req, n: 2 });
    check(false, "n=2 is refused");
  } catch (e) {
    check(e instanceof OpenAI.BadRequestError && e.param === "n", "n=2 is a 400 naming n", String(e));
  }
  console.log("all checks passed");
}

main().catch((e) => {
  console.error("FAIL:", e);
  process.exit(1);
});
