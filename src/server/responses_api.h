// The OpenAI Responses API (POST /v1/responses), which agent clients use, translated into the chat
// request it is rendered as: `instructions` become the system message, `input` items become chat
// messages (message → its role's message, function_call → an assistant tool call, function_call_output
// → a tool message, reasoning → the next assistant turn's reasoning_content), function tools and
// tool_choice take the chat shape, reasoning.effort becomes reasoning_effort, text.format becomes
// response_format, max_output_tokens becomes max_tokens. Sampling fields and dsv41's extension fields
// are the chat route's. Every Responses-only rule is checked here, naming the Responses field; what is
// left is validated by the chat route.
//
// Not supported (400 naming the field): previous_response_id, conversation and item_reference (this
// server keeps no responses: send the whole conversation in `input`), background, non-function
// tools, input_file and input_audio parts.
#pragma once

#include <string_view>

#include "server/openai_api.h"

namespace dsv41::server {

// Parses and validates a Responses request. The result is a chat request (endpoint Responses) whose
// `responses_echo` holds the request fields a Response object repeats back.
ApiRequest parse_responses_request(std::string_view body, const ModelInfo& model);

}  // namespace dsv41::server
