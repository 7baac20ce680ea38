#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "cli.h"
#include "util/error.h"
#include "commands.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/checkpoint_check.h"
#include "io/engram_layout.h"
#include "io/layer_roles.h"
#include "model/model_stats.h"
#include "state/state_graph.h"

namespace dsv41::cli {

using nlohmann::json;

namespace {

// "3-7, 9, 11-13"
std::string ranges(const std::vector<int>& v) {
  std::string out;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(v[i]);
    if (j > i) out += "-" + std::to_string(v[j]);
    i = j + 1;
  }
  return out.empty() ? "-" : out;
}

std::string join(const std::vector<int64_t>& v) {
  std::string out;
  for (int64_t x : v) out += (out.empty() ? "" : " ") + std::to_string(x);
  return out;
}

// 763.2 G, 5.0 M, 12.3 k
std::string human(int64_t n) {
  char buf[32];
  const double x = static_cast<double>(n);
  if (x >= 1e9) std::snprintf(buf, sizeof buf, "%.3f G", x / 1e9);
  else if (x >= 1e6) std::snprintf(buf, sizeof buf, "%.3f M", x / 1e6);
  else if (x >= 1e3) std::snprintf(buf, sizeof buf, "%.3f k", x / 1e3);
  else std::snprintf(buf, sizeof buf, "%lld ", static_cast<long long>(n));
  return buf;
}

std::string list(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : ", ") + s;
  return out.empty() ? "none" : out;
}

std::string from(int layer) { return layer < 0 ? "-" : std::to_string(layer); }

json build_report(const ModelConfig& c) {
  const auto roles = derive_layer_roles(c);
  const StateGraph graph = build_state_graph(c, roles);
  const ParamCounts params = count_params(c);
  json j;
  j["config"] = c.source;
  j["model_type"] = c.model_type;
  j["late_layer_start"] = late_layer_start(c);
  j["layers"] = json::array();
  for (const LayerRole& r : roles) {
    j["layers"].push_back({{"index", r.layer}, {"role", role_name(r.role)}, {"compress_ratio", r.compress_ratio},
                           {"engram", r.engram}, {"candidate_source", r.candidate_source},
                           {"candidate_user", r.candidate_user}, {"dspark", r.dspark}, {"dspark_tap", r.dspark_tap},
                           {"encoder", r.encoder}, {"kv_from", r.kv_from}, {"index_keys_from", r.index_keys_from},
                           {"topk_from", r.topk_from}, {"rope_theta", r.rope_theta}, {"yarn", r.yarn}});
  }
  j["state_classes"] = json::array();
  for (const StateClass& s : graph.classes) {
    json cls = {{"name", s.name}, {"lifetime", lifetime_name(s.lifetime)}, {"format", s.format},
                {"owner_layers", s.owner_layers()}, {"consumer_layers", s.consumer_layers()}};
    if (s.per_token) {
      cls["bytes_per_token"] = s.bytes_per_token();
    } else if (s.lifetime == Lifetime::Step) {
      cls["bytes_per_query"] = s.owners.empty() ? 0 : s.owners[0].row_bytes;  // rebuilt every forward
    } else {
      cls["bytes_per_sequence"] = s.bytes_per_sequence();
    }
    cls["owners"] = json::array();
    for (const StateOwner& o : s.owners) {
      cls["owners"].push_back({{"layer", o.layer}, {"compress_ratio", o.compress_ratio},
                               {"consumers", o.consumers}, {"row_bytes", o.row_bytes}});
    }
    j["state_classes"].push_back(cls);
  }
  j["global_kv_bytes_per_token"] = graph.global_bytes_per_token();
  j["fixed_bytes_per_sequence"] = graph.fixed_bytes_per_sequence();
  j["params"] = {{"total", params.total}, {"engram", params.engram}, {"dspark", params.dspark}, {"vision", params.vision},
                 {"active_prefill", params.active_prefill}, {"active_decode", params.active_decode},
                 {"checkpoint_bytes", params.checkpoint_bytes}};
  j["config_keys"] = {{"unknown", c.unknown_keys}, {"unused", c.unused_keys}};
  j["engram"] = json::array();
  for (const auto& e : engram_layout(c.engram_layer_ids, c.engram_max_ngram_size, c.engram_vocab_size,
                                     c.engram_n_heads, c.engram_compressed_vocab_size)) {
    j["engram"].push_back({{"layer", e.layer}, {"rows", e.rows}, {"primes", e.primes}, {"offsets", e.offsets},
                           {"multipliers", e.multipliers}});
  }
  return j;
}

