#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "cli.h"
#include "commands.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/engram_store.h"
#include "util/error.h"

namespace dsv41::cli {

namespace {

// engram: the per-step cost of the Engram lookups (rows of every Engram layer for one token) from
// each tier, on the model's own tables.
nlohmann::json bench_engram(const std::string& dir, int steps, int io_threads) {
  const ModelConfig c = load_config(dir);
  if (c.engram_layer_ids.empty()) fail(dir, "has no Engram layers");
  Checkpoint ckpt(dir);
  nlohmann::json out = nlohmann::json::array();
  for (EngramTier tier : {EngramTier::Mmap, EngramTier::Ram, EngramTier::Pread}) {
    double us = 0;
    int64_t table_bytes = 0;
    for (int layer : c.engram_layer_ids) {
      const std::string p = "layers." + std::to_string(layer) + ".engram.embed.";
      EngramStore store(ckpt.get(p + "weight"), ckpt.get(p + "scale"), tier, io_threads);
      us += measure_engram_lookup_us(store, steps, c.engram_hash_columns(), 7);
      table_bytes += store.rows() * (store.row_bytes() + store.scale_bytes());
    }
    out.push_back({{"tier", engram_tier_name(tier)},
                   {"us_per_step", us},
                   {"rows_per_step", c.engram_hash_columns() * static_cast<int>(c.engram_layer_ids.size())},
                   {"table_bytes", table_bytes}});
  }
  return out;
}

}  // namespace

int run_bench(int argc, char** argv) {
  if (wants_help(argc, argv)) {
    std::puts(
        "usage: dsv41 bench -m DIR [--scenario engram] [--steps N] [--io-threads N] [--json]\n\n"
        "  engram   per-step Engram lookup time (the rows of every Engram layer for one token) from each\n"
        "           tier: mmap, ram, pread (warm page cache; the tables are read once per tier)");
    return 0;
  }
  Args args("bench", argc, argv, {"--model", "--scenario", "--steps", "--io-threads"}, {"--json"}, {{"-m", "--model"}});
  const std::string dir = args.required("--model");
  const std::string scenarios = args.get("--scenario", "engram");
  const int steps = static_cast<int>(args.get_int("--steps", 2000, 1, 10000000));
  const int io_threads = static_cast<int>(args.get_int("--io-threads", 4, 1, 256));
  nlohmann::json report;
  std::stringstream list(scenarios);
  for (std::string name; std::getline(list, name, ',');) {
    if (name == "engram") {
      report["engram"] = bench_engram(dir, steps, io_threads);
    } else {
      fail("--scenario", "unknown scenario \"" + name + "\" (available: engram)");
    }
  }
  if (args.has("--json")) {
    std::printf("%s\n", report.dump(2).c_str());
    return 0;
  }
  if (report.contains("engram")) {
    std::printf("engram lookups, %d steps\n  %-6s %12s %10s\n", steps, "tier", "us/step", "rows/step");
    for (const auto& r : report["engram"]) {
      std::printf("  %-6s %12.2f %10d\n", r["tier"].get<std::string>().c_str(), r["us_per_step"].get<double>(),
                  r["rows_per_step"].get<int>());
    }
  }
  return 0;
}

}  // namespace dsv41::cli
