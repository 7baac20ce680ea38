// dsv41 tokenizer: the engine's tokenizer as a tool for preparing a model's data. `train` learns a
// byte-level BPE tokenizer.json of DeepSeek's layout (the chat specials included) from a text,
// `encode` writes a text's token ids, and `engram-map` writes the Engram compressed token map the
// engine derives from a tokenizer, so that offline tools (tools/train) hash exactly as it does.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli.h"
#include "commands.h"
#include "io/safetensors_writer.h"
#include "text/engram_token_map.h"
#include "text/tiny_tokenizer.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace dsv41::cli {

namespace {

constexpr const char* kHelp = R"(usage: dsv41 tokenizer <action> [options]

  train -f TEXT --vocab N -o tokenizer.json
        learn byte-level BPE merges from TEXT; ids 0-2 are BOS, EOS and pad, then the 256 bytes,
        the merges, and DeepSeek's chat specials (<｜User｜>, <｜Assistant｜>, <think>, ...) last
  encode -t tokenizer.json -f TEXT -o IDS
        the token ids of TEXT (no BOS added) as little-endian uint32
  engram-map -t tokenizer.json --vocab N -o MAP
        the Engram compressed id of every token id 0..N-1 as little-endian int32, as the engine
        derives it (model-spec 3.6); prints the map's size (engram_compressed_vocab_size)
)";

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot be opened");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) fail(path, "read failed");
  return text;
}

template <typename T>
void write_array(const std::string& path, const std::vector<T>& values) {
  write_file_atomic(path, values.data(), values.size() * sizeof(T));
}

int64_t parse_vocab(const Args& args) {
  args.required("--vocab");
  return args.get_int("--vocab", 0, 1, int64_t{1} << 24);
}

int train(int argc, char** argv) {
  Args args("tokenizer train", argc, argv, {"--file", "--vocab", "--out"}, {}, {{"-f", "--file"}, {"-o", "--out"}});
  if (!args.positional().empty()) fail(args.positional()[0], "unexpected argument");
  const std::string text = read_text(args.required("--file"));
  const int64_t vocab = parse_vocab(args);
  const nlohmann::json tokenizer = build_bpe_tokenizer(vocab, text);
  const std::string out = tokenizer.dump(2) + "\n";
  write_file_atomic(args.required("--out"), out.data(), out.size());
  std::fprintf(stderr, "%s: %lld ids, %zu merges learned from %zu bytes\n", args.required("--out").c_str(),
               static_cast<long long>(vocab), tokenizer["model"]["merges"].size(), text.size());
  return 0;
}

int encode(int argc, char** argv) {
  Args args("tokenizer encode", argc, argv, {"--tokenizer", "--file", "--out"}, {},
            {{"-t", "--tokenizer"}, {"-f", "--file"}, {"-o", "--out"}});
  if (!args.positional().empty()) fail(args.positional()[0], "unexpected argument");
  const Tokenizer tokenizer = Tokenizer::from_file(args.required("--tokenizer"));
  const std::string text = read_text(args.required("--file"));
  const std::vector<int32_t> ids = tokenizer.encode(text, /*parse_special=*/false);
  write_array(args.required("--out"), std::vector<uint32_t>(ids.begin(), ids.end()));
  std::fprintf(stderr, "%s: %zu tokens, %.2f bytes per token\n", args.required("--out").c_str(), ids.size(),
               ids.empty() ? 0.0 : static_cast<double>(text.size()) / static_cast<double>(ids.size()));
  return 0;
}

int engram_map(int argc, char** argv) {
  Args args("tokenizer engram-map", argc, argv, {"--tokenizer", "--vocab", "--out"}, {},
            {{"-t", "--tokenizer"}, {"-o", "--out"}});
  if (!args.positional().empty()) fail(args.positional()[0], "unexpected argument");
  const std::string path = args.required("--tokenizer");
  const nlohmann::json j = read_json_file(path);
  const EngramTokenMap map = build_engram_token_map(j, parse_vocab(args));
  write_array(args.required("--out"), std::vector<int32_t>(map.compressed.begin(), map.compressed.end()));
  std::printf("%lld\n", static_cast<long long>(map.size));
  return 0;
}

}  // namespace

int run_tokenizer(int argc, char** argv) {
  if (argc < 1 || !std::strcmp(argv[0], "--help") || !std::strcmp(argv[0], "-h")) {
    std::fputs(kHelp, argc < 1 ? stderr : stdout);
    return argc < 1 ? 2 : 0;
  }
  const std::string action = argv[0];
  if (wants_help(argc - 1, argv + 1)) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  if (action == "train") return train(argc - 1, argv + 1);
  if (action == "encode") return encode(argc - 1, argv + 1);
  if (action == "engram-map") return engram_map(argc - 1, argv + 1);
  fail(action, "unknown tokenizer action (expected train, encode or engram-map)");
}

}  // namespace dsv41::cli
