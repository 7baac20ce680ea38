#include "model/memory_plan.h"

#include <algorithm>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "io/layer_roles.h"
#include "kernels/packed_weights.h"
#include "model/tensor_layout.h"
#include "state/state_graph.h"
#include "util/error.h"
#include "util/host_memory.h"

namespace dsv41 {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

uint64_t spec_bytes(const TensorSpec& s) {
  uint64_t n = dtype_size(s.dtype);
  for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
  return n;
}

// The vision tower's matrices (its linears and the aligner's; weights.cpp packs them with the dense ones).
bool is_vision_linear(const std::string& name) {
  const bool tower = name.rfind("vision.", 0) == 0 || name.rfind("aligner.", 0) == 0;
  return tower && ends_with(name, ".weight") && !ends_with(name, "norm.weight") && !ends_with(name, "norm1.weight") &&
         !ends_with(name, "norm2.weight");
}

// The BF16 matrices the linear layers read (packed with the dense matrices, weights.cpp).
bool is_bf16_linear(const std::string& name) {
  return name == "head.weight" || ends_with(name, ".ffn.gate.weight") || ends_with(name, ".compressor.wkv.weight") ||
         ends_with(name, ".compressor.wgate.weight") || ends_with(name, ".indexer.wk.weight") ||
         ends_with(name, ".indexer.weights_proj.weight") || ends_with(name, ".markov_head.head.weight") ||
         ends_with(name, ".confidence_head.proj.weight") || is_vision_linear(name);
}

// The classes, in the order of their claims (memory_plan.h).
enum Row { kVectors, kWoA, kDenseFp8, kBf16Linears, kEmbeddings, kExperts, kEngram, kRowCount };

constexpr uint64_t kProcessBytes = uint64_t{24} << 20;  // binary, libraries, allocator slack
constexpr uint64_t kPage = 4096;

}  // namespace

const char* residence_name(Residence r) {
  switch (r) {
    case Residence::Packed: return "packed";
    case Residence::Copied: return "copied";
    case Residence::Mapped: return "mapped";
    case Residence::Gathered: return "gathered";
    case Residence::Streamed: return "streamed";
    case Residence::Read: return "read";
  }
  return "?";
}

