// Mirrors engram.py's build_compressed_token_map, which decodes with HF tokenizers' Rust backend and
// normalises with a tokenizers normalizer Sequence. Each step below names the Rust behaviour it copies,
// because a single differing key shifts every later compressed id and the map's size.
#include "text/engram_token_map.h"

#include <cstdlib>
#include <string_view>
#include <unordered_map>

#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include "text/byte_level.h"
#include "util/error.h"

namespace dsv41 {

namespace {

// engram.py parks a lone space on this private-use character so Strip cannot erase it.
constexpr char32_t kSentinel = 0xE000;

std::string utf8proc_transform(const std::string& text, int options) {
  utf8proc_uint8_t* out = nullptr;
  // Explicit length (no UTF8PROC_NULLTERM): the byte-0 token decodes to "\0" and must survive.
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          static_cast<utf8proc_ssize_t>(text.size()), &out,
                                          static_cast<utf8proc_option_t>(UTF8PROC_STABLE | options));
  if (n < 0) fail("engram_normalize", std::string("not normalisable UTF-8: ") + utf8proc_errmsg(n));
  std::string result(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return result;
}

// Rust's char::is_whitespace: the Unicode White_Space property (what tokenizers' Strip tests).
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Strict UTF-8 check (utf8proc rejects overlongs, surrogates and > U+10FFFF, as Rust does). Rust's
// from_utf8_lossy turns any invalid byte into U+FFFD, and engram.py only asks whether U+FFFD is present,
// so an invalid sequence and a literal U+FFFD are the same verdict.
bool decodes_with_replacement(std::string_view bytes) {
  if (bytes.find("\xEF\xBF\xBD") != std::string_view::npos) return true;
  for (size_t i = 0; i < bytes.size();) {
    utf8proc_int32_t cp = 0;
    const utf8proc_ssize_t len = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(bytes.data() + i),
                                                  static_cast<utf8proc_ssize_t>(bytes.size() - i), &cp);
    if (len <= 0) return true;
    i += static_cast<size_t>(len);
  }
  return false;
}

// tokenizers' ByteLevel decoder: each alphabet character becomes its byte; a character outside the
// alphabet is passed through as its own UTF-8 (token_text_to_bytes refuses those, hence the fallback).
std::string byte_level_decode(const std::string& token) {
  if (auto bytes = token_text_to_bytes(token)) return *bytes;
  std::string out;
  for (size_t i = 0; i < token.size();) {
    utf8proc_int32_t cp = 0;
    const utf8proc_ssize_t len = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(token.data() + i),
                                                  static_cast<utf8proc_ssize_t>(token.size() - i), &cp);
    if (len <= 0) fail("tokenizer.json", "token is not valid UTF-8");
    if (auto b = unicode_to_byte(static_cast<char32_t>(cp))) {
      out += static_cast<char>(*b);
    } else {
      out.append(token, i, static_cast<size_t>(len));
    }
    i += static_cast<size_t>(len);
  }
  return out;
}

}  // namespace