void print_report(const ModelConfig& c, const json& j) {
  std::printf("model  %s (%s)\n", c.source.c_str(), c.model_type.c_str());
  std::printf("       hidden %lld, %d layers + %d DSpark, %d heads x %lld (rope %lld), window %d, vocab %lld\n\n",
              static_cast<long long>(c.dim), c.n_layers, c.has_dspark() ? c.n_mtp_layers : 0, c.n_heads,
              static_cast<long long>(c.head_dim), static_cast<long long>(c.rope_head_dim), c.window_size,
              static_cast<long long>(c.vocab_size));

  std::printf("layer roles\n  %-6s %-8s %-5s %-5s %-6s %-6s %-10s %-7s %-5s %-8s %s\n", "layer", "role", "ratio",
              "kv<-", "keys<-", "topk<-", "candidates", "engram", "tap", "CED", "rope");
  int counts[4] = {0, 0, 0, 0};
  for (const json& l : j["layers"]) {
    const bool dspark = l["dspark"];
    std::string role = l["role"].get<std::string>() + (dspark ? "*" : "");
    std::string cand = l["candidate_source"] ? "source" : l["candidate_user"] ? "user" : "-";
    std::string ced = dspark ? "draft" : l["encoder"] ? "all rows" : "tail";
    std::string rope = std::to_string(static_cast<long long>(l["rope_theta"].get<double>())) + (l["yarn"] ? "+yarn" : "");
    std::printf("  %-6d %-8s %-5d %-5s %-6s %-6s %-10s %-7s %-5s %-8s %s\n", l["index"].get<int>(), role.c_str(),
                l["compress_ratio"].get<int>(), from(l["kv_from"]).c_str(), from(l["index_keys_from"]).c_str(),
                from(l["topk_from"]).c_str(), cand.c_str(), l["engram"] ? "before" : "-",
                l["dspark_tap"] ? "yes" : "-", ced.c_str(), rope.c_str());
    if (!dspark) {
      const std::string r = l["role"];
      counts[r == "swa" ? 0 : r == "full" ? 1 : r == "reindex" ? 2 : 3]++;
    }
  }
  std::printf("  backbone: %d SWA-only, %d Full, %d Reindex, %d Reuse (* = DSpark block); "
              "prefill tail mode runs layers >= %d on the prompt's last rows only\n\n",
              counts[0], counts[1], counts[2], counts[3], j["late_layer_start"].get<int>());

  std::printf("state graph\n  %-16s %-8s %-28s %-14s %-22s %s\n", "class", "lifetime", "format", "owners",
              "consumers", "size");
  for (const json& s : j["state_classes"]) {
    std::vector<int> owners = s["owner_layers"], consumers = s["consumer_layers"];
    std::string size = s.contains("bytes_per_token")      ? std::to_string(s["bytes_per_token"].get<double>()) + " B/token"
                       : s.contains("bytes_per_sequence") ? std::to_string(s["bytes_per_sequence"].get<int64_t>()) + " B/sequence"
                                                          : std::to_string(s["bytes_per_query"].get<int64_t>()) + " B/query, per step";
    if (auto dot = size.find(".000000"); dot != std::string::npos) size.erase(dot, 7);
    std::printf("  %-16s %-8s %-28s %-14s %-22s %s\n", s["name"].get<std::string>().c_str(),
                s["lifetime"].get<std::string>().c_str(), s["format"].get<std::string>().c_str(),
                owners.empty() ? "token ids" : ranges(owners).c_str(), ranges(consumers).c_str(), size.c_str());
    if (s["lifetime"] == "global") {
      for (const json& o : s["owners"]) {
        std::printf("  %-16s layer %d (ratio %d, %lld B/row) -> layers %s\n", "", o["layer"].get<int>(),
                    o["compress_ratio"].get<int>(), static_cast<long long>(o["row_bytes"].get<int64_t>()),
                    ranges(o["consumers"].get<std::vector<int>>()).c_str());
      }
    }
  }
  std::printf("  global KV: %g bytes/token (persisted); fixed per sequence: %lld bytes (windows, tails, history)\n\n",
              j["global_kv_bytes_per_token"].get<double>(),
              static_cast<long long>(j["fixed_bytes_per_sequence"].get<int64_t>()));

  const json& p = j["params"];
  auto b = [](const json& v) { return human(v.get<int64_t>()); };
  std::printf("parameters\n  total %s, Engram tables %s, DSpark %s, vision tower %s; checkpoint %sB\n",
              b(p["total"]).c_str(), b(p["engram"]).c_str(), b(p["dspark"]).c_str(), b(p["vision"]).c_str(),
              b(p["checkpoint_bytes"]).c_str());
  std::printf("  active per prompt token (CED: layers < %d) %s, per generated token %s\n\n",
              j["late_layer_start"].get<int>(), b(p["active_prefill"]).c_str(), b(p["active_decode"]).c_str());

  std::printf("config keys\n  not read by the engine (known, no use here): %s\n  unknown (ignored): %s\n\n",
              list(c.unused_keys).c_str(), list(c.unknown_keys).c_str());

  if (!j["engram"].empty()) std::printf("engram constants\n");
  for (const json& e : j["engram"]) {
    std::printf("  layer %d: %lld rows\n    primes      %s\n    offsets     %s\n    multipliers %s\n",
                e["layer"].get<int>(), static_cast<long long>(e["rows"].get<int64_t>()),
                join(e["primes"]).c_str(), join(e["offsets"]).c_str(), join(e["multipliers"]).c_str());
  }
}

}  // namespace

