// dsv41: one command, one subcommand per job; each subcommand is a thin shell over the library.
#include <malloc.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "commands.h"
#include "expert_parallel.h"
#include "util/error.h"

namespace {

constexpr const char* kUsage = R"(dsv41 — an inference engine for DeepSeek-V4.1-Flash (model_type deepseek_v41)

usage: dsv41 <command> [options]

commands:
  inspect PATH [--json]                         layer roles, state graph, bytes per token, parameters,
                                                Engram constants of a model folder or config.json
  plan PATH [--ram SIZE] [--json]               where each class of tensor lives for a RAM budget, the
                                                resident bytes, disk reads per token, load time
  make-tiny --out DIR [--preset P] [--seed N]   write a random checkpoint in the released layout
                                                (presets: tiny, small, bench, long)
  generate -m DIR (-p TEXT | -f FILE | --prompt-ids IDS) [--image FILE ...]
                                                run the model: prefill, then sample or teacher-force
  vision-encode -m DIR --image FILE --dump OUT  an image's pixels, patches, ViT and aligner outputs
  logits-diff A B [--json]                      compare two --dump-logits files (max diff, KL, top-1)
  bench -m DIR [--scenario engram] [--json]     measure the engine on a model
  serve -m DIR [--host H] [--port N]            the OpenAI-compatible HTTP server
  chat -m DIR                                   an interactive conversation in the terminal
  ppl -m DIR -f FILE [--ctx N]                  perplexity of a text, chunk by chunk
  mpirun -np N dsv41 generate|serve|bench ... --expert-parallel
                                                one job over N ranks, each holding 1/N of the routed
                                                experts and Engram rows (docs/distributed.md)
  pack --like DIR --weights FILE --out DIR      quantize trained F32 weights into the released layout
  tokenizer train|encode|engram-map             learn a BPE tokenizer.json from a text, encode a text,
                                                write the Engram token map (for tools/train)

'dsv41 <command> --help' describes a command.
)";

}  // namespace

int main(int argc, char** argv) {
  // Buffers above 8 MiB (weights read into memory, large tables) come from mmap and go back to the
  // system when freed; glibc's adaptive threshold would keep them in the heap, where the holes they
  // leave make resident memory grow with every reallocation instead of with what is live. Below it,
  // the per-call activation and score buffers a prefill chunk allocates (0.25-4 MiB each at 512 rows)
  // are reused from the heap: served by mmap, every one of them was fresh pages to fault in, a third
  // of a long prefill's time (32K tokens on the long preset: 1.5M page faults, 1,100 tok/s; with
  // these settings 0.7M, 1,500-1,900 tok/s).
  mallopt(M_MMAP_THRESHOLD, 8 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  if (dsv41::cli::wants_expert_parallel(argc - 2, argv + 2)) {
    if (command == "generate") return dsv41::cli::run_expert_parallel(command, argc - 2, argv + 2, dsv41::cli::run_generate);
    if (command == "serve") return dsv41::cli::run_expert_parallel(command, argc - 2, argv + 2, dsv41::cli::run_serve);
    if (command == "bench") return dsv41::cli::run_expert_parallel(command, argc - 2, argv + 2, dsv41::cli::run_bench);
    std::fprintf(stderr, "dsv41 %s: error: --expert-parallel: only generate, serve and bench run expert-parallel\n",
                 command.c_str());
    return 1;
  }
  try {
    if (command == "inspect") return dsv41::cli::run_inspect(argc - 2, argv + 2);
    if (command == "make-tiny") return dsv41::cli::run_make_tiny(argc - 2, argv + 2);
    if (command == "generate") return dsv41::cli::run_generate(argc - 2, argv + 2);
    if (command == "logits-diff") return dsv41::cli::run_logits_diff(argc - 2, argv + 2);
    if (command == "bench") return dsv41::cli::run_bench(argc - 2, argv + 2);
    if (command == "serve") return dsv41::cli::run_serve(argc - 2, argv + 2);
    if (command == "chat") return dsv41::cli::run_chat(argc - 2, argv + 2);
    if (command == "ppl") return dsv41::cli::run_ppl(argc - 2, argv + 2);
    if (command == "vision-encode") return dsv41::cli::run_vision_encode(argc - 2, argv + 2);
    if (command == "plan") return dsv41::cli::run_plan(argc - 2, argv + 2);
    if (command == "pack") return dsv41::cli::run_pack(argc - 2, argv + 2);
    if (command == "tokenizer") return dsv41::cli::run_tokenizer(argc - 2, argv + 2);
    std::fprintf(stderr, "dsv41: unknown command '%s'\n\n%s", command.c_str(), kUsage);
    return 2;
  } catch (const dsv41::Error& e) {
    std::fprintf(stderr, "dsv41 %s: error: %s\n", command.c_str(), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsv41 %s: internal error: %s\n", command.c_str(), e.what());
    return 3;
  }
}
