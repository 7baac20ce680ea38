// OpenAI's rules for the message and tool fields of a chat request, checked before the V4.1 encoder
// renders it. The encoder takes some fields as loosely as the reference encoder does (an unknown
// content part renders as "[Unsupported TYPE]", arguments that are not an object as one string
// parameter, a tool result needs no call id); a server answers each of those with a 400 naming the
// field instead, so a client learns of its mistake rather than the model seeing a garbled prompt:
//   messages[i].name                        a string
//   messages[i].content[k].type             text, image_url or image; a text part needs a string text
//   messages[i].tool_calls                  on assistant messages only; each call's id a non-empty
//                                           string, unique in its message; function.arguments JSON
//                                           text of an object (or an object, or that text encoded twice)
//   messages[i].tool_call_id                tool messages: a non-empty string naming a call of the
//                                           latest assistant message with calls
//   tools[k].function.description / .parameters / .strict   a string / an object / a boolean
//   tool_choice.type                        "function" when given
// The same walk covers `context` (messages already encoded) before `messages`. Types the encoder
// itself checks (roles, content, names, tool_choice strings) are left to it.
#pragma once

#include "server/json_fields.h"

namespace dsv41::server {

// Throws ApiError (400) naming the first field that breaks a rule above.
void check_chat_fields(const ojson& body);

// Whether `arguments` is what a tool call's function.arguments may be: an object, JSON text of one,
// or that text encoded as a JSON string once more.
bool is_arguments_object(const ojson& arguments);

}  // namespace dsv41::server