const PlanRow* MemoryPlan::find(const std::string& name) const {
  for (const PlanRow& r : rows) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

MemoryPlan plan_memory(const ModelConfig& c, const MemoryPlanRequest& req) {
  MemoryPlan plan;
  plan.request = req;
  plan.rows.resize(kRowCount);
  PlanRow* rows = plan.rows.data();
  rows[kVectors] = {"vectors", "norms, F32 tensors, Engram q·k, vision biases (converted at load)", 0, 0, Residence::Copied, 0, 0};
  rows[kWoA] = {"wo_a", "attn.wo_a, dequantized to bf16 as the reference's converter does", 0, 0, Residence::Copied, 0, 0};
  rows[kDenseFp8] = {"dense_fp8", "FP8 matrices: attention, shared experts, Engram wkv, DSpark main_proj", 0, 0,
                     Residence::Mapped, 0, 0};
  rows[kBf16Linears] = {"bf16_linears", "BF16 linears: head, router, compressor, indexer, DSpark heads, vision tower", 0, 0,
                        Residence::Mapped, 0, 0};
  rows[kEmbeddings] = {"embeddings", "token and Markov embeddings (rows gathered per token)", 0, 0,
                       Residence::Gathered, 0, 0};
  rows[kExperts] = {"routed_experts", "FP4 routed experts, backbone and DSpark", 0, 0, Residence::Streamed, 0, 0};
  rows[kEngram] = {"engram_tables", "FP8 Engram tables", 0, 0, Residence::Streamed, 0, 0};

  const int T = req.tile_rows;
  uint64_t dense_packed = 0, bf16_packed = 0, experts_packed = 0, largest = 0, woa_packed = 0;
  std::vector<uint64_t> layer_expert_bytes(static_cast<size_t>(c.total_layers()), 0);
  std::vector<uint64_t> layer_expert_packed(static_cast<size_t>(c.total_layers()), 0);
  std::vector<TensorSpec> tensors = checkpoint_tensors(c);
  const std::vector<TensorSpec> vision = vision_tensors(c);
  tensors.insert(tensors.end(), vision.begin(), vision.end());
  for (const TensorSpec& s : tensors) {
    const uint64_t bytes = spec_bytes(s);
    const std::string& n = s.name;
    Row row;
    if (contains(n, ".ffn.experts.")) {
      row = kExperts;
      if (s.kind == TensorKind::Fp4Weight) {
        const uint64_t packed = static_cast<uint64_t>(packed_fp4_bytes(s.shape[0], s.logical_in, std::max(T, 1)));
        experts_packed += packed;
        layer_expert_packed[static_cast<size_t>(s.layer)] += packed;
        largest = std::max(largest, bytes);
      }
      // scales are copied into the packed tiles; counted with their weight above
    } else if (contains(n, ".engram.embed.")) {
      row = kEngram;
    } else if (contains(n, ".attn.wo_a.")) {
      row = kWoA;
      if (s.kind == TensorKind::Fp8Weight) {
        rows[kWoA].anon_bytes += static_cast<uint64_t>(s.shape[0] * s.shape[1] * 2);
        woa_packed += static_cast<uint64_t>(packed_bf16_bytes(s.shape[0], s.shape[1], std::max(T, 1)));
      }
    } else if (s.kind == TensorKind::Fp8Weight || s.kind == TensorKind::Scale) {
      row = kDenseFp8;
      if (s.kind == TensorKind::Fp8Weight) {
        dense_packed += static_cast<uint64_t>(packed_fp8_bytes(s.shape[0], s.shape[1], std::max(T, 1)));
        largest = std::max(largest, bytes);
      } else {
        rows[kDenseFp8].cached_bytes += bytes;  // the packed kernels read FP8 scales from the mapping
      }
    } else if (s.kind == TensorKind::Bf16 && is_bf16_linear(n)) {
      row = kBf16Linears;
      const int64_t k = s.shape.size() > 1 ? s.shape[1] : 1;
      bf16_packed += static_cast<uint64_t>(packed_bf16_bytes(s.shape[0], k, std::max(T, 1)));
      largest = std::max(largest, bytes);
    } else if (n == "embed.weight" || ends_with(n, ".markov_head.embed.weight")) {
      row = kEmbeddings;
    } else {
      row = kVectors;
      if (s.kind == TensorKind::F32) rows[kVectors].anon_bytes += bytes;
      else if (ends_with(n, ".bias")) rows[kVectors].anon_bytes += bytes * 2;  // the vision biases, in fp32
      else if (ends_with(n, ".engram.q_weight")) rows[kVectors].anon_bytes += bytes * 2;  // q·k in fp32
      else if (!ends_with(n, ".engram.k_weight")) rows[kVectors].cached_bytes += bytes;    // norms: mapped
    }
    rows[row].tensors += 1;
    rows[row].checkpoint_bytes += bytes;
    if (row == kExperts && s.layer >= 0) layer_expert_bytes[static_cast<size_t>(s.layer)] += bytes;
  }
  for (int l = 0; l < c.total_layers(); ++l) {
    const int e = c.routed_experts(l);
    if (e > 0) layer_expert_bytes[static_cast<size_t>(l)] /= static_cast<uint64_t>(e);  // one expert's bytes
    if (e > 0) layer_expert_packed[static_cast<size_t>(l)] /= static_cast<uint64_t>(e);
  }
  const uint64_t largest_expert_packed = *std::max_element(layer_expert_packed.begin(), layer_expert_packed.end());

  // 1. What is needed whatever the budget.
  const uint64_t budget = req.ram_bytes;
  // Activations per prompt token of a forward call: about five fp32 copies of the residual stream
  // (hc·dim), two of the attention heads' outputs and two of the routed and shared experts' hidden
  // rows; plus a few logits rows and each worker's scratch. Measured on the small preset (cgroup
  // peak, chunks of 32 and 512): 42 KB a token against the 58 KB this counts.
  const int64_t hc_dim = static_cast<int64_t>(c.hc_mult) * c.dim;
  const int64_t per_token = hc_dim * 4 * 5 + static_cast<int64_t>(c.n_heads) * c.head_dim * 4 * 2 +
                            static_cast<int64_t>(c.n_activated_experts + c.n_shared_experts) * c.moe_inter_dim * 4 * 2;
  const uint64_t activations = static_cast<uint64_t>(std::max<int64_t>(req.prefill_chunk, 1) * per_token +
                                                     8 * c.vocab_size * 4) +
                               static_cast<uint64_t>(std::max(req.threads, 1)) * (uint64_t{4} << 20);
  // The process itself: code, libraries, the tokenizer and the Engram token map (both grow with the
  // vocabulary). The tiny preset's whole run peaks at 19 MB resident.
  const uint64_t process = kProcessBytes + static_cast<uint64_t>(c.vocab_size) * 512;
  plan.runtime_bytes = req.kv_bytes + activations + process;
  const bool packs = T > 0;
  if (packs) {
    // Packed, the converted copy is freed when the groups start on tile boundaries (weights.cpp).
    if (c.o_lora_rank % T == 0) {
      rows[kWoA].anon_bytes = 0;
      rows[kWoA].residence = Residence::Packed;
    }
    rows[kWoA].anon_bytes += woa_packed;
  }
  uint64_t used = plan.runtime_bytes + rows[kVectors].anon_bytes + rows[kVectors].cached_bytes + rows[kWoA].anon_bytes;
  const uint64_t dense_mapped = rows[kDenseFp8].checkpoint_bytes + rows[kBf16Linears].checkpoint_bytes;
  const uint64_t dense_as_packed = dense_packed + bf16_packed + rows[kDenseFp8].cached_bytes;
  // Experts that will stream need their cache's least, two experts (it computes a layer's experts in
  // groups of which two fit), whatever else is short.
  const bool experts_stream = packs && used + dense_as_packed + experts_packed > budget;
  const uint64_t cache_least = experts_stream ? 2 * largest_expert_packed : 0;
  if (used + cache_least > budget) {
    plan.refusal = "even the minimal plan needs " + format_bytes(static_cast<double>(used + cache_least)) + " (runtime " +
                   format_bytes(static_cast<double>(plan.runtime_bytes)) + ": KV " +
                   format_bytes(static_cast<double>(req.kv_bytes)) + ", activations " +
                   format_bytes(static_cast<double>(activations)) + "; converted tensors " +
                   format_bytes(static_cast<double>(rows[kVectors].anon_bytes + rows[kWoA].anon_bytes)) +
                   (experts_stream ? "; two experts for the expert cache " + format_bytes(static_cast<double>(cache_least)) : "") +
                   ") and the budget is " + format_bytes(static_cast<double>(budget));
  }

  // 2. The dense matrices, read by every token: packed, or through the mapping with what page cache
  // is left (the rest read from disk every token).
  uint64_t dense_from_disk = 0;
  plan.pack_dense = packs && used + dense_as_packed + cache_least <= budget;
  if (plan.pack_dense) {
    rows[kDenseFp8].residence = rows[kBf16Linears].residence = Residence::Packed;
    rows[kDenseFp8].anon_bytes = dense_packed;
    rows[kBf16Linears].anon_bytes = bf16_packed;
    used += dense_as_packed;
  } else {
    const uint64_t room = budget > used + cache_least ? budget - used - cache_least : 0;
    const uint64_t cached = std::min(dense_mapped, room);
    dense_from_disk = dense_mapped - cached;
    const uint64_t fp8_cached = std::min(rows[kDenseFp8].checkpoint_bytes, cached);
    rows[kDenseFp8].cached_bytes = fp8_cached;
    rows[kBf16Linears].cached_bytes = cached - fp8_cached;
    used += cached;
    if (dense_from_disk > 0 && plan.fits()) {
      plan.warnings.push_back("the dense matrices (" + format_bytes(static_cast<double>(dense_mapped)) + ") get " +
                              format_bytes(static_cast<double>(cached)) + " of page cache: every token reads " +
                              format_bytes(static_cast<double>(dense_from_disk)) + " of them from disk");
    }
  }
  // Embedding rows come in as tokens use them: a page per row per token at most; not planned as resident.
  rows[kEmbeddings].cached_bytes = 0;

  // 3. The routed experts.
  const uint64_t experts_bytes = rows[kExperts].checkpoint_bytes;
  plan.pack_experts = packs && used + experts_packed <= budget;
  if (plan.pack_experts) {
    rows[kExperts].residence = Residence::Packed;
    rows[kExperts].anon_bytes = experts_packed;
    used += experts_packed;
  } else if (!packs && used + experts_bytes <= budget) {
    rows[kExperts].residence = Residence::Mapped;  // a backend that reads the checkpoint layout: all cached
    rows[kExperts].cached_bytes = experts_bytes;
    used += experts_bytes;
  }

  // 4. The prompt cache's RAM: what was asked when the experts are resident; beside streamed experts at
  // most a quarter of what they would otherwise have, so the experts keep the larger share.
  const uint64_t free_now = budget > used + cache_least ? budget - used - cache_least : 0;
  const bool experts_resident = rows[kExperts].residence != Residence::Streamed;
  plan.prompt_cache_bytes = std::min(req.prompt_cache_bytes, experts_resident ? free_now : free_now / 4);
  used += plan.prompt_cache_bytes;
  if (!experts_resident && packs) {
    // The expert cache (model/expert_cache.h): packed experts in anonymous memory, read by pread.
    // It computes a layer's experts in groups of which two fit, so two experts are its least.
    plan.expert_cache_bytes = std::min(budget > used ? budget - used : 0, experts_packed);
    rows[kExperts].anon_bytes = plan.expert_cache_bytes;
    used += plan.expert_cache_bytes;
    if (plan.expert_cache_bytes < 2 * largest_expert_packed && plan.fits()) {
      plan.refusal = "the routed experts are streamed and their cache needs at least two experts (" +
                     format_bytes(2.0 * static_cast<double>(largest_expert_packed)) + "); " +
                     format_bytes(static_cast<double>(plan.expert_cache_bytes)) + " is left of the budget of " +
                     format_bytes(static_cast<double>(budget));
    }
    plan.warnings.push_back("the routed experts (" + format_bytes(static_cast<double>(experts_bytes)) +
                            ") do not fit: read from the checkpoint into an expert cache of " +
                            format_bytes(static_cast<double>(plan.expert_cache_bytes)));
  } else if (!experts_resident) {
    plan.expert_cache_bytes = budget > used ? budget - used : 0;
    rows[kExperts].cached_bytes = std::min(plan.expert_cache_bytes, experts_bytes);
    used += rows[kExperts].cached_bytes;
    plan.warnings.push_back("the routed experts (" + format_bytes(static_cast<double>(experts_bytes)) +
                            ") do not fit: read through the mapping, with " +
                            format_bytes(static_cast<double>(plan.expert_cache_bytes)) + " of page cache");
  }

  // 5. The Engram tables.
  const uint64_t engram_bytes = rows[kEngram].checkpoint_bytes;
  const uint64_t free_last = budget > used ? budget - used : 0;
  bool engram_cold = false;
  if (engram_bytes > 0) {
    if (req.engram == EngramTier::Ram) {
      rows[kEngram].residence = Residence::Copied;
      rows[kEngram].anon_bytes = engram_bytes;
      used += engram_bytes;
      if (used > budget && plan.fits()) {
        plan.refusal = "the Engram tables (" + format_bytes(static_cast<double>(engram_bytes)) +
                       ") do not fit in RAM (--engram ram) beside the rest of the plan; the budget is " +
                       format_bytes(static_cast<double>(budget)) + " (use --engram mmap or pread)";
      }
    } else {
      rows[kEngram].residence = req.engram == EngramTier::Pread ? Residence::Read : Residence::Streamed;
      if (engram_bytes <= free_last) {
        rows[kEngram].cached_bytes = engram_bytes;
        used += engram_bytes;
      } else {
        engram_cold = true;
      }
    }
  }

  // Disk traffic per decode token and at load.
  double expert_token_bytes = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    expert_token_bytes += static_cast<double>(c.activated_experts(l)) * static_cast<double>(layer_expert_bytes[static_cast<size_t>(l)]);
  }
  plan.expert_bytes_per_token = expert_token_bytes;
  if (experts_resident) {
    plan.hit_rate = 1;
  } else {
    // Uniform routing: the cached fraction of the experts (what a frequency policy improves on).
    const double cached = packs ? static_cast<double>(plan.expert_cache_bytes) / static_cast<double>(std::max<uint64_t>(experts_packed, 1))
                                : static_cast<double>(rows[kExperts].cached_bytes) / static_cast<double>(std::max<uint64_t>(experts_bytes, 1));
    plan.hit_rate = req.hit_rate >= 0 ? std::min(req.hit_rate, 1.0) : cached;
  }
  double disk = expert_token_bytes * (1 - plan.hit_rate);
  disk += static_cast<double>(dense_from_disk);
  if (engram_cold) {
    disk += static_cast<double>(c.engram_layer_ids.size()) * c.engram_hash_columns() * static_cast<double>(kPage);
  }
  plan.disk_bytes_per_token = disk;
  plan.load_bytes = static_cast<double>(rows[kVectors].checkpoint_bytes + rows[kWoA].checkpoint_bytes) +
                    (plan.pack_dense ? static_cast<double>(dense_mapped) : 0) +
                    (plan.pack_experts ? static_cast<double>(experts_bytes) : 0) +
                    (req.engram == EngramTier::Ram ? static_cast<double>(engram_bytes) : 0);
  plan.load_seconds = plan.load_bytes / std::max(req.disk_bytes_per_s, 1.0);

  for (const PlanRow& r : plan.rows) plan.weights_anon_bytes += r.anon_bytes;
  // the Engram store's copy and the expert cache fill later, not at load
  if (req.engram == EngramTier::Ram) plan.weights_anon_bytes -= rows[kEngram].anon_bytes;
  if (!plan.pack_experts) plan.weights_anon_bytes -= rows[kExperts].anon_bytes;
  plan.steady_bytes = used;
  plan.load_peak_bytes = used + largest;
  if (plan.fits() && used > budget && experts_resident) {
    plan.warnings.push_back("the plan needs " + format_bytes(static_cast<double>(used)) + " against a budget of " +
                            format_bytes(static_cast<double>(budget)));
  }
  return plan;
}

