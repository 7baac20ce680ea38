// Byte-level BPE tokenizer loaded from a Hugging Face tokenizer.json as DeepSeek ships it: added
// tokens are cut out of the text first, the rest goes through the Split/ByteLevel pre-tokenizers and
// the BPE merges. Encoding matches the `tokenizers` library for such files; encode() never adds BOS.
//
// Supported tokenizer.json subset (anything else is rejected with an Error naming the file):
//   normalizer     null or an empty Sequence
//   pre_tokenizer  Sequence of Split{Regex|String, behavior Isolated|Removed, invert false} ending in
//                  ByteLevel{add_prefix_space false}; a lone ByteLevel (use_regex: the GPT-2 pattern)
//   model          BPE with merges as "a b" strings or [a, b] pairs, no subword prefix/suffix, no dropout
//   decoder        null or ByteLevel
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace dsv41 {

// Bytes [begin, end) of a text.
struct TextSpan {
  size_t begin = 0;
  size_t end = 0;
  bool operator==(const TextSpan&) const = default;
};

class Tokenizer {
 public:
  // Throws Error("<path>: <problem>") for a missing or unreadable file, malformed JSON or an
  // unsupported tokenizer layout.
  static Tokenizer from_file(const std::string& path);
  // `where` names the source in error messages (a path, or e.g. "tiny tokenizer").
  static Tokenizer from_json(const nlohmann::json& j, const std::string& where);

  // Token ids of `text`; no BOS/EOS is added. With parse_special, added tokens written in the text
  // (e.g. "<｜User｜>") become their ids; without it no added token is recognised at all, so the
  // text is tokenized as plain characters. (This is stricter than the `tokenizers` library's
  // split_special_tokens, which still recognises added tokens not flagged special, and DeepSeek flags
  // its role markers non-special; the stricter rule is what keeps user text from forging them.)
  // Invalid UTF-8 is tokenized byte for byte; it never throws.
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;
  // Token ids of `text` with special-token parsing everywhere but inside `plain`: an added token is
  // recognised only where it lies wholly outside those spans, and the spans' characters are tokenized
  // as ordinary text, BPE merges running across the span edges as they do across any text. With no
  // spans this is encode(text). This is how a chat prompt keeps untrusted message text from writing
  // control tokens (ChatPrompt::plain_spans). The spans must be in order, disjoint and inside `text`
  // (Error otherwise).
  std::vector<int32_t> encode(std::string_view text, std::span<const TextSpan> plain) const;

  // Text of `ids`: byte tokens are mapped back to bytes, added tokens give their content (dropped
  // when skip_special and the token is special), unknown ids give nothing. Bytes that do not form
  // valid UTF-8 become U+FFFD, one per maximal invalid sequence, as the `tokenizers` library does.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;

  // The raw bytes one id stands for (no UTF-8 repair); empty for an unknown id.
  std::string token_bytes(int32_t id) const;
  // The id's string as written in tokenizer.json (e.g. "Ġthe"); empty for an unknown id.
  std::string token_text(int32_t id) const;
  // The id of a vocab string or added token content, if there is one.
  std::optional<int32_t> token_id(std::string_view token) const;
  // Largest id (vocab or added tokens) + 1.
  int32_t vocab_size() const;
  // True for added tokens flagged "special" in tokenizer.json.
  bool is_special(int32_t id) const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  // Shared and immutable (apart from an internally locked cache), so copies are cheap and a
  // tokenizer can be used from several threads at once.
  std::shared_ptr<const Impl> impl_;
};

// Decodes ids one at a time for streaming output: push() returns only complete UTF-8 text, holding
// back the start of a character whose remaining bytes are still to come. Bytes that can no longer
// become valid UTF-8 come out as U+FFFD at once; an incomplete character still held at flush() comes
// out as one U+FFFD. The concatenation of all push() results and flush() equals decode(all ids).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  std::string push(int32_t id);
  std::string flush();

 private:
  Tokenizer tokenizer_;  // a cheap shared copy, so the decoder cannot outlive its tables
  std::string pending_;  // bytes of an incomplete character
};

}  // namespace dsv41
