#include "text/tiny_tokenizer.h"

#include <nlohmann/json.hpp>

#include "text/bpe_trainer.h"
#include "text/engram_token_map.h"
#include "text/byte_level.h"
#include "util/error.h"

namespace dsv41 {

using nlohmann::json;

namespace {

// A few paragraphs of plain English to learn merges from; written for this purpose.
constexpr const char* kTrainingText = R"(
The engine reads the model from disk and keeps the weights where they are, mapped into memory.
Each prompt is split into tokens, and each token becomes a row of numbers that flows through the
layers. A layer looks back at what came before through its attention, then passes the result to a
small group of experts chosen for that token. The first layers see every token of the prompt; the
later layers only need the last part of it, because their memory is short and slides along.
When a new request shares the start of an earlier one, the engine does not compute that start again.
It keeps the compressed rows of the shared part and rebuilds the short window by running the last
few tokens once more. This is cheaper than storing everything, and the answer stays the same.
Numbers are stored in small formats: eight bits for most weights, four bits for the experts, and a
scale for every block of thirty two values. The engine checks every file it reads and every request
it gets, and says clearly what is wrong when something is not right.
A draft model guesses the next five tokens, and the main model checks all of them in one pass. If
the guesses are good, several tokens come out for the price of one; if not, the engine goes back and
forgets what it should never have seen. The server answers many users at once, one step at a time,
and gives each of them a fair share of the machine. Time to first token, tokens per second, and the
bytes read per token are measured on the same machine and compared with what the hardware can do.
In 2026 the model has 40 layers, 384 experts, and a window of 128 tokens; its cache needs 890 bytes
for every token of context. Hello, world! What is the capital of France? The quick brown fox jumps
over the lazy dog. She said: "Let's write the code, test it, and measure it." Then they did it again.
)";

constexpr const char* kSpecials[] = {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"};

json added_token(int64_t id, const std::string& content) {
  return {{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", false}, {"special", true}};
}

}  // namespace

const std::vector<std::string>& tiny_special_tokens() {
  static const std::vector<std::string> specials = {
      "<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
      "｜DSML｜", "<｜latest_reminder｜>", "<｜deepseek_image｜>"};
  return specials;
}

int64_t tiny_special_id(int64_t vocab_size, const std::string& token) {
  for (size_t i = 0; i < std::size(kSpecials); ++i) if (token == kSpecials[i]) return static_cast<int64_t>(i);
  const auto& tail = tiny_special_tokens();
  for (size_t i = 0; i < tail.size(); ++i) {
    if (tail[i] == token) return vocab_size - static_cast<int64_t>(tail.size() - i);
  }
  fail("tokenizer", "no special token " + token);
}

json build_tiny_tokenizer(int64_t vocab_size) { return build_bpe_tokenizer(vocab_size, kTrainingText); }

json build_tiny_tokenizer_for_engram(int64_t vocab_size, int64_t engram_compressed_size) {
  json tok = build_tiny_tokenizer(vocab_size);
  const int64_t distinct = build_engram_token_map(tok, vocab_size).size;
  int64_t merge = distinct - engram_compressed_size;  // fillers to fold onto earlier ones
  json& added = tok["added_tokens"];
  std::vector<size_t> fillers;
  for (size_t i = 0; i < added.size(); ++i) {
    if (added[i]["content"].get<std::string>().rfind("<｜reserved_", 0) == 0) fillers.push_back(i);
  }
  if (merge < 0 || static_cast<size_t>(merge) * 2 > fillers.size()) {
    fail("tokenizer", "a " + std::to_string(vocab_size) + "-id tiny tokenizer has " + std::to_string(distinct) +
                          " Engram ids and cannot be folded to " + std::to_string(engram_compressed_size));
  }
  // Filler k from the end takes filler k's name in upper case: "<｜RESERVED_k｜>" lowercases to it.
  for (int64_t k = 0; k < merge; ++k) {
    json& t = added[fillers[fillers.size() - 1 - static_cast<size_t>(k)]];
    std::string name = added[fillers[static_cast<size_t>(k)]]["content"].get<std::string>();
    const std::string from = "reserved", to = "RESERVED";
    name.replace(name.find(from), from.size(), to);
    tok["model"]["vocab"].erase(t["content"].get<std::string>());
    tok["model"]["vocab"][name] = t["id"];
    t["content"] = name;
  }
  return tok;
}

json build_bpe_tokenizer(int64_t vocab_size, std::string_view training_text) {
  const int64_t fixed = static_cast<int64_t>(std::size(kSpecials) + 256 + tiny_special_tokens().size());
  if (vocab_size < fixed) {
    fail("tokenizer", "vocab_size " + std::to_string(vocab_size) + " is too small: the specials and the 256 byte "
                      "tokens alone need " + std::to_string(fixed));
  }
  json vocab = json::object();
  json added = json::array();
  int64_t id = 0;
  for (const char* s : kSpecials) {
    vocab[s] = id;
    added.push_back(added_token(id++, s));
  }
  for (int b = 0; b < 256; ++b) vocab[bytes_to_token_text(std::string(1, static_cast<char>(b)))] = id++;
  const int64_t learned_end = vocab_size - static_cast<int64_t>(tiny_special_tokens().size());
  json merges = json::array();
  for (const auto& [a, b] : learn_bpe_merges(training_text, static_cast<size_t>(learned_end - id))) {
    vocab[a + b] = id++;
    merges.push_back(a + " " + b);
  }
  for (int64_t k = 0; id < learned_end; ++k) {  // the text ran out of pairs: reserved ids
    std::string s = "<｜reserved_" + std::to_string(k) + "｜>";
    vocab[s] = id;
    added.push_back(added_token(id++, s));
  }
  for (const std::string& s : tiny_special_tokens()) {
    vocab[s] = id;
    added.push_back(added_token(id++, s));
  }

  auto split = [](const char* regex) {
    return json{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}};
  };
  json pre = {{"type", "Sequence"},
              {"pretokenizers",
               {split("\\p{N}{1,3}"), split("[一-龥぀-ゟ゠-ヿ]+"),
                split("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| "
                      "?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
                {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}};
  return {
      {"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}, {"added_tokens", added},
      {"normalizer", {{"type", "Sequence"}, {"normalizers", json::array()}}}, {"pre_tokenizer", pre},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"vocab", vocab},
        {"merges", merges}}},
  };
}

}  // namespace dsv41
