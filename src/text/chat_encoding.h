// Renders an OpenAI-style chat request into the DeepSeek-V4.1 prompt string, following the release
// encoder (encoding/encoding.py) as restated in docs/chat-encoding.md. The result is meant to be
// tokenized with special-token parsing and without an extra BOS.
//
// The request must be a nlohmann::ordered_json: tool schemas, response_format and tool-call arguments
// are written back in the order the client sent their keys, and nlohmann::json would sort them. The
// overload taking nlohmann::json is deleted so that mistake does not compile.
//
// Request fields read (everything else is ignored):
//   messages                  array, required, non-empty. Roles: system, user, assistant, tool,
//                             latest_reminder; developer is rendered as system at index 0, else as
//                             user. content: string, null or an array of text / image_url / image
//                             parts (other part types render as "[Unsupported TYPE]").
//                             assistant: reasoning_content (or reasoning), tool_calls.
//                             tool: tool_call_id; needs an assistant tool call before it.
//   tools                     OpenAI function tools, rendered into the system message at index 0 (an
//                             empty one is inserted when there is none). Tools disable dropping.
//   tool_choice               "none" leaves the tools out; {"type":"function","function":{"name":N}}
//                             keeps only N; "auto" and "required" keep all (the prompt cannot force
//                             a call).
//   response_format           rendered into the index-0 system message; {"type":"text"} is ignored.
//   thinking / enable_thinking / thinking_mode / chat_template_kwargs.{thinking,enable_thinking}
//                             thinking on or off; any "off" wins. Default: ChatOptions::thinking.
//   reasoning_effort          integer 1..100 or low=50, high=75, max=100 (release table), plus
//                             minimal=50, medium=75, xhigh=75; "none" turns thinking off. Default 75.
//   drop_thinking             (also under chat_template_kwargs) bool; default ChatOptions::drop_thinking.
//   continue_final_message    bool: the last message must be an assistant turn; it is left open (no
//                             EOS) so generation continues it.
//   context                   messages already encoded: rendered output starts after them, no BOS;
//                             they still count for merging, ordering and the drop rule.
// Bad input throws dsv41::Error whose message starts with the offending field, e.g.
// "messages[2].role: unknown role \"bot\"".
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace dsv41 {

// Special-token strings of the V4.1 vocabulary that the prompt and the output parser use.
inline constexpr std::string_view kBosToken = "<｜begin▁of▁sentence｜>";
inline constexpr std::string_view kEosToken = "<｜end▁of▁sentence｜>";
inline constexpr std::string_view kSystemToken = "<｜System｜>";
inline constexpr std::string_view kUserToken = "<｜User｜>";
inline constexpr std::string_view kAssistantToken = "<｜Assistant｜>";
inline constexpr std::string_view kLatestReminderToken = "<｜latest_reminder｜>";
inline constexpr std::string_view kThinkOpen = "<think>";
inline constexpr std::string_view kThinkClose = "</think>";
inline constexpr std::string_view kImagePlaceholder = "<｜deepseek_image｜>";
// DSML tags; the space after ｜DSML｜ is part of the V4.1 tag names.
inline constexpr std::string_view kDsmlCallsOpen = "<｜DSML｜ calls>";
inline constexpr std::string_view kDsmlCallsClose = "</｜DSML｜ calls>";
inline constexpr std::string_view kDsmlInvokeOpen = "<｜DSML｜ invoke";
inline constexpr std::string_view kDsmlInvokeClose = "</｜DSML｜ invoke>";
inline constexpr std::string_view kDsmlParamOpen = "<｜DSML｜ parameter";
inline constexpr std::string_view kDsmlParamClose = "</｜DSML｜ parameter>";

struct ChatOptions {
  bool thinking = true;       // used when the request does not say (server policy; vLLM's default)
  bool drop_thinking = true;  // the release encoder's default; a request may override it
  bool add_bos = true;        // write BOS at the start (never with a context)
};

struct ChatPrompt {
  std::string text;
  bool thinking = false;  // the mode rendered (thinking vs chat)
  // Whether generation begins inside reasoning: thinking mode and the prompt ends with the open
  // <think> header (possibly followed by a latest_reminder). False for chat mode and for a
  // continued assistant turn, whose reasoning is already closed. Pass it to ChatOutputOptions.
  bool starts_in_reasoning = false;
  // One record per <｜deepseek_image｜> of the rendered (non-context) messages, in prompt order:
  // {"type":"image","url":...} for image_url parts, or the source/url/data keys of image parts.
  std::vector<nlohmann::ordered_json> images;
};

ChatPrompt render_chat(const nlohmann::ordered_json& request, const ChatOptions& options = {});
// Deleted: a nlohmann::json has already lost the client's key order (see the top of this file).
ChatPrompt render_chat(const nlohmann::json& request, const ChatOptions& options = {}) = delete;

inline std::string render_chat_prompt(const nlohmann::ordered_json& request, const ChatOptions& options = {}) {
  return render_chat(request, options).text;
}
std::string render_chat_prompt(const nlohmann::json& request, const ChatOptions& options = {}) = delete;

// JSON text exactly as Python's json.dumps(value, ensure_ascii=False) writes it: ", " and ": "
// separators, raw UTF-8, Python float repr (0.0, 1e-05, 1e+16), NaN / Infinity.
std::string python_json_dumps(const nlohmann::ordered_json& value);
// Appends `text` as a JSON string literal (quotes included) with the same escaping rules.
void append_python_json_string(std::string& out, std::string_view text);
// Appends the escaped characters of `text` without the surrounding quotes.
void append_python_json_escaped(std::string& out, std::string_view text);

}  // namespace dsv41
