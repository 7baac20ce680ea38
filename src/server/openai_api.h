// Translation of OpenAI request bodies (/v1/chat/completions, /v1/completions) into engine requests:
// pure functions, so every rule can be tested without a model. Each bad input throws ApiError naming
// the field; nothing is silently dropped or clamped.
//
// Accepted fields (others are ignored, as OpenAI-compatible servers do):
//   model                 must name the served model (404 model_not_found otherwise); may be omitted
//   stream, stream_options.include_usage (only with stream)
//   n (1 only), max_tokens / max_completion_tokens (>= 1; default: ModelInfo::default_max_tokens),
//   temperature [0, 2], top_p (0, 1], top_k (vLLM's: > 0, or -1 / 0 for no limit), seed (integer;
//   default: a random one), stop (string or array;
//   matched in the decoded output, reasoning included, as the engine sees it),
//   presence_penalty / frequency_penalty (0 only), logit_bias (empty only), ignore_eos (bool)
//   chat:        messages, tools, tool_choice, response_format and the thinking knobs, as
//                text/chat_encoding.h reads them; logprobs (bool), top_logprobs (0..20)
//   completions: prompt (a string, or token ids; one prompt per request), echo (bool),
//                logprobs (0..20), best_of (1 only), suffix (null only)
// Extension fields (dsv41's): speculative ("dspark" or "off"; default: serve --speculative),
//   draft_length (0..DSpark's block size; 0: adaptive), prefill_mode ("exact" or "tail").
// Prompts are tokenized with special-token parsing, as the reference pipeline does (chat-encoding.md
// §2.7), except for a chat prompt's plain spans: the text of the roles ModelInfo::chat's
// special_tokens_in leaves out (serve --special-tokens-in) is tokenized as ordinary characters. A
// completions string prompt is the client's own template: BOS in front, as Hugging Face tokenizers
// add it for DeepSeek models, and every special token parsed; token-id prompts are used as given.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/engine.h"
#include "server/api_error.h"
#include "server/image_parts.h"
#include "text/chat_encoding.h"
#include "text/tokenizer.h"

namespace dsv41::server {

// Responses and Messages (Anthropic's): a chat request underneath
enum class Endpoint { ChatCompletions, Completions, Responses, Messages };

// What validation needs to know about the served model.
struct ModelInfo {
  std::string name;            // the model id clients must use (listed first, echoed when a request names none)
  std::vector<std::string> aliases;  // other ids accepted for it (--served-model-name A,B: B is an alias)
  int64_t context_length = 0;  // prompt + max_tokens must fit
  // max_tokens when a request gives none: this, or the rest of the context if that is less (0: the
  // rest of the context). A cap, because the engine reserves KV memory for max_tokens up front and
  // the rest of a 1M-token context would not fit any budget.
  int64_t default_max_tokens = 0;
  int32_t bos_id = 0;
  const Tokenizer* tokenizer = nullptr;
  ChatOptions chat;            // server defaults for the chat template (thinking on or off)
  // Test hook (dsv41 serve --test-hooks): a request's "dsv41_forced_output" text becomes what the
  // model emits, token for token, so tool-call parsing can be checked end to end on a random model.
  bool test_hooks = false;
  int draft_block_size = 0;    // DSpark's drafts per step (0: the model has no drafter)
  const VisionConfig* vision = nullptr;  // the model's vision tower (null or disabled: images refused)
  ImageLimits images;          // per request: count, encoded bytes, pixels
  // serve --scheduling-policy priority: a request's "priority" orders it (otherwise only 0 is taken)
  bool priority_scheduling = false;
};

inline constexpr int kMaxTopLogprobs = 20;
inline constexpr size_t kMaxStopSequences = 16;
inline constexpr size_t kMaxJsonDepth = 128;     // deeper bodies are refused as the parser reaches the limit
inline constexpr size_t kMaxJsonMembers = 10000;  // so are objects of more members

struct ApiRequest {
  Endpoint endpoint = Endpoint::ChatCompletions;
  std::string model;            // echoed in responses
  bool stream = false;
  bool include_usage = false;   // stream_options.include_usage
  bool logprobs = false;        // return logprobs (top count in params.top_logprobs)
  bool echo = false;            // completions: the prompt text starts the returned text
  bool thinking = false;        // chat: the prompt ends inside <think>, so output starts as reasoning
  std::vector<std::string> tool_names;  // chat: the tools a generated call may name (ChatPrompt::tool_names)
  std::string prompt_text;      // chat: the rendered prompt; completions: the prompt as text
  RequestParams params;         // what the engine gets
  nlohmann::json responses_echo;  // Responses: the request fields the Response object repeats
};

// Parses and validates a request body. Throws ApiError (400, or 404 for an unknown model).
ApiRequest parse_request(Endpoint endpoint, std::string_view body, const ModelInfo& model);
ApiRequest parse_request_json(Endpoint endpoint, const nlohmann::ordered_json& body, const ModelInfo& model);
// The body as JSON with the client's key order kept, parsed in linear time (server/json_body.h), or a
// 400 that does not echo the body back: not JSON (with the error's position), not an object, nested
// past kMaxJsonDepth, an object of more than kMaxJsonMembers members, or a number outside a double's
// range (1e309).
nlohmann::ordered_json parse_json_body(std::string_view body);

// vLLM's /tokenize: {"prompt": TEXT, "add_special_tokens": true} (BOS first, as a completions
// prompt) or {"messages": [...]} (the rendered chat prompt, as a chat request), with an optional
// "model"; answers {"count", "max_model_len", "tokens"}. Throws ApiError for bad input.
nlohmann::json tokenize(std::string_view body, const ModelInfo& model);
// vLLM's /detokenize: {"tokens": [ids]} answers {"prompt": TEXT}. Throws ApiError for bad input.
nlohmann::json detokenize(std::string_view body, const ModelInfo& model);

}  // namespace dsv41::server
