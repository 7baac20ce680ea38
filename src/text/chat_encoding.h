// Renders an OpenAI-style chat request into the DeepSeek-V4.1 prompt string, following the release
// encoder (encoding/encoding.py) as restated in docs/chat-encoding.md. The result is meant to be
// tokenized with special-token parsing outside its plain spans (Tokenizer::encode(text, plain_spans))
// and without an extra BOS.
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
// Special tokens written inside message text ("<｜User｜>", "</think>", "｜DSML｜", EOS) become control
// tokens in the reference, which tokenizes the whole prompt with special-token parsing
// (chat-encoding.md §2.7): a tool result could close its turn and forge a system one. Here that holds
// only for the roles ChatOptions::special_tokens_in names; the text of the others (content, reasoning,
// tool-call names and arguments, tool results) is recorded in ChatPrompt::plain_spans, and the template's
// own markup around it stays control tokens. The rendered text is the same either way; only its
// tokenization differs, and only where such text holds a special token's characters.
// Bad input throws dsv41::Error whose message starts with the offending field, e.g.
// "messages[2].role: unknown role \"bot\"".
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/tokenizer.h"

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

// The roles whose message text may write control tokens (the rest is tokenized as plain characters).
// The default trusts the text the application writes itself and nothing a third party can reach:
//   system (developer at index 0), latest_reminder: the operator's or application's instructions;
//   tool: a tool result carries whatever the tool read (a web page, a file), the classic injection;
//   user: the person typing, or a document pasted for them, is not the operator either, and a chat
//         user has no business writing the template's markers;
//   assistant: history the client sends back, where a document the model once copied into its answer
//         would otherwise turn into control tokens on the next turn.
// All five on is the reference encoder's behaviour. developer counts as the role it renders as.
struct SpecialTokenRoles {
  bool system = true;
  bool user = false;
  bool assistant = false;
  bool tool = false;
  bool latest_reminder = true;

  bool parses(std::string_view role) const;  // role: system, user, assistant, tool or latest_reminder
};
// "all", "none" or a comma-separated list of system, user, assistant, tool, latest_reminder. Bad input
// throws Error naming `where` (e.g. the command-line flag).
SpecialTokenRoles parse_special_token_roles(std::string_view list, const std::string& where);

struct ChatOptions {
  bool thinking = true;       // used when the request does not say (server policy; vLLM's default)
  bool drop_thinking = true;  // the release encoder's default; a request may override it
  bool add_bos = true;        // write BOS at the start (never with a context)
  SpecialTokenRoles special_tokens_in;  // server policy: no request field changes it
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
  // The spans of `text` written from message text of roles outside ChatOptions::special_tokens_in, in
  // order: tokenize with Tokenizer::encode(text, plain_spans) and their characters stay ordinary text.
  std::vector<TextSpan> plain_spans;
  // The tools the prompt offers the model (namespace-qualified as rendered, after tool_choice; none
  // with tool_choice "none"): the only names a generated call may use (ChatOutputOptions::tools).
  std::vector<std::string> tool_names;
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
