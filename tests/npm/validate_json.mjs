// Validates outputs against a JSON Schema with Ajv (an implementation independent of dsv41's
// grammar): reads {"schema": ..., "outputs": ["text", ...]} on stdin and prints one JSON line,
// {"parsed": [bool...], "valid": [bool...], "errors": ["..."]}.
import Ajv from "ajv";

let input = "";
for await (const chunk of process.stdin) input += chunk;
const { schema, outputs } = JSON.parse(input);
const validate = new Ajv({ strict: false }).compile(schema);
const result = { parsed: [], valid: [], errors: [] };
for (const text of outputs) {
  let value;
  try {
    value = JSON.parse(text);
  } catch (e) {
    result.parsed.push(false);
    result.valid.push(false);
    result.errors.push(String(e.message));
    continue;
  }
  result.parsed.push(true);
  const ok = validate(value);
  result.valid.push(ok);
  result.errors.push(ok ? "" : new Ajv({ strict: false }).errorsText(validate.errors));
}
console.log(JSON.stringify(result));
