// Sends an image to a running `dsv41 serve` with the official openai npm client, as applications do:
// an image_url part holding a base64 data: URL, plain and streamed; a remote URL must be refused
// with a 400. Exits non-zero on the first mismatch.
//
// usage: DSV41_BASE_URL=http://127.0.0.1:PORT/v1 DSV41_MODEL=NAME DSV41_IMAGE=FILE.png node openai_vision.mjs
import { readFileSync } from "node:fs";
import OpenAI from "openai";

const baseURL = process.env.DSV41_BASE_URL;
const model = process.env.DSV41_MODEL;
const image = process.env.DSV41_IMAGE;
if (!baseURL || !model || !image) {
  console.error("set DSV41_BASE_URL, DSV41_MODEL and DSV41_IMAGE");
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

const url = `data:image/png;base64,${readFileSync(image).toString("base64")}`;
const request = (imageUrl) => ({
  model,
  messages: [{ role: "user", content: [{ type: "text", text: "Describe it." }, { type: "image_url", image_url: { url: imageUrl } }] }],
  max_tokens: 6,
  temperature: 0,
  ignore_eos: true,
});

async function main() {
  const textOnly = await client.chat.completions.create({
    model,
    messages: [{ role: "user", content: [{ type: "text", text: "Describe it." }] }],
    max_tokens: 1,
    temperature: 0,
  });
  // A random model may answer in its reasoning or its content: both are the answer's text.
  const said = (m) => (m?.reasoning_content ?? "") + (m?.content ?? "");
  const plain = await client.chat.completions.create(request(url));
  const answer = said(plain.choices[0].message);
  check(answer.length > 0, "an answer to the image", plain.choices[0].message);
  check(plain.usage.prompt_tokens >= textOnly.usage.prompt_tokens + 42, "usage counts the image's span",
        [plain.usage, textOnly.usage]);
  let streamed = "";
  for await (const chunk of await client.chat.completions.create({ ...request(url), stream: true })) {
    streamed += said(chunk.choices[0]?.delta);
  }
  check(streamed === answer, "streamed equals plain", [streamed, answer]);
  try {
    await client.chat.completions.create(request("https://example.com/cat.png"));
    check(false, "a remote image URL is refused");
  } catch (e) {
    check(e.status === 400, "a remote image URL is a 400", e.message);
  }
  console.log("all checks passed");
}

main().catch((e) => {
  console.error("FAIL:", e);
  process.exit(1);
});
