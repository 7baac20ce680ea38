#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "util/error.h"
#include "commands.h"
#include "io/config.h"
#include "model/model_stats.h"
#include "model/released_layout.h"
#include "model/synthetic_checkpoint.h"
#include "released_config.h"
#include "text/tiny_tokenizer.h"

namespace dsv41::cli {

bool wants_help(int argc, char** argv) {
  for (int i = 0; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) return true;
  }
  return false;
}

int run_make_tiny(int argc, char** argv) {
  if (wants_help(argc, argv)) {
    std::puts(
        "usage: dsv41 make-tiny --out DIR [--preset tiny|small|bench|long|stream|released-sparse] [--seed N]\n"
        "                       [--tokenizer FILE] [--config FILE] [--experts N] [--vision]\n\n"
        "Presets: tiny (hidden 128, 4K positions), small (hidden 512), bench (the released per-layer\n"
        "widths, 8 layers), long (tiny's widths with the released 128-token window, 1M positions, top-k 64\n"
        "and a 256-block pool: selection is sparse from a few thousand tokens on).\n"
        "Writes a complete checkpoint with seeded random weights in the released layout: config.json,\n"
        "inference/config.json, tokenizer.json, sharded safetensors with model.safetensors.index.json,\n"
        "FP8 dense weights with 32x32 UE8M0 scales, MXFP4 experts, FP8 Engram tables, mtp.* DSpark blocks.\n"
        "--tokenizer uses that tokenizer.json (e.g. from 'dsv41 tokenizer train') instead of the built-in\n"
        "one: the vocabulary, DSpark's noise token and the Engram tables follow it.\n"
        "--vision adds a vision tower (ViT, aligner, span vectors, every layer's bias_vl): the released\n"
        "tower's geometry (32 layers of 1024) on bench, the golden tiny-vision tower's (2 layers of 64) on\n"
        "the others.\n\n"
        "stream: the released config's 40 layers at their released widths and roles, with --experts routed\n"
        "experts a layer (default 32; 8 in the DSpark blocks), a 32K vocabulary and Engram tables over a\n"
        "100K n-gram vocabulary: about 34 GB of random weights, for runs whose experts do not fit in RAM.\n\n"
        "released-sparse: the released checkpoint's layout at full size without its data: the released\n"
        "config.json (built in, from configs/deepseek-v4.1-flash; --config another), every one of its\n"
        "96,085 tensors with its name, dtype and shape in 48 shards with the index, the data left as holes\n"
        "of sparse files (510 GB apparent, a few MB on disk; read back as zeros). tokenizer.json is\n"
        "--tokenizer's, else a generated one of the released vocabulary's size whose Engram compressed\n"
        "vocabulary is the config's (the released tokenizer is not part of this project).");
    return 0;
  }
  Args args("make-tiny", argc, argv, {"--out", "--preset", "--seed", "--tokenizer", "--config", "--experts"}, {"--vision"},
            {{"-o", "--out"}});
  if (!args.positional().empty()) fail(args.positional()[0], "unexpected argument (the folder goes after --out)");
  const std::string out = args.required("--out");
  const std::string preset = args.get("--preset", "tiny");
  if (preset == "released-sparse") {
    const nlohmann::json config = args.has("--config") ? read_json_file(args.get("--config"))
                                                       : nlohmann::json::parse(kReleasedConfigJson);
    // Without the released tokenizer.json (not here), one of the released vocabulary's size whose
    // Engram compressed vocabulary is the config's, so the checkpoint loads as the release would.
    const ModelConfig released = parse_config(config, "config.json");
    const nlohmann::json tokenizer =
        args.has("--tokenizer") ? read_json_file(args.get("--tokenizer"))
                                : build_tiny_tokenizer_for_engram(released.vocab_size, released.engram_compressed_vocab_size);
    auto t0 = std::chrono::steady_clock::now();
    write_sparse_checkpoint(out, config, tokenizer, 48);
    std::fprintf(stderr, "wrote the released layout (sparse, 48 shards) to %s in %.1f s\n", out.c_str(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return 0;
  }
  if (args.has("--config") && preset != "stream") fail("--config", "is for --preset released-sparse or stream only");
  if (args.has("--experts") && preset != "stream") fail("--experts", "is for --preset stream only");
  if (args.has("--vision") && (preset == "stream" || preset == "released-sparse")) {
    fail("--vision", "is for the tiny, small, bench and long presets (released-sparse has the released tower)");
  }
  if (preset == "stream") {
    // The released geometry with fewer experts and smaller Engram tables and vocabulary.
    ModelConfig c = parse_config(args.has("--config") ? read_json_file(args.get("--config"))
                                                      : nlohmann::json::parse(kReleasedConfigJson),
                                 "released config");
    c.n_routed_experts = static_cast<int>(args.get_int("--experts", 32, c.n_activated_experts, 4096));
    c.dspark_n_routed_experts = std::max(8, c.dspark_n_activated_experts);
    c.engram_vocab_size = 100000;
    const nlohmann::json tokenizer = args.has("--tokenizer") ? read_json_file(args.get("--tokenizer")) : build_tiny_tokenizer(32768);
    const ModelConfig config = complete_synthetic_config(c, tokenizer);
    const ParamCounts params = count_params(config);
    std::fprintf(stderr, "writing preset 'stream' (%d experts a layer): %.1f GB of tensors to %s\n", c.n_routed_experts,
                 static_cast<double>(params.checkpoint_bytes) / 1e9, out.c_str());
    auto t0 = std::chrono::steady_clock::now();
    write_synthetic_checkpoint(out, config, args.get_u64("--seed", 0), tokenizer, uint64_t{2} << 30);
    std::fprintf(stderr, "done in %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return 0;
  }
  const uint64_t seed = args.get_u64("--seed", 0);
  nlohmann::json tokenizer;
  if (args.has("--tokenizer")) {
    tokenizer = read_json_file(args.get("--tokenizer"));
  } else {
    tokenizer = build_tiny_tokenizer(synthetic_config(preset).vocab_size);
  }
  ModelConfig config = synthetic_config(preset, tokenizer);
  if (args.has("--vision")) config = with_synthetic_vision(config, tokenizer);
  const ParamCounts params = count_params(config);
  std::fprintf(stderr, "writing preset '%s' (seed %llu): %.1f M parameters, %.1f MB of tensors to %s\n",
               preset.c_str(), static_cast<unsigned long long>(seed), static_cast<double>(params.total) / 1e6,
               static_cast<double>(params.checkpoint_bytes) / 1e6, out.c_str());
  auto t0 = std::chrono::steady_clock::now();
  write_synthetic_checkpoint(out, config, seed, tokenizer, synthetic_shard_bytes(preset));
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "done in %.1f s\n", s);
  return 0;
}

}  // namespace dsv41::cli