std::string engram_normalize(const std::string& utf8_text) {
  // NFKC, then NFD. Unicode versions differ: utf8proc 2.8 is Unicode 15, tokenizers' normalisation
  // tables are older (about Unicode 10) and Rust's lowercase is newer, so 546 code points below U+30000
  // (marks and compatibility forms added late, letters new in Unicode 16) normalise differently. None
  // occurs in the DeepSeek V3 vocab, whose whole map equals the Rust backend's; not worth a table here.
  const std::string nfkc = utf8proc_transform(utf8_text, UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
  const std::string nfd = utf8proc_transform(nfkc, UTF8PROC_DECOMPOSE);
  std::u32string s;
  for (size_t i = 0; i < nfd.size();) {
    utf8proc_int32_t cp = 0;
    i += static_cast<size_t>(utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(nfd.data() + i),
                                              static_cast<utf8proc_ssize_t>(nfd.size() - i), &cp));
    // StripAccents: tokenizers filters unicode-normalization's is_combining_mark, which is the whole
    // General_Category=Mark (Mn, Mc and Me), not just Mn: "a\u0903" (Mc) normalises to "a".
    const utf8proc_category_t cat = utf8proc_category(cp);
    if (cat == UTF8PROC_CATEGORY_MN || cat == UTF8PROC_CATEGORY_MC || cat == UTF8PROC_CATEGORY_ME) continue;
    // Lowercase: Rust's char::to_lowercase, i.e. the simple mapping utf8proc_tolower gives plus the one
    // unconditional multi-char rule, U+0130 -> "i\u0307". NFD has already split U+0130 into I + U+0307
    // (and the mark is gone), so the branch is for fidelity only. Per char, so no final-sigma rule.
    if (cp == 0x130) {
      s += U"i\u0307";
      continue;
    }
    const char32_t c = static_cast<char32_t>(utf8proc_tolower(cp));
    // Replace("[ \t\r\n]+", " "): every such char becomes a space, and a space right after one is a run.
    const bool blank = c == U' ' || c == U'\t' || c == U'\r' || c == U'\n';
    if (!blank) {
      s += c;
    } else if (s.empty() || s.back() != U' ') {
      s += U' ';
    }
  }
  // Replace("^ $", sentinel): the string is exactly one space (no '\n' is left for ^/$ to match at).
  if (s == U" ") s = std::u32string(1, kSentinel);
  // Strip both ends, then Replace(sentinel, " ") — which also turns any U+E000 of the text into a space.
  size_t begin = 0, end = s.size();
  while (begin < end && is_white_space(s[begin])) ++begin;
  while (end > begin && is_white_space(s[end - 1])) --end;
  std::string out;
  for (size_t i = begin; i < end; ++i) append_utf8(out, s[i] == kSentinel ? U' ' : s[i]);
  return out;
}

EngramTokenMap build_engram_token_map(const nlohmann::json& tokenizer, int64_t vocab_size) {
  if (vocab_size < 0) fail("engram token map", "negative vocab size");
  const size_t n = static_cast<size_t>(vocab_size);
  std::vector<std::string> token(n);              // id_to_token
  std::vector<unsigned char> kind(n, 0);          // 0 absent, 1 model vocab, 2 added token
  try {
    for (const auto& [text, id_json] : tokenizer.at("model").at("vocab").items()) {
      const int64_t id = id_json.get<int64_t>();
      if (id < 0 || id >= vocab_size) continue;
      token[id] = text;
      kind[id] = 1;
    }
    // Added tokens come second so they win over a model token with the same id, as in HF.
    for (const auto& added : tokenizer.value("added_tokens", nlohmann::json::array())) {
      const int64_t id = added.at("id").get<int64_t>();
      if (id < 0 || id >= vocab_size) continue;
      token[id] = added.at("content").get<std::string>();
      kind[id] = 2;
    }
  } catch (const nlohmann::json::exception& e) {
    fail("tokenizer.json", std::string("bad model.vocab or added_tokens: ") + e.what());
  }

  EngramTokenMap map;
  map.compressed.resize(n);
  std::unordered_map<std::string, int64_t> key_to_id;
  for (size_t t = 0; t < n; ++t) {
    // The Rust decoder emits added tokens' content verbatim; an absent id decodes to "".
    const std::string text = kind[t] == 1 ? byte_level_decode(token[t]) : token[t];
    std::string key;
    if (decodes_with_replacement(text)) {
      key = token[t];  // a partial UTF-8 byte token: keyed by its raw token string
    } else {
      key = engram_normalize(text);
      if (key.empty()) key = text;
    }
    // First appearance assigns the next id.
    const auto next = static_cast<int64_t>(key_to_id.size());
    map.compressed[t] = key_to_id.try_emplace(std::move(key), next).first->second;
  }
  map.size = static_cast<int64_t>(key_to_id.size());
  return map;
}

}  // namespace dsv41