uint64_t kv_reserve_bytes(const ModelConfig& config, uint64_t kv_budget_bytes, int parallel) {
  const StateGraph graph = build_state_graph(config, derive_layer_roles(config));
  const double per_sequence = static_cast<double>(config.max_seq_len) * graph.global_bytes_per_token() +
                              static_cast<double>(graph.fixed_bytes_per_sequence());
  return static_cast<uint64_t>(std::min(static_cast<double>(kv_budget_bytes), std::max(parallel, 1) * per_sequence));
}

void require_plan_fits(const MemoryPlan& plan, const std::string& where) {
  if (!plan.fits()) fail(where, "does not fit in the memory budget: " + plan.refusal);
}

nlohmann::json plan_to_json(const MemoryPlan& p) {
  nlohmann::json j;
  j["budget_bytes"] = p.request.ram_bytes;
  j["fits"] = p.fits();
  if (!p.fits()) j["refusal"] = p.refusal;
  j["pack_dense"] = p.pack_dense;
  j["pack_experts"] = p.pack_experts;
  j["tile_rows"] = p.request.tile_rows;
  j["engram_tier"] = engram_tier_name(p.request.engram);
  j["classes"] = nlohmann::json::array();
  for (const PlanRow& r : p.rows) {
    j["classes"].push_back({{"name", r.name}, {"what", r.what}, {"tensors", r.tensors},
                            {"checkpoint_bytes", r.checkpoint_bytes}, {"residence", residence_name(r.residence)},
                            {"anon_bytes", r.anon_bytes}, {"cached_bytes", r.cached_bytes}});
  }
  j["weights_anon_bytes"] = p.weights_anon_bytes;
  j["runtime_bytes"] = p.runtime_bytes;
  j["kv_bytes"] = p.request.kv_bytes;
  j["prompt_cache_bytes"] = p.prompt_cache_bytes;
  j["expert_cache_bytes"] = p.expert_cache_bytes;
  j["steady_bytes"] = p.steady_bytes;
  j["load_peak_bytes"] = p.load_peak_bytes;
  j["hit_rate"] = p.hit_rate;
  j["expert_bytes_per_token"] = p.expert_bytes_per_token;
  j["disk_bytes_per_token"] = p.disk_bytes_per_token;
  j["load_bytes"] = p.load_bytes;
  j["load_seconds"] = p.load_seconds;
  j["disk_bytes_per_s"] = p.request.disk_bytes_per_s;
  j["warnings"] = p.warnings;
  return j;
}

