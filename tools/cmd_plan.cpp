// dsv41 plan: where each class of tensor would live for a RAM budget (model/memory_plan.h), the peak
// and steady resident bytes, the disk reads per decode token and the load time, from the config
// alone; the same plan every command that loads the model follows.
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "backend_env.h"
#include "cli.h"
#include "commands.h"
#include "io/config.h"
#include "model/memory_plan.h"
#include "model/parallel_projection.h"
#include "util/error.h"
#include "util/host_memory.h"

namespace dsv41::cli {

namespace {

constexpr const char* kHelp = R"(usage: dsv41 plan (-m DIR | -m config.json | PATH) [options]

For a RAM budget, where each class of tensor lives (packed for the kernels, read through the mapping,
streamed from the checkpoint with the page cache as expert cache, the Engram tier), the peak and
steady resident bytes, the bytes read from disk per decode token and the load time. Only the config
is read, so it answers for checkpoints that are not on this machine. The engine follows the same plan
when it loads (--ram on generate, serve, bench, ppl and chat).

  -m, --model PATH       a model folder or its config.json
      --ram SIZE         the budget, e.g. 64G or 512M (default: the available RAM, or the memory cgroup's limit
                         when lower); one above this machine's cgroup limit is planned with a warning, since
                         a load here refuses it
      --parallel N       sequences running at once, as serve (default 4)
      --kv-budget-mb N   KV pages for running sequences, as serve (default 1024)
      --cache-ram-mb N   prompt-cache RAM asked for, as serve (default 256)
      --prefill-chunk N  prompt tokens per forward call, as serve (default 256)
      --engram T         mmap (default), ram or pread, as serve
      --hit-rate H       expert-cache hit rate to plan the disk reads with, 0..1 (default: the
                         fraction of the experts the cache holds, as for uniform routing)
      --disk-gbps X      disk read bandwidth for the load time, GB/s (default 2, an assumption)
      --ranks N,N,..     also project an expert-parallel job of each size (mpirun -np N ... --expert-parallel):
                         weight bytes per rank, bytes the ranks exchange per decode token (uniform routing),
                         and the prefill/decode handover of a --prompt-tokens prompt
      --prompt-tokens N  the handover's prompt length (default 131072)
      --json             one JSON object
The backend's packing comes from the environment as for every command (DSV41_ISA, DSV41_PACK).
)";

}  // namespace

