// Where each class of tensor lives for a RAM budget, decided from the config alone (so `dsv41 plan`
// can answer for the released checkpoint without its 510 GB), and followed by the loader.
//
// The order of claims on the budget, each class whole or not at all:
//   1. what must be in anonymous memory whatever the budget: the F32 tensors, the small BF16 vectors
//      converted at load, attn.wo_a dequantized to bf16 (the reference's converter does it), the
//      runtime's KV reserve and an estimate of the activations;
//   2. the dense matrices every token reads (FP8 attention and shared experts, the BF16 linears):
//      packed for the kernels when the backend packs and they fit, else read through the mapping;
//   3. the routed experts: packed when all of them fit (they are then never read from disk again),
//      else streamed: read by pread into the expert cache (model/expert_cache.h), packed experts in
//      what is left of the budget after the prompt cache's share (a backend that packs nothing reads
//      them through the mapping instead, the page cache their cache);
//   4. the prompt cache's RAM, up to what was asked for, from what is left;
//   5. the Engram tables in the tier asked for (mmap and pread: page cache / reads; ram: anonymous).
// Packing never holds a whole second copy: each matrix is packed from its mapped pages, which are then
// dropped from the process (weights.cpp), so the load peak is the steady state plus one matrix.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "io/config.h"
#include "io/engram_store.h"

namespace dsv41 {

enum class Residence {
  Packed,    // re-laid for the kernels in the backend's anonymous memory
  Copied,    // copied or converted out of the checkpoint into anonymous memory
  Mapped,    // read through the mapping every token: needs the page cache to hold it
  Gathered,  // rows read through the mapping as tokens need them (embeddings)
  Streamed,  // read through the mapping on demand, cached by the page cache as far as it holds
  Read,      // read from the file by I/O threads (the Engram pread tier)
};
const char* residence_name(Residence r);

// One class of tensors.
struct PlanRow {
  std::string name;              // e.g. "dense_fp8", "routed_experts"
  std::string what;              // for people
  int64_t tensors = 0;
  uint64_t checkpoint_bytes = 0;  // their bytes in the checkpoint
  Residence residence = Residence::Mapped;
  uint64_t anon_bytes = 0;        // anonymous memory they take (packed or copied)
  uint64_t cached_bytes = 0;      // page cache they need so a token reads nothing from disk
};

struct MemoryPlanRequest {
  uint64_t ram_bytes = 0;          // the budget (HostMemory::budget_bytes() when the user gives none)
  int tile_rows = 0;               // the backend's packed tile height; 0: it reads the checkpoint layout
  uint64_t kv_bytes = 0;           // KV pages the runtime may hold for running sequences
  uint64_t prompt_cache_bytes = 0; // prompt-cache RAM asked for (the plan grants up to this)
  int64_t prefill_chunk = 512;     // prompt tokens per forward call: the activations' size
  int threads = 1;                 // workers, each with its scratch
  EngramTier engram = EngramTier::Mmap;
  double hit_rate = -1;            // expert-cache hit rate to plan with; < 0: the cached fraction
  double disk_bytes_per_s = 2e9;   // for the load time (a stated assumption unless measured)
};

struct MemoryPlan {
  MemoryPlanRequest request;
  std::vector<PlanRow> rows;
  bool pack_dense = false, pack_experts = false;
  uint64_t weights_anon_bytes = 0;   // packed + copied weights: what the loader allocates (not the
                                     // expert cache nor the Engram ram tier, which fill later)
  uint64_t runtime_bytes = 0;        // KV reserve + activation estimate
  uint64_t prompt_cache_bytes = 0;   // prompt-cache RAM granted
  uint64_t expert_cache_bytes = 0;   // streamed experts' cache: packed in anonymous memory, or the
                                     // page cache for a backend that packs nothing (0 when resident)
  uint64_t steady_bytes = 0;         // anonymous + the page cache the plan counts on
  uint64_t load_peak_bytes = 0;      // steady + the largest matrix while it is being packed
  double hit_rate = 1;               // of expert reads, planned
  double expert_bytes_per_token = 0; // routed-expert bytes one decode token reads (all layers, top-k)
  double disk_bytes_per_token = 0;   // read from disk per decode token at hit_rate (experts, dense
                                     // matrices the cache cannot hold, Engram rows)
  double load_bytes = 0;             // read from the checkpoint at load
  double load_seconds = 0;           // at request.disk_bytes_per_s
  std::vector<std::string> warnings;
  std::string refusal;               // non-empty: even the minimal plan does not fit; says what

  bool fits() const { return refusal.empty(); }
  const PlanRow* find(const std::string& name) const;
};

MemoryPlan plan_memory(const ModelConfig& config, const MemoryPlanRequest& request);

// The KV the runtime plans for: its budget, or `parallel` sequences at the model's whole context
// (global rows and fixed state) when that is less.
uint64_t kv_reserve_bytes(const ModelConfig& config, uint64_t kv_budget_bytes, int parallel);

// Error naming `where`, what does not fit and the budget, when the plan does not fit.
void require_plan_fits(const MemoryPlan& plan, const std::string& where);

nlohmann::json plan_to_json(const MemoryPlan& plan);
std::string plan_to_text(const MemoryPlan& plan);

}  // namespace dsv41