std::string plan_to_text(const MemoryPlan& p) {
  const auto b = [](uint64_t v) { return format_bytes(static_cast<double>(v)); };
  std::string out = "budget " + b(p.request.ram_bytes) + (p.request.tile_rows > 0 ? "" : " (backend reads the checkpoint layout)") + "\n\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %-15s %8s %12s %-9s %12s %12s\n", "class", "tensors", "checkpoint", "where",
                "anonymous", "page cache");
  out += line;
  for (const PlanRow& r : p.rows) {
    std::snprintf(line, sizeof line, "  %-15s %8lld %12s %-9s %12s %12s\n", r.name.c_str(),
                  static_cast<long long>(r.tensors), b(r.checkpoint_bytes).c_str(), residence_name(r.residence),
                  b(r.anon_bytes).c_str(), b(r.cached_bytes).c_str());
    out += line;
  }
  out += "\n  runtime (KV " + b(p.request.kv_bytes) + ", activations and process) " + b(p.runtime_bytes) +
         "; prompt cache RAM " + b(p.prompt_cache_bytes) + "\n";
  out += "  steady state " + b(p.steady_bytes) + ", load peak " + b(p.load_peak_bytes) + "\n";
  if (p.expert_cache_bytes > 0) {
    out += std::string("  expert cache ") + (p.request.tile_rows > 0 ? "(packed, read by pread) " : "(page cache) ") +
           b(p.expert_cache_bytes) + "\n";
  }
  std::snprintf(line, sizeof line,
                "  per decode token: %s of routed experts, %s from disk at a %.1f%% expert hit rate\n",
                b(static_cast<uint64_t>(p.expert_bytes_per_token)).c_str(),
                b(static_cast<uint64_t>(p.disk_bytes_per_token)).c_str(), p.hit_rate * 100);
  out += line;
  std::snprintf(line, sizeof line, "  load: %s read, %.1f s at %.2f GB/s\n", b(static_cast<uint64_t>(p.load_bytes)).c_str(),
                p.load_seconds, p.request.disk_bytes_per_s / 1e9);
  out += line;
  for (const std::string& w : p.warnings) out += "  warning: " + w + "\n";
  if (!p.fits()) out += "  does not fit: " + p.refusal + "\n";
  return out;
}

}  // namespace dsv41
