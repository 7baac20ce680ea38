// Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens), which coding agents and
// their SDKs speak, translated into the chat request it is rendered as:
//   system (a string or text blocks)          the system message (blocks joined by newlines)
//   a user message's text and image blocks    a user message; its tool_result blocks become tool
//                                             messages, placed before the rest of its content
//   an assistant message's blocks             text -> content, thinking -> reasoning_content,
//                                             tool_use -> tool_calls (input as the arguments);
//                                             redacted_thinking is opaque to this model and skipped
//   tools: name, description, input_schema    function tools (parameters: input_schema)
//   tool_choice: auto, any, tool, none        auto, required, the named function, none
//   thinking: enabled (budget_tokens) or      V4.1's thinking mode on or off; the budget is checked as
//             disabled                        Anthropic does (>= 1024, below max_tokens) but not
//                                             enforced: the model ends its reasoning itself
//   stop_sequences, temperature (0..1), top_p, top_k, max_tokens (required), stream, metadata
// dsv41's extension fields of the chat route (speculative, draft_length, prefill_mode, ...) pass through.
// Every Messages-only rule is checked here, naming the Messages field.
//
// Not supported (400 naming the field): document, search_result and server-tool blocks, image sources
// other than base64 (the server fetches nothing), tools of another type than custom (server tools),
// mcp_servers, container, and service_tier other than auto / standard_only.
#pragma once

#include <string_view>

#include <nlohmann/json.hpp>

#include "server/openai_api.h"

namespace dsv41::server {

// Parses and validates a Messages request into the chat request it stands for (endpoint Messages).
// `counting`: a count_tokens body, which has no max_tokens and is not generated.
ApiRequest parse_messages_request(std::string_view body, const ModelInfo& model, bool counting = false);

// The error body of this API: {"type": "error", "error": {"type", "message"}}, the type from the
// status as Anthropic names them (invalid_request_error, authentication_error, ..., overloaded_error).
nlohmann::json messages_error_body(const ApiError& error);

}  // namespace dsv41::server
