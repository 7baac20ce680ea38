#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "util/error.h"
#include "commands.h"
#include "io/config.h"
#include "model/model_stats.h"
#include "model/synthetic_checkpoint.h"
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
        "usage: dsv41 make-tiny --out DIR [--preset tiny|small|bench|long] [--seed N] [--tokenizer FILE]\n\n"
        "Presets: tiny (hidden 128, 4K positions), small (hidden 512), bench (the released per-layer\n"
        "widths, 8 layers), long (tiny's widths with the released 128-token window, 1M positions, top-k 64\n"
        "and a 256-block pool: selection is sparse from a few thousand tokens on).\n"
        "Writes a complete checkpoint with seeded random weights in the released layout: config.json,\n"
        "inference/config.json, tokenizer.json, sharded safetensors with model.safetensors.index.json,\n"
        "FP8 dense weights with 32x32 UE8M0 scales, MXFP4 experts, FP8 Engram tables, mtp.* DSpark blocks.\n"
        "--tokenizer uses that tokenizer.json (e.g. from 'dsv41 tokenizer train') instead of the built-in\n"
        "one: the vocabulary, DSpark's noise token and the Engram tables follow it.");
    return 0;
  }
  Args args("make-tiny", argc, argv, {"--out", "--preset", "--seed", "--tokenizer"}, {}, {{"-o", "--out"}});
  if (!args.positional().empty()) fail(args.positional()[0], "unexpected argument (the folder goes after --out)");
  const std::string out = args.required("--out");
  const std::string preset = args.get("--preset", "tiny");
  const uint64_t seed = args.get_u64("--seed", 0);
  nlohmann::json tokenizer;
  if (args.has("--tokenizer")) {
    tokenizer = read_json_file(args.get("--tokenizer"));
  } else {
    tokenizer = build_tiny_tokenizer(synthetic_config(preset).vocab_size);
  }
  const ModelConfig config = synthetic_config(preset, tokenizer);
  const ParamCounts params = count_params(config);
  std::fprintf(stderr, "writing preset '%s' (seed %llu): %.1f M parameters, %.1f MB of tensors to %s\n",
               preset.c_str(), static_cast<unsigned long long>(seed), static_cast<double>(params.total) / 1e6,
               static_cast<double>(params.checkpoint_bytes) / 1e6, out.c_str());
  auto t0 = std::chrono::steady_clock::now();
  write_synthetic_checkpoint(out, preset, seed, tokenizer);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "done in %.1f s\n", s);
  return 0;
}

}  // namespace dsv41::cli