int run_plan(int argc, char** argv) {
  if (wants_help(argc, argv)) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  Args args("plan", argc, argv,
            {"--model", "--ram", "--parallel", "--kv-budget-mb", "--cache-ram-mb", "--prefill-chunk", "--engram",
             "--hit-rate", "--disk-gbps", "--ranks", "--prompt-tokens"},
            {"--json"}, {{"-m", "--model"}});
  std::string path = args.get("--model", "");
  if (path.empty() == args.positional().empty() || args.positional().size() > 1) {
    fail("plan", "expects one model folder or config.json, as -m PATH or as PATH");
  }
  if (path.empty()) path = args.positional()[0];
  const ModelConfig config = load_config(path);
  const HostMemory host = read_host_memory();

  MemoryPlanRequest r;
  r.ram_bytes = args.has("--ram") ? parse_byte_size(args.get("--ram"), "--ram") : host.budget_bytes();
  r.tile_rows = backend_from_environment()->weight_tile_rows();
  const int parallel = static_cast<int>(args.get_int("--parallel", 4, 1, 4096));
  const uint64_t kv_budget = static_cast<uint64_t>(args.get_int("--kv-budget-mb", 1024, 1, int64_t{1} << 24)) << 20;
  r.kv_bytes = kv_reserve_bytes(config, kv_budget, parallel);
  r.prompt_cache_bytes = static_cast<uint64_t>(args.get_int("--cache-ram-mb", 256, 0, int64_t{1} << 24)) << 20;
  r.prefill_chunk = args.get_int("--prefill-chunk", 256, 1, 1 << 20);
  r.threads = backend_from_environment()->threads();
  r.engram = parse_engram_tier(args.get("--engram", "mmap"));
  r.hit_rate = args.get_number("--hit-rate", -1);
  if (args.has("--hit-rate") && !(r.hit_rate >= 0 && r.hit_rate <= 1)) fail("--hit-rate", "must be from 0 to 1");
  const double gbps = args.get_number("--disk-gbps", 2);
  if (!(gbps > 0 && gbps < 1e4)) fail("--disk-gbps", "must be a positive bandwidth in GB/s");
  r.disk_bytes_per_s = gbps * 1e9;
  MemoryPlan plan = plan_memory(config, r);
  // The plan is for the budget named, which may be another machine's; a load here would refuse it.
  const std::string refusal = host.ram_refusal(r.ram_bytes);
  if (!refusal.empty()) plan.warnings.push_back("--ram " + refusal + "; a load on this machine refuses this budget");
  std::vector<ParallelProjection> jobs;
  if (args.has("--ranks")) {
    const int64_t prompt = args.get_int("--prompt-tokens", 131072, 1, int64_t{1} << 40);
    std::stringstream list(args.get("--ranks"));
    for (std::string item; std::getline(list, item, ',');) {
      if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos || item.size() > 6)
        fail("--ranks", "expects rank counts like 2,4,8, got \"" + args.get("--ranks") + "\"");
      jobs.push_back(project_parallel(config, std::stoi(item), prompt));
    }
  }

  if (args.has("--json")) {
    nlohmann::json j = plan_to_json(plan);
    j["config"] = config.source;
    j["host"] = {{"total_bytes", host.total_bytes}, {"available_bytes", host.available_bytes},
                 {"cgroup_limit_bytes", host.cgroup_limit_bytes}, {"cgroup", host.cgroup}};
    if (!jobs.empty()) {
      j["expert_parallel"] = nlohmann::json::array();
      for (const ParallelProjection& p : jobs) {
        j["expert_parallel"].push_back({{"ranks", p.ranks},
                                        {"dense_bytes", p.dense_bytes},
                                        {"routed_expert_bytes", p.routed_bytes},
                                        {"engram_table_bytes", p.engram_bytes},
                                        {"rank0_bytes", p.rank0_bytes},
                                        {"other_rank_bytes", p.other_rank_bytes},
                                        {"exchanged_bytes_per_decode_token", p.exchanged_bytes_per_decode_token},
                                        {"handover_prompt_tokens", p.prompt_tokens},
                                        {"handover_exact_bytes", p.handover_exact_bytes},
                                        {"handover_replay_bytes", p.handover_replay_bytes}});
      }
    }
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("model  %s\nhost   RAM %s, available %s", config.source.c_str(),
                format_bytes(static_cast<double>(host.total_bytes)).c_str(),
                format_bytes(static_cast<double>(host.available_bytes)).c_str());
    if (host.cgroup_limit_bytes != 0) {
      std::printf(", cgroup limit %s (%s)", format_bytes(static_cast<double>(host.cgroup_limit_bytes)).c_str(),
                  host.cgroup.c_str());
    }
    std::printf("\n%s", plan_to_text(plan).c_str());
    if (!jobs.empty()) {
      std::printf("\nexpert-parallel projection (weights %s dense, %s routed experts, %s Engram tables)\n"
                  "  ranks  rank 0 weights  other ranks  exchanged/decode token  handover of %lld tokens (exact / replay)\n",
                  format_bytes(static_cast<double>(jobs[0].dense_bytes)).c_str(),
                  format_bytes(static_cast<double>(jobs[0].routed_bytes)).c_str(),
                  format_bytes(static_cast<double>(jobs[0].engram_bytes)).c_str(), static_cast<long long>(jobs[0].prompt_tokens));
      for (const ParallelProjection& p : jobs) {
        std::printf("  %5d  %14s  %11s  %22s  %s / %s\n", p.ranks, format_bytes(static_cast<double>(p.rank0_bytes)).c_str(),
                    format_bytes(static_cast<double>(p.other_rank_bytes)).c_str(),
                    format_bytes(p.exchanged_bytes_per_decode_token).c_str(),
                    format_bytes(static_cast<double>(p.handover_exact_bytes)).c_str(),
                    format_bytes(static_cast<double>(p.handover_replay_bytes)).c_str());
      }
    }
  }
  return plan.fits() ? 0 : 1;
}

}  // namespace dsv41::cli