int run_inspect(int argc, char** argv) {
  if (wants_help(argc, argv)) {
    std::puts(
        "usage: dsv41 inspect PATH [--json]\n\n"
        "PATH is a model folder (config.json or inference/config.json, and its safetensors if present) or a\n"
        "config.json file. Prints the per-layer roles, the state-ownership graph with bytes per token of each\n"
        "long-lived state class, fixed per-sequence bytes, parameter counts, the config's keys the engine\n"
        "does not read (known but unused, and unknown ones) and the Engram hash constants. A key whose value\n"
        "changes the math in a way the engine does not implement (attention_bias: true, say) is an error.\n"
        "With a model folder that holds weights, every tensor is checked against the config first.");
    return 0;
  }
  Args args("inspect", argc, argv, {}, {"--json"});
  if (args.positional().size() != 1) fail("inspect", "expects exactly one PATH (a model folder or a config.json)");
  const std::string path = args.positional()[0];
  const ModelConfig config = load_config(path);
  json report = build_report(config);

  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec) && (fs::exists(fs::path(path) / "model.safetensors.index.json", ec) ||
                                     fs::exists(fs::path(path) / "model.safetensors", ec))) {
    Checkpoint checkpoint(path);
    check_checkpoint(checkpoint, config);
    report["checkpoint"] = {{"path", path}, {"tensors", checkpoint.tensor_count()}, {"valid", true}};
  }
  if (args.has("--json")) {
    std::printf("%s\n", report.dump(2).c_str());
    return 0;
  }
  print_report(config, report);
  if (report.contains("checkpoint")) {
    std::printf("\ncheckpoint  %s: %zu tensors, all present with the dtypes and shapes the config implies\n",
                path.c_str(), report["checkpoint"]["tensors"].get<size_t>());
  }
  return 0;
}

}  // namespace dsv41::cli
