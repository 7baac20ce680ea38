// The byte-level alphabet of GPT-2 style BPE tokenizers (DeepSeek's included): every byte maps to a
// printable Unicode character, so token strings in tokenizer.json are text. Printable Latin-1 bytes
// map to themselves; the other 68 bytes map to U+0100 onward in byte order.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace dsv41 {

char32_t byte_to_unicode(unsigned char byte);
// The byte a code point stands for, if it is one of the 256 alphabet characters.
std::optional<unsigned char> unicode_to_byte(char32_t code_point);

// Raw bytes -> their token-string form (UTF-8), e.g. " the" -> "Ġthe".
std::string bytes_to_token_text(std::string_view bytes);
// Token-string form -> raw bytes; nullopt if a character is outside the alphabet or the text is
// not valid UTF-8.
std::optional<std::string> token_text_to_bytes(std::string_view text);

void append_utf8(std::string& out, char32_t code_point);

}  // namespace dsv41
