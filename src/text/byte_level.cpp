#include "text/byte_level.h"

#include <array>

namespace dsv41 {

namespace {

struct Tables {
  std::array<char32_t, 256> to_unicode{};
  Tables() {
    auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) to_unicode[b] = printable(b) ? static_cast<char32_t>(b) : next++;
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

// Decodes one UTF-8 code point at s[i], advancing i; nullopt on malformed input.
std::optional<char32_t> next_code_point(std::string_view s, size_t& i) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (len == 0 || i + len > s.size()) return std::nullopt;
  char32_t cp = len == 1 ? c : c & (0x7F >> len);
  for (int k = 1; k < len; ++k) {
    unsigned char cc = static_cast<unsigned char>(s[i + k]);
    if ((cc >> 6) != 2) return std::nullopt;
    cp = (cp << 6) | (cc & 0x3F);
  }
  i += len;
  return cp;
}

}  // namespace

char32_t byte_to_unicode(unsigned char byte) { return tables().to_unicode[byte]; }

std::optional<unsigned char> unicode_to_byte(char32_t cp) {
  if (cp < 256) {
    if (tables().to_unicode[cp] == cp) return static_cast<unsigned char>(cp);
    return std::nullopt;
  }
  for (int b = 0; b < 256; ++b) {
    if (tables().to_unicode[b] == cp) return static_cast<unsigned char>(b);
  }
  return std::nullopt;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string bytes_to_token_text(std::string_view bytes) {
  std::string out;
  for (char c : bytes) append_utf8(out, byte_to_unicode(static_cast<unsigned char>(c)));
  return out;
}

std::optional<std::string> token_text_to_bytes(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    auto cp = next_code_point(text, i);
    if (!cp) return std::nullopt;
    auto b = unicode_to_byte(*cp);
    if (!b) return std::nullopt;
    out += static_cast<char>(*b);
  }
  return out;
}

}  // namespace dsv41
