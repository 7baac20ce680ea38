#include "server/openai_api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <sstream>

#include "io/cache_namespace.h"
#include "server/access_policy.h"
#include "text/json_grammar.h"
#include "server/chat_fields.h"
#include "server/json_body.h"
#include "server/json_fields.h"
#include "util/error.h"

namespace dsv41::server {
namespace {

// The model id a request names (the served name or one of its aliases, echoed as given), or the
// served name when it names none.
std::string check_model(const ojson& body, const ModelInfo& model) {
  const ojson* v = field(body, "model");
  if (v == nullptr) return model.name;
  if (!v->is_string()) throw invalid_request("model", "model must be a string, got " + kind(*v));
  const std::string name = v->get<std::string>();
  if (name != model.name && std::find(model.aliases.begin(), model.aliases.end(), name) == model.aliases.end()) {
    throw ApiError(404, "invalid_request_error",
                   "The model `" + name + "` does not exist; this server serves `" + model.name + "`", "model",
                   "model_not_found");
  }
  return name;
}

void parse_common(const ojson& body, ApiRequest& req) {
  if (const ojson* n = field(body, "n")) {
    if (require_integer(*n, "n") != 1) throw invalid_request("n", "n must be 1: one choice per request is supported");
  }
  req.stream = get_bool(body, "stream", false);
  if (const ojson* so = field(body, "stream_options")) {
    if (!req.stream) throw invalid_request("stream_options", "stream_options is only allowed when stream is true");
    if (!so->is_object()) throw invalid_request("stream_options", "stream_options must be an object, got " + kind(*so));
    req.include_usage = get_bool(*so, "include_usage", false);
  }

  SamplingParams& sp = req.params.sampling;
  sp.temperature = get_number(body, "temperature", 1.0, 0.0, 2.0);
  sp.top_p = get_number(body, "top_p", 1.0, 0.0, 1.0, /*lo_open=*/true);
  if (const ojson* k = field(body, "top_k")) {  // vLLM's extension field: -1 or 0 for no limit
    const int64_t n = require_integer(*k, "top_k");
    if (n < -1) throw invalid_request("top_k", "top_k must be a positive integer, or -1 or 0 for no limit, got " + std::to_string(n));
    sp.top_k = std::max<int64_t>(n, 0);
  }
  if (const ojson* seed = field(body, "seed")) {
    sp.seed = static_cast<uint64_t>(require_integer(*seed, "seed"));  // negative seeds wrap, still deterministic
  } else {
    std::random_device entropy;  // a fresh draw per request: nothing shared between requests
    sp.seed = (static_cast<uint64_t>(entropy()) << 32) ^ entropy();
  }
  for (const char* key : {"presence_penalty", "frequency_penalty"}) {
    if (get_number(body, key, 0.0, -2.0, 2.0) != 0.0) {
      throw invalid_request(key, std::string(key) + " is not supported (only 0)");
    }
  }
  if (const ojson* bias = field(body, "logit_bias")) {
    if (!bias->is_object() || !bias->empty()) throw invalid_request("logit_bias", "logit_bias is not supported (only {})");
  }
  req.params.ignore_eos = get_bool(body, "ignore_eos", false);
  if (const ojson* salt = field(body, "cache_salt")) {  // vLLM's: the prompt cache's tenant (io/cache_namespace.h)
    if (!salt->is_string()) throw invalid_request("cache_salt", "cache_salt must be a string, got " + kind(*salt));
    const std::string& s = salt->get_ref<const std::string&>();
    if (s.empty()) throw invalid_request("cache_salt", "cache_salt must not be empty when given");
    if (s.size() > kMaxCacheSaltBytes) {
      throw invalid_request("cache_salt", "cache_salt holds at most " + std::to_string(kMaxCacheSaltBytes) + " bytes");
    }
    req.params.cache_namespace = cache_namespace_of_salt(s);
  }

  if (const ojson* stop = field(body, "stop")) {
    std::vector<std::string> list;
    if (stop->is_string()) {
      list.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (stop->size() > kMaxStopSequences) {
        throw invalid_request("stop", "stop holds at most " + std::to_string(kMaxStopSequences) + " sequences");
      }
      for (const ojson& s : *stop) {
        if (!s.is_string()) throw invalid_request("stop", "stop must hold strings, got " + kind(s));
        list.push_back(s.get<std::string>());
      }
    } else {
      throw invalid_request("stop", "stop must be a string or an array of strings, got " + kind(*stop));
    }
    for (const std::string& s : list) {
      if (s.empty()) throw invalid_request("stop", "stop sequences must not be empty");
    }
    req.params.stop = std::move(list);
  }
}

void parse_chat(const ojson& body, const ModelInfo& model, ApiRequest& req) {
  const ojson* messages = field(body, "messages");
  if (messages == nullptr) throw invalid_request("messages", "messages is required");
  if (!messages->is_array()) throw invalid_request("messages", "messages must be an array, got " + kind(*messages));
  if (messages->empty()) throw invalid_request("messages", "messages must not be empty");

  check_chat_fields(body);
  ChatPrompt prompt;
  try {
    prompt = render_chat(body, model.chat);
  } catch (const Error& e) {
    // The chat encoder names the offending field ("messages[2].role").
    throw invalid_request(e.where().empty() ? "messages" : e.where(), e.what());
  } catch (const nlohmann::json::exception& e) {
    throw invalid_request("messages", std::string("malformed chat request: ") + e.what());
  }
  // each image part became a placeholder in the text; the engine expands it into the image's span
  req.params.images = load_image_parts(prompt.images, model.vision, model.images);
  req.thinking = prompt.starts_in_reasoning;  // where the output begins (a continued answer starts outside reasoning)
  req.params.prompt = model.tokenizer->encode(prompt.text, prompt.plain_spans);
  req.prompt_text = std::move(prompt.text);
  req.tool_names = std::move(prompt.tool_names);

  req.logprobs = get_bool(body, "logprobs", false);
  if (const ojson* top = field(body, "top_logprobs")) {
    const int64_t n = require_integer(*top, "top_logprobs");
    if (n < 0 || n > kMaxTopLogprobs) {
      throw invalid_request("top_logprobs", "top_logprobs must be in [0, " + std::to_string(kMaxTopLogprobs) + "]");
    }
    if (!req.logprobs) throw invalid_request("top_logprobs", "top_logprobs needs logprobs set to true");
    req.params.top_logprobs = static_cast<int>(n);
  } else {
    req.params.top_logprobs = req.logprobs ? 0 : -1;
  }
}

std::vector<int32_t> token_ids(const ojson& list, const ModelInfo& model) {
  std::vector<int32_t> ids;
  ids.reserve(list.size());
  const int64_t vocab = model.tokenizer->vocab_size();
  for (const ojson& v : list) {
    int64_t id = -1;
    if (!integer_of(v, id)) throw invalid_request("prompt", "a token-id prompt must hold integers, got " + kind(v));
    if (id < 0 || id >= vocab) {
      throw invalid_request("prompt", "token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                          std::to_string(vocab) + ")");
    }
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

void parse_completion(const ojson& body, const ModelInfo& model, ApiRequest& req) {
  const ojson* prompt = field(body, "prompt");
  if (prompt == nullptr) throw invalid_request("prompt", "prompt is required");
  auto from_text = [&](const std::string& text) {
    req.prompt_text = text;
    req.params.prompt = {model.bos_id};
    const auto ids = model.tokenizer->encode(text, /*parse_special=*/true);
    req.params.prompt.insert(req.params.prompt.end(), ids.begin(), ids.end());
  };
  auto from_ids = [&](const ojson& list) {
    if (list.empty()) throw invalid_request("prompt", "prompt must not be empty");
    req.params.prompt = token_ids(list, model);
    req.prompt_text = model.tokenizer->decode(req.params.prompt);
  };
  if (prompt->is_string()) {
    from_text(prompt->get<std::string>());
  } else if (prompt->is_array()) {
    if (prompt->empty()) throw invalid_request("prompt", "prompt must not be empty");
    const ojson& first = prompt->front();
    if (first.is_string() || first.is_array()) {
      // A batch of prompts; one choice per request is what this server returns.
      if (prompt->size() != 1) throw invalid_request("prompt", "only one prompt per request is supported");
      if (first.is_string()) {
        from_text(first.get<std::string>());
      } else {
        from_ids(first);
      }
    } else {
      from_ids(*prompt);
    }
  } else {
    throw invalid_request("prompt", "prompt must be a string or an array of token ids, got " + kind(*prompt));
  }

  req.echo = get_bool(body, "echo", false);
  if (const ojson* best = field(body, "best_of")) {
    if (require_integer(*best, "best_of") != 1) throw invalid_request("best_of", "best_of must be 1");
  }
  if (const ojson* suffix = field(body, "suffix")) {
    if (!suffix->is_string() || !suffix->get<std::string>().empty()) {
      throw invalid_request("suffix", "suffix is not supported");
    }
  }
  if (const ojson* lp = field(body, "logprobs")) {
    const int64_t n = require_integer(*lp, "logprobs");
    if (n < 0 || n > kMaxTopLogprobs) {
      throw invalid_request("logprobs", "logprobs must be in [0, " + std::to_string(kMaxTopLogprobs) + "]");
    }
    if (req.echo) throw invalid_request("logprobs", "logprobs with echo is not supported (no prompt logprobs)");
    req.logprobs = true;
    req.params.top_logprobs = static_cast<int>(n);
  }
}

// A schema as the grammar compiler reads it; a 400 naming `param` and the schema's keyword otherwise.
std::shared_ptr<const Grammar> schema_grammar(const ojson& schema, const std::string& param) {
  if (!schema.is_object() && !schema.is_boolean()) throw invalid_request(param, param + " must be a JSON Schema object");
  try {
    return json_schema_grammar(nlohmann::json::parse(schema.dump()));
  } catch (const Error& e) {
    throw invalid_request(param, std::string("the schema is not supported: ") + e.what());
  }
}

// The tool-call grammar a chat request's tool_choice asks for: "required" (one call or more of the
// offered tools) or a named function (one call of it); null for "auto", "none" and no tool_choice.
std::shared_ptr<const Grammar> tool_choice_grammar(const ojson& body) {
  const ojson* choice = field(body, "tool_choice");
  const ojson* tools = field(body, "tools");
  if (choice == nullptr || tools == nullptr || !tools->is_array()) return nullptr;
  nlohmann::json offered = nlohmann::json::array();
  bool one_call = false;
  if (choice->is_string()) {
    if (*choice != "required") return nullptr;
    offered = nlohmann::json::parse(tools->dump());
  } else {
    const std::string name = choice->at("function").at("name").get<std::string>();  // the encoder checked it names a tool
    for (const ojson& t : *tools) {
      if (t.is_object() && t.contains("function") && t["function"].value("name", "") == name) {
        offered.push_back(nlohmann::json::parse(t.dump()));
      }
    }
    one_call = true;
  }
  try {
    return tool_call_grammar(offered, one_call);
  } catch (const Error& e) {
    throw invalid_request(e.where().empty() ? "tools" : e.where(), std::string("a forced tool call cannot follow this tool: ") + e.what());
  }
}

// Structured outputs: the chat route's response_format (json_object, json_schema) and tool_choice
// (required or a named function: a DSML tool-call block), and vLLM's structured_outputs on both
// routes (json, json_object, choice; regex, grammar and structural_tag are refused). A forced tool
// call takes precedence over response_format, which then only shapes the prompt. When the output
// begins in reasoning, the grammar holds from its end ("</think>").
void parse_structured_outputs(const ojson& body, const ModelInfo& model, ApiRequest& req) {
  std::shared_ptr<const Grammar> grammar;
  std::string from;
  if (req.endpoint == Endpoint::ChatCompletions) {
    grammar = tool_choice_grammar(body);
    from = "tool_choice";
  }
  if (const ojson* rf = field(body, "response_format"); rf != nullptr && req.endpoint == Endpoint::ChatCompletions && !grammar) {
    const std::string type = rf->is_object() && (*rf)["type"].is_string() ? (*rf)["type"].get<std::string>() : "";
    if (type == "json_object") {
      grammar = json_object_grammar();
    } else if (type == "json_schema") {
      const ojson* spec = field(*rf, "json_schema");
      if (spec == nullptr || !spec->is_object()) {
        throw invalid_request("response_format.json_schema", "response_format.json_schema must be an object");
      }
      const ojson* schema = field(*spec, "schema");
      if (schema == nullptr) throw invalid_request("response_format.json_schema.schema", "response_format.json_schema.schema is required");
      grammar = schema_grammar(*schema, "response_format.json_schema.schema");
    }
    from = "response_format";
  }
  if (const ojson* so = field(body, "structured_outputs")) {
    if (!so->is_object()) throw invalid_request("structured_outputs", "structured_outputs must be an object, got " + kind(*so));
    for (const auto& [key, value] : so->items()) {
      const std::string param = "structured_outputs." + key;
      if (grammar) throw invalid_request(param, param + " and " + from + " cannot both constrain the output");
      if (key == "json") {
        ojson schema = value;
        if (value.is_string()) {  // vLLM takes the schema as JSON text too
          schema = ojson::parse(value.get<std::string>(), nullptr, false);
          if (schema.is_discarded()) throw invalid_request(param, param + " is not JSON");
        }
        grammar = schema_grammar(schema, param);
      } else if (key == "json_object") {
        if (!value.is_boolean()) throw invalid_request(param, param + " must be a boolean");
        if (!value.get<bool>()) continue;
        grammar = json_object_grammar();
      } else if (key == "choice") {
        if (!value.is_array()) throw invalid_request(param, param + " must be an array of strings");
        std::vector<std::string> choices;
        for (const ojson& c : value) {
          if (!c.is_string()) throw invalid_request(param, param + " must hold strings, got " + kind(c));
          choices.push_back(c.get<std::string>());
        }
        try {
          grammar = choice_grammar(choices);
        } catch (const Error& e) {
          throw invalid_request(param, e.what());
        }
      } else if (key == "regex" || key == "grammar" || key == "structural_tag") {
        throw invalid_request(param, param + " is not supported (json, json_object and choice are)");
      } else {
        throw invalid_request(param, param + " is not a structured_outputs field (json, json_object, choice)");
      }
      from = param;
    }
  }
  if (!grammar) return;
  req.params.grammar = std::move(grammar);
  if (req.thinking) req.params.grammar_after = model.tokenizer->token_id("</think>").value_or(-1);
}

void parse_max_tokens(const ojson& body, const ModelInfo& model, ApiRequest& req) {
  const int64_t prompt = static_cast<int64_t>(req.params.prompt.size());
  const char* key = field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  const char* prompt_field = req.endpoint == Endpoint::ChatCompletions ? "messages" : "prompt";
  int64_t max_tokens = model.context_length - prompt;
  if (model.default_max_tokens > 0) max_tokens = std::min(max_tokens, model.default_max_tokens);
  const bool given = field(body, key) != nullptr;
  if (given) {
    max_tokens = require_integer(*field(body, key), key);
    if (max_tokens < 1) throw invalid_request(key, std::string(key) + " must be at least 1, got " + std::to_string(max_tokens));
    if (max_tokens > model.context_length) {
      throw invalid_request(key, std::string(key) + " must be at most the model's context length (" +
                                     std::to_string(model.context_length) + "), got " + std::to_string(max_tokens));
    }
  }
  if (prompt + (given ? max_tokens : 1) > model.context_length) {
    throw invalid_request(prompt_field,
                          "This model's maximum context length is " + std::to_string(model.context_length) +
                              " tokens. However, you requested " + std::to_string(prompt + (given ? max_tokens : 1)) +
                              " tokens (" + std::to_string(prompt) + " in the " + prompt_field + ", " +
                              std::to_string(given ? max_tokens : 1) +
                              " in the completion). Please reduce the length of the " + prompt_field +
                              " or completion.",
                          "context_length_exceeded");
  }
  req.params.max_tokens = max_tokens;
  if (const ojson* forced = field(body, "dsv41_forced_output")) {
    if (!model.test_hooks) {
      throw invalid_request("dsv41_forced_output", "is a test hook; start the server with --test-hooks to use it");
    }
    if (!forced->is_string()) throw invalid_request("dsv41_forced_output", "must be a string");
    req.params.forced_output = model.tokenizer->encode(forced->get<std::string>(), /*parse_special=*/true);
  }
}

// dsv41's sequence options (extension fields, as vLLM takes its own beside OpenAI's).
void parse_sequence_options(const ojson& body, const ModelInfo& model, ApiRequest& req) {
  if (const ojson* v = field(body, "priority")) {  // vLLM's: lower runs first
    req.params.priority = require_integer(*v, "priority");
    if (req.params.priority != 0 && !model.priority_scheduling) {
      throw invalid_request("priority", "priority must be 0: this server schedules first come, first served "
                                        "(serve --scheduling-policy priority orders requests by it)");
    }
  }
  if (const ojson* v = field(body, "speculative")) {
    const std::string name = v->is_string() ? v->get<std::string>() : "";
    if (name != "dspark" && name != "off") {
      throw invalid_request("speculative", "speculative must be \"dspark\" or \"off\", got " +
                                               (v->is_string() ? "\"" + printable(name) + "\"" : kind(*v)));
    }
    if (name == "dspark" && model.draft_block_size == 0) {
      throw invalid_request("speculative", "speculative \"dspark\" needs a model with DSpark blocks; this one has none");
    }
    req.params.speculative = name == "dspark" ? SpeculativeMethod::DSpark : SpeculativeMethod::Off;
  }
  if (const ojson* v = field(body, "acceptance_guard")) {  // false: draft at every step (measuring)
    if (!v->is_boolean()) throw invalid_request("acceptance_guard", "acceptance_guard must be true or false, got " + kind(*v));
    req.params.acceptance_guard = v->get<bool>();
  }
  if (const ojson* v = field(body, "draft_length")) {
    const int64_t n = require_integer(*v, "draft_length");
    if (n < 0 || n > model.draft_block_size) {
      throw invalid_request("draft_length", "draft_length must be in [0, " + std::to_string(model.draft_block_size) +
                                                "] (0: adaptive), got " + std::to_string(n));
    }
    req.params.draft_length = static_cast<int>(n);
  }
  if (const ojson* v = field(body, "prefill_mode")) {
    const std::string name = v->is_string() ? v->get<std::string>() : "";
    if (name != "exact" && name != "tail") {
      throw invalid_request("prefill_mode", "prefill_mode must be \"exact\" or \"tail\", got " +
                                                (v->is_string() ? "\"" + printable(name) + "\"" : kind(*v)));
    }
    req.params.prefill_mode = name == "tail" ? PrefillMode::Tail : PrefillMode::Exact;
  }
}

}  // namespace

ojson parse_json_body(std::string_view text) {
  ojson body;
  JsonBodyError error;
  if (!parse_json_limited(text, JsonLimits{kMaxJsonDepth, kMaxJsonMembers}, body, error)) {
    switch (error.kind) {
      case JsonBodyError::Kind::NumberOutOfRange:
        throw invalid_request("", "the JSON body holds a number outside the range of a double");
      case JsonBodyError::Kind::TooDeep:
      case JsonBodyError::Kind::TooManyMembers:
        throw invalid_request("", error.detail);
      case JsonBodyError::Kind::Syntax:
        break;
    }
    throw invalid_request("", "We could not parse the JSON body of your request: " + error.detail);
  }
  if (!body.is_object()) throw invalid_request("", "the request body must be a JSON object, got " + kind(body));
  return body;
}

ApiRequest parse_request(Endpoint endpoint, std::string_view text, const ModelInfo& model) {
  return parse_request_json(endpoint, parse_json_body(text), model);
}

ApiRequest parse_request_json(Endpoint endpoint, const ojson& body, const ModelInfo& model) {
  ApiRequest req;
  req.endpoint = endpoint;
  req.model = check_model(body, model);
  parse_common(body, req);
  if (endpoint == Endpoint::ChatCompletions) {
    parse_chat(body, model, req);
  } else {
    parse_completion(body, model, req);
  }
  parse_structured_outputs(body, model, req);
  parse_max_tokens(body, model, req);
  parse_sequence_options(body, model, req);
  return req;
}

nlohmann::json tokenize(std::string_view text, const ModelInfo& model) {
  const ojson body = parse_json_body(text);
  check_model(body, model);
  const ojson* prompt = field(body, "prompt");
  const ojson* messages = field(body, "messages");
  if ((prompt == nullptr) == (messages == nullptr)) {
    throw invalid_request(prompt == nullptr ? "prompt" : "messages", "give exactly one of prompt and messages");
  }
  std::vector<int32_t> ids;
  if (prompt != nullptr) {
    if (!prompt->is_string()) throw invalid_request("prompt", "prompt must be a string, got " + kind(*prompt));
    if (get_bool(body, "add_special_tokens", true)) ids.push_back(model.bos_id);
    const auto more = model.tokenizer->encode(prompt->get<std::string>(), /*parse_special=*/true);
    ids.insert(ids.end(), more.begin(), more.end());
  } else {
    if (!messages->is_array() || messages->empty()) throw invalid_request("messages", "messages must be a non-empty array");
    ApiRequest chat;
    parse_chat(body, model, chat);
    ids = std::move(chat.params.prompt);
  }
  return {{"count", ids.size()}, {"max_model_len", model.context_length}, {"tokens", ids}};
}

nlohmann::json detokenize(std::string_view text, const ModelInfo& model) {
  const ojson body = parse_json_body(text);
  check_model(body, model);
  const ojson* tokens = field(body, "tokens");
  if (tokens == nullptr) throw invalid_request("tokens", "tokens is required");
  if (!tokens->is_array()) throw invalid_request("tokens", "tokens must be an array of token ids, got " + kind(*tokens));
  std::vector<int32_t> ids;
  try {
    ids = token_ids(*tokens, model);
  } catch (ApiError& e) {
    e.param = "tokens";
    throw;
  }
  return {{"prompt", model.tokenizer->decode(ids)}};
}

}  // namespace dsv41::server
