#include <algorithm>
#include <map>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <condition_variable>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <unistd.h>
#include <string>

#include "cli.h"
#include "commands.h"
#include "expert_parallel.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "bench_agent_fleet.h"
#include "bench_limits.h"
#include "library_gemm.h"
#include "bench_prompts.h"
#include "machine_peaks.h"
#include "backend_env.h"
#include "model/model.h"
#include "model/model_stats.h"
#include "io/engram_store.h"
#include "image/image_plan.h"
#include "model/vision_tower.h"
#include "numeric/formats.h"
#include "runtime/image_prepare.h"
#include "model/tensor_layout.h"
#include "runtime/engine.h"
#include "runtime/cache_mode.h"
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

// A comma-separated list of counts, each at least `min`, from option `flag`.
std::vector<int64_t> count_list(const Args& args, const std::string& flag, const std::string& fallback, int64_t min) {
  std::vector<int64_t> out;
  std::stringstream ls(args.get(flag, fallback));
  for (std::string item; std::getline(ls, item, ',');) {
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size()) fail(flag, "expects comma-separated counts, got \"" + item + "\"");
    if (v < min) fail(flag, "each count must be at least " + std::to_string(min) + ", got " + item);
    if (v > (int64_t{1} << 24)) fail(flag, "each count must be at most 16777216, got " + item);
    out.push_back(v);
  }
  if (out.empty()) fail(flag, "needs at least one count");
  return out;
}

// A tier of the prompt cache and the mode its entries are written in: one prefix-hit measurement.
struct HitKind {
  std::string tier;  // "ram" or "disk"
  CacheMode mode;
};

// --long-hits: which tier/mode pairs the prefix-hit part measures (each pair is a prefill of the
// cached history, so a large checkpoint can measure one pair per run).
std::vector<HitKind> hit_list(const Args& args) {
  std::vector<HitKind> out;
  std::stringstream ls(args.get("--long-hits", "ram/exact,ram/replay,disk/exact,disk/replay"));
  for (std::string item; std::getline(ls, item, ',');) {
    const size_t slash = item.find('/');
    const std::string tier = item.substr(0, slash);
    const std::string mode = slash == std::string::npos ? "" : item.substr(slash + 1);
    if ((tier != "ram" && tier != "disk") || (mode != "exact" && mode != "replay")) {
      fail("--long-hits", "expects TIER/MODE pairs (ram or disk / exact or replay), got \"" + item + "\"");
    }
    out.push_back({tier, parse_cache_mode(mode)});
  }
  if (out.empty()) fail("--long-hits", "names no pair");
  return out;
}

// Bytes of weights one decode token must read, in the checkpoint's formats: every backbone tensor,
// top-k of each layer's routed experts, the gathered Engram rows, the final norm and the head.
double active_decode_bytes(const ModelConfig& c) {
  double bytes = 0;
  for (const TensorSpec& t : checkpoint_tensors(c)) {
    if (t.layer >= c.n_layers) continue;  // the drafter
    double b = static_cast<double>(dtype_size(t.dtype));
    for (int64_t d : t.shape) b *= static_cast<double>(d);
    if (t.name == "embed.weight") continue;  // one row
    if (t.name.find(".ffn.experts.") != std::string::npos) b *= static_cast<double>(c.activated_experts(t.layer)) / c.routed_experts(t.layer);
    if (t.name.find(".engram.embed.") != std::string::npos) b *= static_cast<double>(c.engram_hash_columns()) / static_cast<double>(t.shape[0]);
    bytes += b;
  }
  return bytes;
}

struct Limits {
  double bandwidth_gbs = 0;
  double peak_gflops = 0;  // the best unit's register-only peak on all the backend's cores
  double disk_gbs = 0;     // the checkpoint's disk, measured when the experts are streamed from it
};

// One request through an engine, with when each of its events arrived.
struct Timed {
  std::chrono::steady_clock::time_point submitted, done;
  std::vector<std::chrono::steady_clock::time_point> tokens;
  TokenEvent last;
};

// `on_token(i)` (optional) runs on the scheduler thread as token i arrives.
Timed run_request(Engine& e, RequestParams p, const std::function<void(size_t)>& on_token = nullptr) {
  Timed t;
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  t.submitted = std::chrono::steady_clock::now();
  e.submit(std::move(p), [&](const TokenEvent& ev) {
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mu);
    if (ev.token >= 0) {
      t.tokens.push_back(now);
      if (on_token) on_token(t.tokens.size() - 1);
    }
    if (ev.done) {
      t.done = now;
      t.last = ev;
      finished = true;
      cv.notify_all();
    }
  });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return finished; });
  if (t.last.finish_reason == FinishReason::Error) fail("bench", t.last.error);
  return t;
}

double between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The engine options every scenario starts from: the loaded model, one sequence, prompts in calls
// of the tools' default chunk, no KV admission limit, and no prompt cache unless the scenario is
// about it (random prompts of one seed share prefixes).
EngineOptions bench_engine(const std::string& dir, const std::shared_ptr<const Model>& m) {
  EngineOptions eo;
  eo.model_dir = dir;
  eo.model = m;
  eo.parallel = 1;
  eo.prefill_chunk = kDefaultPrefillChunk;
  eo.kv_budget_bytes = uint64_t{1} << 60;
  eo.cache_ram_bytes = 0;
  return eo;
}

RequestParams bench_request(std::vector<int32_t> prompt, int64_t max_tokens) {
  RequestParams p;
  p.prompt = std::move(prompt);
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  p.sampling.temperature = 0;
  p.speculative = SpeculativeMethod::Off;
  return p;
}

nlohmann::json bench_decode(const std::string& dir, const std::shared_ptr<const Model>& m,
                            const std::vector<int64_t>& contexts, int steps, const Limits& lim) {
  const double bytes = active_decode_bytes(m->config());
  nlohmann::json out = nlohmann::json::array();
  Engine e(bench_engine(dir, m));
  for (int64_t ctx : contexts) {
    // The first token comes from the prefill and the second step may also allocate the sequence's
    // next state pages: the steady per-token rate is timed from the second token on.
    // The expert cache's counters as the timed tokens start (token 1) and end.
    ExpertCacheStats before, after;
    const Timed t = run_request(e, bench_request(random_prompt(ctx, m->config().vocab_size, 1), steps + 2), [&](size_t i) {
      if (m->expert_cache() == nullptr) return;
      if (i == 1) before = m->expert_cache()->stats();
      if (i == static_cast<size_t>(steps) + 1) after = m->expert_cache()->stats();
    });
    const double tok_s = steps / between(t.tokens[1], t.tokens.back());
    nlohmann::json row = {{"context", ctx}, {"tok_s", tok_s}, {"active_bytes_per_token", bytes},
                          {"bandwidth_efficiency", bytes * tok_s / (lim.bandwidth_gbs * 1e9)}};
    if (m->expert_cache()) {
      // Streamed experts: the timed tokens' expert reads per token, and the rate the disk allows at
      // that miss traffic (the target's yardstick).
      const double lookups = static_cast<double>(after.hits + after.misses - before.hits - before.misses);
      const double read_per_token = static_cast<double>(after.bytes_read - before.bytes_read) / steps;
      row["expert_cache"] = {{"hit_rate", lookups > 0 ? static_cast<double>(after.hits - before.hits) / lookups : 1.0},
                             {"bytes_read_per_token", read_per_token},
                             {"read_gbs", (after.read_seconds - before.read_seconds) > 0
                                              ? static_cast<double>(after.bytes_read - before.bytes_read) /
                                                    (after.read_seconds - before.read_seconds) / 1e9
                                              : 0.0}};
      if (lim.disk_gbs > 0 && read_per_token > 0) {
        const double disk_bound = lim.disk_gbs * 1e9 / read_per_token;
        row["expert_cache"]["disk_bound_tok_s"] = disk_bound;
        row["expert_cache"]["disk_efficiency"] = tok_s / disk_bound;
      }
    }
    out.push_back(row);
    std::fprintf(stderr, "  decode at context %lld: %.2f tok/s\n", static_cast<long long>(ctx), tok_s);
  }
  return out;
}

// The expert-parallel job (mpirun ... --expert-parallel): every rank's resident bytes, the bytes the
// ranks exchange per prompt token and per decoded token, and the prefill and decode rates, from one
// request of `prompt` tokens and `steps` timed decode steps.
nlohmann::json bench_expert_parallel(const std::string& dir, const std::shared_ptr<const Model>& m, MpiExpertPeers& peers,
                                     int64_t prompt, int steps) {
  Engine e(bench_engine(dir, m));
  ExchangeStats start, prefilled, first, last;
  start = peers.stats();
  const Timed t = run_request(e, bench_request(random_prompt(prompt, m->config().vocab_size, 1), steps + 2), [&](size_t i) {
    if (i == 0) prefilled = peers.stats();
    if (i == 1) first = peers.stats();
    if (i == static_cast<size_t>(steps) + 1) last = peers.stats();
  });
  const std::vector<uint64_t> resident = peers.resident_bytes_per_rank();
  const double prefill_s = between(t.submitted, t.tokens[0]), decode_s = between(t.tokens[1], t.tokens.back());
  nlohmann::json out = {
      {"ranks", peers.share().ranks},
      {"resident_bytes_per_rank", resident},
      {"exchanged_bytes_per_token", static_cast<double>(last.bytes - first.bytes) / steps},
      {"exchanged_bytes_per_prompt_token", static_cast<double>(prefilled.bytes - start.bytes) / static_cast<double>(prompt)},
      {"decode_tok_s", steps / decode_s},
      {"prefill_tok_s", static_cast<double>(prompt) / prefill_s},
      {"prompt_tokens", prompt},
      {"decode_steps", steps}};
  std::fprintf(stderr, "  %d ranks: prefill %.1f tok/s, decode %.2f tok/s, %.0f bytes exchanged per decoded token\n",
               peers.share().ranks, out["prefill_tok_s"].get<double>(), out["decode_tok_s"].get<double>(),
               out["exchanged_bytes_per_token"].get<double>());
  return out;
}

nlohmann::json bench_cold_prefill(const std::string& dir, const std::shared_ptr<const Model>& m,
                                  const std::vector<int64_t>& lengths, const Limits& lim) {
  const ModelConfig& c = m->config();
  const ParamCounts p = count_params(c);
  const double head = static_cast<double>(c.vocab_size * c.dim);
  nlohmann::json out = nlohmann::json::array();
  Engine e(bench_engine(dir, m));
  for (int64_t n : lengths) {
    for (PrefillMode mode : {PrefillMode::Exact, PrefillMode::Tail}) {
      RequestParams r = bench_request(random_prompt(n, c.vocab_size, 2), 1);
      r.prefill_mode = mode;
      const Timed t = run_request(e, std::move(r));
      const double secs = between(t.submitted, t.tokens.front());  // the prefill and its first token
      // FLOPs: 2 per active weight per row (tail mode runs the late layers on `window` rows only),
      // plus the indexer's scoring and the attention, which grow with the context (context_flops)
      const double late = static_cast<double>(p.active_decode) - head - static_cast<double>(p.active_prefill);
      const double rows_late = mode == PrefillMode::Tail ? std::min<double>(static_cast<double>(n), c.window_size) : static_cast<double>(n);
      const double context = context_flops(c, n, mode == PrefillMode::Tail);
      const double flops = 2.0 * (static_cast<double>(p.active_prefill) * static_cast<double>(n) + late * rows_late + head) + context;
      const double tok_s = static_cast<double>(n) / secs;
      out.push_back({{"prompt_tokens", n}, {"mode", mode == PrefillMode::Exact ? "exact" : "tail"}, {"tok_s", tok_s},
                     {"flops", flops}, {"context_flops_share", context / flops},
                     {"flops_efficiency", flops / secs / (lim.peak_gflops * 1e9)}});
      std::fprintf(stderr, "  cold prefill %lld tokens (%s): %.1f tok/s\n", static_cast<long long>(n),
                   mode == PrefillMode::Exact ? "exact" : "tail", tok_s);
    }
  }
  return out;
}

// The unit a level's GEMM path runs on (machine_peaks.h's names).
const char* gemm_unit(Isa level) {
  switch (level) {
    case Isa::amx_bf16:
      return "amx_bf16";
    case Isa::avx512_bf16:
      return "avx512_bf16";
    case Isa::avx512:
      return "avx512_fp32_fma";
    case Isa::avx2:
      return "avx2_fp32_fma";
    case Isa::scalar:
      break;
  }
  return "";
}

// The project's own GEMM kernels at the released checkpoint's shapes (hidden_size 5120,
// moe_intermediate_size 2304): the shared expert's FP8 up projection and the routed experts' FP4 up
// and down projections, each at several row counts, against the best unit's peak and against the
// peak of the unit the level computes on. Every SIMD level the machine runs is measured in the same
// run (the engine's own level first), so a level's gain is a ratio of one run.
nlohmann::json bench_gemm(const Backend& backend, const std::vector<int64_t>& rows, const Limits& lim,
                          const std::vector<UnitPeak>& peaks) {
  struct Shape {
    const char* kernel;
    const char* weight;
    int64_t k, n;
  };
  const Shape shapes[] = {{"linear_fp8", "ffn.shared_experts.w1", 5120, 2304},
                          {"linear_fp4", "ffn.experts.w1", 5120, 2304},
                          {"linear_fp4", "ffn.experts.w2", 2304, 5120}};
  std::vector<std::unique_ptr<Backend>> others;
  std::vector<const Backend*> levels{&backend};
  for (const Isa level : available_backend_levels()) {
    if (level == Isa::scalar || level == backend.level()) continue;
    others.push_back(make_backend({level, backend.threads(), true}, "bench gemm"));
    levels.push_back(others.back().get());
  }
  nlohmann::json out = nlohmann::json::array();
  for (const Backend* b : levels) {
    double unit_peak = 0;
    for (const UnitPeak& p : peaks) {
      if (p.unit == gemm_unit(b->level())) unit_peak = p.gflops;
    }
    for (const Shape& sh : shapes) {
      for (int64_t m : rows) {
        const int reps = m >= 256 ? 2 : 5;
        const double g = std::string(sh.kernel) == "linear_fp8" ? measure_fp8_gemm_gflops(*b, m, sh.k, sh.n, reps)
                                                               : measure_fp4_gemm_gflops(*b, m, sh.k, sh.n, reps);
        nlohmann::json row = {{"kernel", sh.kernel}, {"weight", sh.weight}, {"level", b->name()},
                              {"m", m},           {"n", sh.n},           {"k", sh.k},
                              {"gflops", g},      {"efficiency", g / lim.peak_gflops}};
        if (unit_peak > 0) {
          row["unit"] = gemm_unit(b->level());
          row["unit_efficiency"] = g / unit_peak;
        }
        out.push_back(row);
        std::fprintf(stderr, "  %s %s %s m=%lld: %.1f GFLOP/s\n", b->name(), sh.kernel, sh.weight,
                     static_cast<long long>(m), g);
      }
    }
  }
  // The library's bf16 matmul at each shape and row count, where the build has one (library_gemm.h),
  // after the project's kernels so its threads' idle spinning cannot slow theirs.
  const std::string library = gemm_library();
  if (library.empty()) return out;
  std::map<std::pair<int64_t, int64_t>, double> library_gflops;  // (k, m) -> GFLOP/s; n follows from k
  for (auto& row : out) {
    const int64_t k = row["k"].get<int64_t>(), n = row["n"].get<int64_t>(), m = row["m"].get<int64_t>();
    if (library_gflops.count({k, m}) == 0) {  // the two FP4 up projections share a shape
      library_gflops[{k, m}] = library_bf16_gemm_gflops(m, k, n, m >= 256 ? 2 : 5);
      std::fprintf(stderr, "  %s bf16 matmul m=%lld %lld -> %lld: %.1f GFLOP/s\n", library.c_str(),
                   static_cast<long long>(m), static_cast<long long>(k), static_cast<long long>(n),
                   library_gflops[{k, m}]);
    }
    const double lib = library_gflops[{k, m}];
    row["library"] = library;
    row["library_gflops"] = lib;
    row["over_library"] = row["gflops"].get<double>() / lib;
  }
  return out;
}

// Time to first token with the first `cached` tokens of a prompt of `cached + fresh` in the prompt
// cache, against that prompt's cold prefill: the stem is run (prefill only) through an engine with a
// prompt cache, then the whole prompt through the same engine (RAM tier) or through a new engine on
// the cache's folder (disk tier: only the files remain). `cached_tokens` is what the engine restored:
// a prompt's state is stored at its last whole cache block short of its last token (which must run
// for its logits), so the stem is one token longer than `cached`, as an agent's previous turn (its
// prompt and its answer) is longer than the history the next turn resends.
nlohmann::json bench_prefix_hit(const std::string& dir, const std::shared_ptr<const Model>& m, int64_t cached,
                                int64_t fresh, const std::vector<HitKind>& kinds) {
  const std::vector<int32_t> prompt = random_prompt(cached + fresh, m->config().vocab_size, 3);
  const std::vector<int32_t> stem(prompt.begin(), prompt.begin() + std::min(cached + 1, cached + fresh));
  auto ttft = [&](Engine& e) {
    const Timed t = run_request(e, bench_request(prompt, 1));
    return std::pair<double, int64_t>{between(t.submitted, t.tokens.front()), t.last.cached_tokens};
  };
  double cold = 0;
  {
    Engine e(bench_engine(dir, m));
    cold = ttft(e).first;
  }
  nlohmann::json out = nlohmann::json::array();
  const std::string folder = (std::filesystem::temp_directory_path() / ("dsv41-bench-" + std::to_string(getpid()))).string();
  for (const HitKind& kind : kinds) {
    const char* tier = kind.tier.c_str();
    const CacheMode mode = kind.mode;
    std::filesystem::remove_all(folder);
    EngineOptions eo = bench_engine(dir, m);
    eo.cache_mode = mode;
    eo.cache_ram_bytes = uint64_t{8} << 30;
    const bool disk = kind.tier == "disk";
    if (disk) eo.prompt_cache_dir = folder;
    std::pair<double, int64_t> hit;
    {
      Engine writer(eo);
      run_request(writer, bench_request(stem, 0));
      if (!disk) hit = ttft(writer);
    }
    if (disk) {
      Engine reader(eo);
      hit = ttft(reader);
    }
    out.push_back({{"prompt_tokens", cached + fresh}, {"cached_tokens", hit.second},
                   {"new_tokens", cached + fresh - hit.second}, {"tier", tier}, {"mode", cache_mode_name(mode)},
                   {"ttft_s", hit.first}, {"cold_ttft_s", cold}, {"speedup", cold / hit.first}});
    std::fprintf(stderr, "  prefix hit %s/%s, %lld cached: %.3f s vs cold %.3f s\n", tier, cache_mode_name(mode),
                 static_cast<long long>(hit.second), hit.first, cold);
  }
  std::filesystem::remove_all(folder);
  return out;
}

// The agent's shape of work: cold prefill and decode out to long contexts, and a turn that finds
// its history cached and brings a few hundred new tokens.
struct LongContextPlan {
  std::vector<int64_t> prefill_lengths, decode_contexts;
  int64_t cached = 0, fresh = 0;
  int steps = 0;
  std::vector<HitKind> hits;
  // The parts that run (--long-parts): on a large checkpoint the whole scenario is hours of prefill,
  // and each part's ratios (efficiency against the run's peak, decode against its shortest context,
  // a hit against its cold prefill) are whole within the part, so the parts can be separate runs.
  bool prefill = true, decode = true, prefix_hit = true;
};

nlohmann::json bench_long_context(const std::string& dir, const std::shared_ptr<const Model>& m,
                                  const LongContextPlan& plan, const Limits& lim) {
  int64_t longest = 0;
  if (plan.prefix_hit) longest = std::max(longest, plan.cached + plan.fresh);
  if (plan.decode) longest = std::max(longest, *std::max_element(plan.decode_contexts.begin(), plan.decode_contexts.end()) + plan.steps + 2);
  if (plan.prefill) longest = std::max(longest, *std::max_element(plan.prefill_lengths.begin(), plan.prefill_lengths.end()));
  if (longest > m->config().max_seq_len) {
    fail("--scenario long-context", "needs " + std::to_string(longest) + " positions but the model has " +
                                        std::to_string(m->config().max_seq_len) +
                                        " (max_position_embeddings; make-tiny --preset long has 1048576)");
  }
  nlohmann::json out = nlohmann::json::object();
  if (plan.prefill) out["prefill"] = bench_cold_prefill(dir, m, plan.prefill_lengths, lim);
  if (plan.decode) out["decode"] = bench_decode(dir, m, plan.decode_contexts, plan.steps, lim);
  if (plan.prefix_hit) out["prefix_hit"] = bench_prefix_hit(dir, m, plan.cached, plan.fresh, plan.hits);
  return out;
}

// Aggregate decode throughput of N concurrent streams through the engine's scheduler, counted once
// every stream has its first token (so the streams' prefills are not in it).
nlohmann::json bench_concurrency(const std::string& dir, const std::shared_ptr<const Model>& m,
                                 const std::vector<int>& streams, int tokens) {
  nlohmann::json out = nlohmann::json::array();
  for (int n : streams) {
    EngineOptions eo;
    eo.model_dir = dir;
    eo.model = m;
    eo.parallel = n;
    Engine e(eo);
    std::mutex mu;
    std::condition_variable cv;
    int done = 0, started = 0;
    int64_t after_start = 0;
    std::chrono::steady_clock::time_point all_started{}, last_token{};
    std::vector<bool> seen(static_cast<size_t>(n), false);
    for (int i = 0; i < n; ++i) {
      RequestParams p;
      p.prompt = random_prompt(32, e.config().vocab_size, 10 + static_cast<uint32_t>(i));
      p.max_tokens = tokens;
      p.ignore_eos = true;
      e.submit(p, [&, i](const TokenEvent& ev) {
        std::lock_guard<std::mutex> lock(mu);
        if (ev.token >= 0) {
          const auto now = std::chrono::steady_clock::now();
          if (!seen[static_cast<size_t>(i)]) {
            seen[static_cast<size_t>(i)] = true;
            if (++started == n) all_started = now;
          } else if (started == n) {
            ++after_start;
            last_token = now;
          }
        }
        if (ev.done) {
          ++done;
          cv.notify_all();
        }
      });
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done == n; });
    const double secs = std::chrono::duration<double>(last_token - all_started).count();
    const double tok_s = secs > 0 ? static_cast<double>(after_start) / secs : 0;
    out.push_back({{"streams", n}, {"aggregate_tok_s", tok_s}});
    std::fprintf(stderr, "  %d streams: %.2f tok/s aggregate\n", n, tok_s);
  }
  return out;
}

// vision: one image of each pixel size (WxH) through the vision tower on the model's backend (the ViT,
// the aligner, the span rows: what a request's image costs before its span is prefilled), with
// seeded patch values; its plan is the model's (the size it is resized to, its patches, its span).
// Image tokens/s counts the span's positions; FLOPs are 2 per multiply-add of the ViT's linears and
// attention and of the aligner, against the best unit's peak and the peak of the unit the level's
// GEMMs run on (the ViT's linears and its attention scores; the attention's P·V stays fp32).
nlohmann::json bench_vision(const Model& m, const std::vector<std::pair<int64_t, int64_t>>& sizes, const Limits& lim,
                            const std::vector<UnitPeak>& peaks) {
  const ModelConfig& c = m.config();
  if (!m.weights().vision) fail("--scenario vision", "the checkpoint has no vision tower (make-tiny --vision writes one)");
  const VisionTower tower(m.backend(), *m.weights().vision, c.vision, c.dim);
  double unit_peak = 0;
  for (const UnitPeak& p : peaks) {
    if (p.unit == gemm_unit(m.backend().level())) unit_peak = p.gflops;
  }
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [w, h] : sizes) {
    const ImagePlan plan = plan_image_grid(w, h, preprocess_config(c.vision));
    const ImageGrid grid{plan.n_vit_h, plan.n_vit_w};
    std::mt19937 rng(static_cast<uint32_t>(w * 7919 + h));
    std::uniform_real_distribution<float> value(-1.0f, 1.0f);
    std::vector<float> patches(static_cast<size_t>(plan.num_patches() * c.vision.patch_values()));
    for (float& x : patches) x = round_bf16(value(rng));
    tower.embed(patches.data(), grid);  // warm: scratch, pages, caches
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<float> rows = tower.embed(patches.data(), grid);
    const double secs = between(t0, std::chrono::steady_clock::now());
    const double flops = tower.flops(grid);
    nlohmann::json row = {{"width", w},
                          {"height", h},
                          {"resized", std::to_string(plan.best_w) + "x" + std::to_string(plan.best_h)},
                          {"vit_patches", plan.num_patches()},
                          {"image_tokens", plan.num_tokens},
                          {"seconds", secs},
                          {"image_tokens_s", static_cast<double>(plan.num_tokens) / secs},
                          {"patches_s", static_cast<double>(plan.num_patches()) / secs},
                          {"flops", flops},
                          {"gflops", flops / secs / 1e9},
                          {"flops_efficiency", flops / secs / (lim.peak_gflops * 1e9)}};
    if (unit_peak > 0) {
      row["unit"] = gemm_unit(m.backend().level());
      row["unit_efficiency"] = flops / secs / (unit_peak * 1e9);
    }
    out.push_back(row);
    std::fprintf(stderr, "  image %lldx%lld: %lld patches, %lld image tokens in %.3f s (%.1f GFLOP/s)\n",
                 static_cast<long long>(w), static_cast<long long>(h), static_cast<long long>(plan.num_patches()),
                 static_cast<long long>(plan.num_tokens), secs, flops / secs / 1e9);
  }
  return out;
}

// WxH pixel sizes from option `flag`.
std::vector<std::pair<int64_t, int64_t>> size_list(const Args& args, const std::string& flag, const std::string& fallback) {
  std::vector<std::pair<int64_t, int64_t>> out;
  std::stringstream ls(args.get(flag, fallback));
  for (std::string item; std::getline(ls, item, ',');) {
    long long w = 0, h = 0;
    char x = 0, rest = 0;
    if (std::sscanf(item.c_str(), "%lld%c%lld%c", &w, &x, &h, &rest) != 3 || x != 'x' || w < 1 || h < 1 ||
        w > 65535 || h > 65535) {
      fail(flag, "expects comma-separated WxH pixel sizes (1 to 65535 each), got \"" + item + "\"");
    }
    out.push_back({w, h});
  }
  if (out.empty()) fail(flag, "needs at least one size");
  return out;
}

struct PlotSeries {
  std::string label;
  std::vector<std::pair<double, double>> points;
};

// Where a log axis from lo to hi gets labelled ticks: 1, 2 and 5 times the powers of ten inside it,
// or only the powers when those are too many to read.
std::vector<double> log_ticks(double lo, double hi) {
  std::vector<double> all, decades;
  for (int k = static_cast<int>(std::floor(std::log10(lo))); k <= static_cast<int>(std::ceil(std::log10(hi))); ++k) {
    for (double m : {1.0, 2.0, 5.0}) {
      const double v = m * std::pow(10.0, k);
      if (v < lo || v > hi) continue;
      all.push_back(v);
      if (m == 1.0) decades.push_back(v);
    }
  }
  return all.size() > 10 && decades.size() >= 2 ? decades : all;
}

// A tick's label: 0.5, 20, 5k, 2M.
std::string tick_label(double v) {
  char text[32];
  if (v >= 1e6) {
    std::snprintf(text, sizeof text, "%gM", v / 1e6);
  } else if (v >= 1e3) {
    std::snprintf(text, sizeof text, "%gk", v / 1e3);
  } else {
    std::snprintf(text, sizeof text, "%g", v);
  }
  return text;
}

// Lines on log-log axes, each measured point marked, with labelled ticks and an optional horizontal
// limit line (a roofline or a floor). Written atomically, so a failed write leaves no partial plot.
void write_svg(const std::string& path, const std::vector<PlotSeries>& series, const std::string& y_label,
               double limit, const std::string& limit_label) {
  const double W = 720, H = 420, L = 70, R = 20, T = 30, B = 50;
  double xmin = 1e300, xmax = 0, ymin = 1e300, ymax = 0;
  for (const PlotSeries& s : series)
    for (auto& [x, y] : s.points) {
      if (!(std::isfinite(x) && std::isfinite(y) && x > 0 && y > 0)) {
        fail(path, "cannot place the point (" + std::to_string(x) + ", " + std::to_string(y) + ") of \"" + s.label +
                       "\" on log axes");
      }
      xmin = std::min(xmin, x), xmax = std::max(xmax, x), ymin = std::min(ymin, y), ymax = std::max(ymax, y);
    }
  if (limit > 0) ymax = std::max(ymax, limit), ymin = std::min(ymin, limit);
  if (xmax <= 0) fail(path, "the report has no measured series to plot");
  xmin /= 1.5, xmax *= 1.5, ymin /= 3, ymax *= 3;
  auto px = [&](double x) { return L + (std::log(x) - std::log(xmin)) / (std::log(xmax) - std::log(xmin)) * (W - L - R); };
  auto py = [&](double y) { return H - B - (std::log(y) - std::log(ymin)) / (std::log(ymax) - std::log(ymin)) * (H - T - B); };
  std::ostringstream f;
  f << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H << "' font-family='sans-serif' font-size='12'>\n";
  f << "<rect width='100%' height='100%' fill='white'/><line x1='" << L << "' y1='" << H - B << "' x2='" << W - R << "' y2='" << H - B
    << "' stroke='black'/><line x1='" << L << "' y1='" << T << "' x2='" << L << "' y2='" << H - B << "' stroke='black'/>\n";
  for (double x : log_ticks(xmin, xmax)) {
    f << "<line x1='" << px(x) << "' y1='" << H - B << "' x2='" << px(x) << "' y2='" << T << "' stroke='#ddd'/><text x='" << px(x)
      << "' y='" << H - B + 15 << "' text-anchor='middle'>" << tick_label(x) << "</text>\n";
  }
  for (double y : log_ticks(ymin, ymax)) {
    f << "<line x1='" << L << "' y1='" << py(y) << "' x2='" << W - R << "' y2='" << py(y) << "' stroke='#ddd'/><text x='" << L - 5
      << "' y='" << py(y) + 4 << "' text-anchor='end'>" << tick_label(y) << "</text>\n";
  }
  f << "<text x='" << W / 2 << "' y='" << H - 12 << "' text-anchor='middle'>tokens (context or prompt length, log)</text>\n";
  f << "<text x='16' y='" << H / 2 << "' transform='rotate(-90 16 " << H / 2 << ")' text-anchor='middle'>" << y_label << "</text>\n";
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c"};
  for (size_t i = 0; i < series.size(); ++i) {
    const char* color = colors[i % 3];
    f << "<polyline fill='none' stroke='" << color << "' stroke-width='2' points='";
    for (auto& [x, y] : series[i].points) f << px(x) << "," << py(y) << " ";
    f << "'/>\n";
    for (auto& [x, y] : series[i].points) f << "<circle cx='" << px(x) << "' cy='" << py(y) << "' r='3' fill='" << color << "'/>";
    f << "\n<text x='" << L + 10 << "' y='" << T + 14 * static_cast<double>(i + 1) << "' fill='" << color << "'>"
      << series[i].label << "</text>\n";
  }
  if (limit > 0) {
    f << "<line x1='" << L << "' y1='" << py(limit) << "' x2='" << W - R << "' y2='" << py(limit)
      << "' stroke='#1f77b4' stroke-dasharray='6,4'/><text x='" << W - R - 4 << "' y='" << py(limit) - 4
      << "' text-anchor='end' fill='#1f77b4'>" << limit_label << "</text>\n";
  }
  f << "</svg>\n";
  const std::string text = f.str();
  write_file_atomic(path, text.data(), text.size());
}

// Prefill's and decode's series from scenario results, each point mapped by `y` (tok/s or its cost).
std::vector<PlotSeries> rate_series(const nlohmann::json& prefill, const nlohmann::json& decode,
                                    double (*y)(double tok_s), const std::string& what) {
  std::vector<PlotSeries> series;
  if (!decode.is_null()) {
    PlotSeries d{"decode " + what + " vs context", {}};
    for (const auto& r : decode) d.points.push_back({r.at("context").get<double>(), y(r.at("tok_s").get<double>())});
    series.push_back(d);
  }
  if (!prefill.is_null()) {
    PlotSeries exact{"prefill " + what + " vs prompt (exact)", {}}, tail{"prefill " + what + " vs prompt (tail)", {}};
    for (const auto& r : prefill) {
      (r.at("mode") == "exact" ? exact : tail).points.push_back({r.at("prompt_tokens").get<double>(), y(r.at("tok_s").get<double>())});
    }
    series.push_back(exact);
    series.push_back(tail);
  }
  return series;
}

// The long-context scenario's plot is cost per token (ms) against context, with decode's floor
// (active bytes per token over the measured bandwidth); otherwise tok/s with decode's roofline.
// `r` is a report as --json prints it, this run's or one read back (--from-report).
void write_plot(const std::string& path, const nlohmann::json& r) {
  const double bandwidth = r.at("machine").at("bandwidth_gbs").get<double>() * 1e9;
  const nlohmann::json none;
  const nlohmann::json& scope = r.contains("long_context") ? r.at("long_context") : r;
  const nlohmann::json& decode = scope.contains("decode") ? scope.at("decode") : none;
  const double active = decode.is_null() || decode.empty() ? 0 : decode.at(0).at("active_bytes_per_token").get<double>();
  if (r.contains("long_context")) {
    write_svg(path, rate_series(scope.contains("prefill") ? scope.at("prefill") : none, decode,
                                [](double tok_s) { return 1e3 / tok_s; }, "ms/token"),
              "ms per token (log)", 1e3 * active / bandwidth, "decode floor: active bytes per token / measured bandwidth");
    return;
  }
  write_svg(path, rate_series(r.contains("cold_prefill") ? r.at("cold_prefill") : none, decode,
                              [](double tok_s) { return tok_s; }, "tok/s"),
            "tokens/s (log)", active > 0 ? bandwidth / active : 0, "decode roofline: measured bandwidth / active bytes per token");
}

}  // namespace

int run_bench(int argc, char** argv, MpiJob* job) {
  if (wants_help(argc, argv)) {
    std::puts(
        "usage: dsv41 bench -m DIR [--scenario LIST] [--json] [--plot FILE.svg] [--steps N]\n"
        "       dsv41 bench --from-report REPORT.json --plot FILE.svg\n\n"
        "scenarios (comma-separated; default gemm,cold-prefill,prefix-hit,decode,concurrency):\n"
        "  gemm          the FP8 and FP4 GEMM kernels at the released checkpoint's shapes, several row counts,\n"
        "                beside oneDNN's bf16 matmul at the same shapes where the build has oneDNN\n"
        "  cold-prefill  prompt tokens/s at several prompt lengths, exact and tail mode\n"
        "  prefix-hit    time to first token with the first 90% of a prompt cached (RAM and disk tier,\n"
        "                exact and replay mode) against its cold prefill\n"
        "  decode        tokens/s at several context lengths\n"
        "  concurrency   aggregate decode tokens/s at 1, 2, 4, 8 streams through the scheduler\n"
        "  engram        per-step Engram lookup time from each tier (mmap, ram, pread)\n"
        "  vision        images through the vision tower (not in the default; needs a checkpoint with one,\n"
        "                make-tiny --vision): image tokens/s and FLOP/s against the peaks\n"
        "  long-context  the agent's shape (not in the default): cold prefill, exact and tail, out to long\n"
        "                prompts; decode out to long contexts; a turn with a long history cached and a few\n"
        "                hundred new tokens (RAM and disk tier, exact and replay). Needs a model with the\n"
        "                positions (make-tiny --preset long); --plot then draws cost per token vs context\n"
        "  agent-fleet   agent sessions at once through the scheduler (not in the default): a shared system\n"
        "                prompt, then turns of a tool's output and an answer, the next turn at once; time to\n"
        "                first token, gaps between tokens, prompt tokens from the cache, tokens/s, and the\n"
        "                same sessions one after another\n"
        "The machine's limits are measured in the same run: streaming-read memory bandwidth and, for each\n"
        "arithmetic unit present (AMX-BF16, AVX-512-BF16, AVX-512 / AVX2 fp32 FMA), its register-only peak\n"
        "on all cores. Decode is reported against the bandwidth, prefill and GEMM against the best peak.\n"
        "  --lengths A,B,..   prompt lengths / contexts (default 128,512,2048)\n"
        "  --gemm-rows A,B,.. row counts of the gemm scenario (default 1,16,64,256,1024)\n"
        "  --image-sizes WxH,..  pixel sizes of the vision scenario's images (default 256x256,1024x768,2048x2048:\n"
        "                     upscaled to the tower's minimum area, a photo, shrunk to its longest span)\n"
        "  --long-prefill A,B,..  long-context prompt lengths (default 2048,8192,32768)\n"
        "  --long-decode A,B,..   long-context decode contexts (default 1024,8192,32768)\n"
        "  --long-cached N        long-context prefix hit: tokens of history cached (default 32768)\n"
        "  --long-new N           long-context prefix hit: new tokens after them (default 256)\n"
        "  --long-parts LIST      long-context parts to run: prefill, decode, prefix-hit (default all three; on a\n"
        "                         large checkpoint each part can be its own run)\n"
        "  --long-hits LIST       the prefix hits measured, TIER/MODE pairs (default\n"
        "                         ram/exact,ram/replay,disk/exact,disk/replay; each prefills the cached history once)\n"
        "  --from-report FILE     with --plot, draws the plot of a saved --json report (FILE) and measures nothing\n"
        "  --ram SIZE             memory budget the model's load follows (default: the available RAM, or the memory\n"
        "                         cgroup's limit; above that limit it is refused); the plan and the load time are\n"
        "                         in the report\n"
        "  --fleet-sessions N     agent-fleet: sessions (default 8)\n"
        "  --fleet-turns N        agent-fleet: turns per session (default 4)\n"
        "  --fleet-lengths S,A,B,N  agent-fleet: system prompt tokens, a tool output's least and most tokens,\n"
        "                         an answer's most tokens (default 8192,1024,4096,300)\n"
        "  --step-budget-ms MS    agent-fleet: the engine's step budget, as serve's (default 0: automatic)\n"
        "  --rank-timeout S       with --expert-parallel: how long rank 0 waits for another rank's part of one\n"
        "                         layer's exchange before the job ends with status 1, naming the rank (default 300)");
    return 0;
  }
  Args args("bench", argc, argv, {"--model", "--scenario", "--steps", "--io-threads", "--plot", "--lengths", "--gemm-rows",
             "--long-prefill", "--long-decode", "--long-cached", "--long-new", "--long-parts", "--long-hits", "--ram", "--image-sizes", "--from-report",
             "--rank-timeout", "--fleet-sessions", "--fleet-turns", "--fleet-lengths", "--step-budget-ms"},
            {"--json", "--expert-parallel"},
            {{"-m", "--model"}});
  // --from-report draws the plot of a saved `--json` report and measures nothing: a run on a large
  // checkpoint is hours, and its plot can be redrawn without repeating it.
  if (args.has("--from-report")) {
    const std::string saved = args.get("--from-report");
    if (!args.has("--plot")) fail("--from-report", "draws a saved report's plot: name the file with --plot FILE.svg");
    if (args.has("--model")) fail("--from-report", "measures nothing, so it takes no --model");
    const nlohmann::json report = read_json_file(saved);
    try {
      write_plot(args.get("--plot"), report);
    } catch (const nlohmann::json::exception& e) {
      fail(saved, std::string("is not a report of bench --json: ") + e.what());
    }
    return 0;
  }
  const std::string dir = args.required("--model");
  const std::string scenarios = args.get("--scenario", "gemm,cold-prefill,prefix-hit,decode,concurrency");
  const int steps = static_cast<int>(args.get_int("--steps", 0, 1, 10000000));
  const int io_threads = static_cast<int>(args.get_int("--io-threads", 4, 1, 256));
  const uint64_t ram_bytes = ram_flag(args);
  const std::vector<int64_t> lengths = count_list(args, "--lengths", "128,512,2048", 2);
  const std::vector<int64_t> gemm_rows = count_list(args, "--gemm-rows", "1,16,64,256,1024", 1);
  const auto image_sizes = size_list(args, "--image-sizes", "256x256,1024x768,2048x2048");
  LongContextPlan long_plan;
  long_plan.prefill_lengths = count_list(args, "--long-prefill", "2048,8192,32768", 2);
  long_plan.decode_contexts = count_list(args, "--long-decode", "1024,8192,32768", 2);
  long_plan.cached = args.get_int("--long-cached", 32768, 1, int64_t{1} << 24);
  long_plan.fresh = args.get_int("--long-new", 256, 1, int64_t{1} << 24);
  long_plan.steps = steps > 0 ? steps : 16;
  long_plan.hits = hit_list(args);
  {
    std::stringstream parts(args.get("--long-parts", "prefill,decode,prefix-hit"));
    long_plan.prefill = long_plan.decode = long_plan.prefix_hit = false;
    for (std::string part; std::getline(parts, part, ',');) {
      if (part == "prefill") {
        long_plan.prefill = true;
      } else if (part == "decode") {
        long_plan.decode = true;
      } else if (part == "prefix-hit") {
        long_plan.prefix_hit = true;
      } else {
        fail("--long-parts", "unknown part \"" + part + "\" (available: prefill, decode, prefix-hit)");
      }
    }
    if (!long_plan.prefill && !long_plan.decode && !long_plan.prefix_hit) fail("--long-parts", "names no part");
  }
  FleetOptions fleet;
  fleet.sessions = static_cast<int>(args.get_int("--fleet-sessions", 8, 1, 1024));
  fleet.turns = static_cast<int>(args.get_int("--fleet-turns", 4, 1, 10000));
  {
    const std::vector<int64_t> l = count_list(args, "--fleet-lengths", "8192,1024,4096,300", 1);
    if (l.size() != 4 || l[1] > l[2]) fail("--fleet-lengths", "takes SYSTEM,TOOL_MIN,TOOL_MAX,ANSWER with TOOL_MIN <= TOOL_MAX");
    fleet.system_tokens = l[0];
    fleet.tool_min = l[1];
    fleet.tool_max = l[2];
    fleet.answer_tokens = l[3];
  }
  const double step_budget_ms = args.get_number("--step-budget-ms", 0);
  std::vector<std::string> names;
  {
    std::stringstream list(scenarios);
    for (std::string name; std::getline(list, name, ',');) {
      if (name != "engram" && name != "gemm" && name != "cold-prefill" && name != "prefix-hit" && name != "decode" &&
          name != "concurrency" && name != "long-context" && name != "vision" && name != "agent-fleet") {
        fail("--scenario", "unknown scenario \"" + name +
                               "\" (available: gemm, cold-prefill, prefix-hit, decode, concurrency, engram, long-context, "
                               "vision, agent-fleet)");
      }
      names.push_back(name);
    }
  }
  // The plot is drawn from the report's prefill and decode; refused before an hour of measuring
  // rather than after it.
  if (args.has("--plot")) {
    auto named = [&](const char* n) { return std::find(names.begin(), names.end(), n) != names.end(); };
    const bool plottable = named("long-context") ? long_plan.prefill || long_plan.decode : named("cold-prefill") || named("decode");
    if (!plottable) {
      fail("--plot", "draws prefill and decode: run the cold-prefill or decode scenario, or long-context with its prefill "
                     "or decode part");
    }
  }
  nlohmann::json report;
  Limits lim;
  std::fprintf(stderr, "measuring the machine...\n");
  const std::shared_ptr<const Backend> backend = backend_from_environment();
  lim.bandwidth_gbs = measure_bandwidth_gbs(*backend);
  const std::vector<UnitPeak> peaks = measure_unit_peaks(backend->threads());
  nlohmann::json peak_json = nlohmann::json::object(), per_core = nlohmann::json::object();
  for (const UnitPeak& p : peaks) {
    peak_json[p.unit] = p.gflops;
    per_core[p.unit] = p.gflops_per_core;
    lim.peak_gflops = std::max(lim.peak_gflops, p.gflops);
  }
  report["machine"] = {{"bandwidth_gbs", lim.bandwidth_gbs}, {"peaks", peak_json}, {"peaks_per_core", per_core},
                       {"peak_gflops", lim.peak_gflops}, {"peak_unit", peaks.front().unit},
                       {"cores", backend->threads()}, {"isa", backend->name()},
                       {"index_score_unit", backend->index_score_unit()}};
  std::shared_ptr<const Model> model;  // loaded once; every scenario's engines share it
  std::shared_ptr<MpiExpertPeers> peers;
  const std::chrono::seconds rank_timeout = rank_timeout_flag(args);
  if (args.has("--expert-parallel")) peers = expert_peers_for(job, dir, rank_timeout);
  auto need_model = [&] {
    if (model) return;
    ModelOptions mo;
    mo.expert_peers = peers;
    mo.backend = backend;
    mo.ram_bytes = ram_bytes;
    mo.prefill_chunk = kDefaultPrefillChunk;
    MemoryPlan plan;
    const auto t0 = std::chrono::steady_clock::now();
    model = load_model(dir, mo, &plan);
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    report["load"] = {{"seconds", load_s}, {"plan", plan_to_json(plan)}};
    if (model->expert_cache()) {
      // The disk is the limit of streamed experts: measured here, against the files the cache reads.
      const DiskRead disk = measure_disk_read(dir);
      lim.disk_gbs = disk.gbs;
      report["machine"]["disk_read_gbs"] = disk.gbs;
      report["machine"]["disk_read_mode"] = disk.mode;
      report["machine"]["disk_read_bytes"] = disk.bytes;
      std::fprintf(stderr, "disk read: %.2f GB/s (%s, %.1f GB)\n", disk.gbs, disk.mode.c_str(),
                   static_cast<double>(disk.bytes) / 1e9);
    }
    for (const std::string& w : plan.warnings) std::fprintf(stderr, "memory plan: %s\n", w.c_str());
    for (const std::string& key : model->config().unknown_keys) {
      std::fprintf(stderr, "%s: unknown config key %s (ignored)\n", model->config().source.c_str(), key.c_str());
    }
  };
  for (const std::string& name : names) {
    std::fprintf(stderr, "%s...\n", name.c_str());
    if (name == "gemm") {
      report["gemm"] = bench_gemm(*backend, gemm_rows, lim, peaks);
    } else if (name == "engram") {
      report["engram"] = bench_engram(dir, steps > 0 ? steps : 2000, io_threads);
    } else if (name == "decode") {
      need_model();
      report["decode"] = bench_decode(dir, model, lengths, steps > 0 ? steps : 8, lim);
    } else if (name == "cold-prefill") {
      need_model();
      report["cold_prefill"] = bench_cold_prefill(dir, model, lengths, lim);
    } else if (name == "prefix-hit") {
      need_model();
      const int64_t n = lengths.back();
      report["prefix_hit"] = bench_prefix_hit(dir, model, n * 9 / 10, n - n * 9 / 10, long_plan.hits);
    } else if (name == "concurrency") {
      need_model();
      report["concurrency"] = bench_concurrency(dir, model, {1, 2, 4, 8}, steps > 0 ? steps : 8);
    } else if (name == "long-context") {
      need_model();
      report["long_context"] = bench_long_context(dir, model, long_plan, lim);
    } else if (name == "vision") {
      need_model();
      report["vision"] = bench_vision(*model, image_sizes, lim, peaks);
    } else if (name == "agent-fleet") {
      need_model();
      std::fprintf(stderr, "agent fleet...\n");
      EngineOptions eo = bench_engine(dir, model);
      eo.step_budget_ms = step_budget_ms;
      report["agent_fleet"] = bench_agent_fleet(eo, fleet);
    }
  }
  if (peers) {
    need_model();
    std::fprintf(stderr, "expert-parallel...\n");
    report["expert_parallel"] = bench_expert_parallel(dir, model, *peers, lengths.back(), steps > 0 ? steps : 8);
  }
  // The report is printed before the plot is written, so a plot that cannot be written loses no measurement.
  auto finish = [&] {
    if (args.has("--plot")) write_plot(args.get("--plot"), report);
    return 0;
  };
  if (args.has("--json")) {
    std::printf("%s\n", report.dump(2).c_str());
    std::fflush(stdout);
    return finish();
  }
  std::printf("machine: %.1f GB/s streaming read, %d cores, kernels at level %s (indexer scores on %s)\n"
              "  register-only peaks (GFLOP/s, all cores / one core):",
              lim.bandwidth_gbs, report["machine"]["cores"].get<int>(), report["machine"]["isa"].get<std::string>().c_str(),
              backend->index_score_unit());
  for (const UnitPeak& p : peaks) std::printf(" %s %.1f / %.1f", p.unit.c_str(), p.gflops, p.gflops_per_core);
  std::printf("\n");
  if (report.contains("gemm")) {
    const bool library = !report["gemm"].empty() && report["gemm"][0].contains("library");
    std::printf("gemm (released shapes%s%s)\n  %-12s %-11s %-22s %6s %6s %6s %10s %8s %8s%s\n",
                library ? "; the library: " : "", library ? report["gemm"][0]["library"].get<std::string>().c_str() : "",
                "level", "kernel", "weight", "m", "n", "k", "GFLOP/s", "of peak", "of unit", library ? "  over lib" : "");
    for (const auto& r : report["gemm"]) {
      std::printf("  %-12s %-11s %-22s %6lld %6lld %6lld %10.1f %7.1f%% %7.1f%%", r["level"].get<std::string>().c_str(),
                  r["kernel"].get<std::string>().c_str(), r["weight"].get<std::string>().c_str(),
                  static_cast<long long>(r["m"].get<int64_t>()), static_cast<long long>(r["n"].get<int64_t>()),
                  static_cast<long long>(r["k"].get<int64_t>()), r["gflops"].get<double>(),
                  100 * r["efficiency"].get<double>(), 100 * r.value("unit_efficiency", 0.0));
      if (library) std::printf("  %7.2fx", r["over_library"].get<double>());
      std::printf("\n");
    }
  }
  if (report.contains("decode")) {
    std::printf("decode\n  %-8s %10s %14s %12s\n", "context", "tok/s", "active MB/tok", "of bandwidth");
    for (const auto& r : report["decode"]) {
      std::printf("  %-8lld %10.2f %14.1f %11.1f%%\n", static_cast<long long>(r["context"].get<int64_t>()), r["tok_s"].get<double>(),
                  r["active_bytes_per_token"].get<double>() / 1e6, 100 * r["bandwidth_efficiency"].get<double>());
    }
  }
  if (report.contains("cold_prefill")) {
    std::printf("cold prefill\n  %-8s %-6s %10s %10s\n", "prompt", "mode", "tok/s", "of peak");
    for (const auto& r : report["cold_prefill"]) {
      std::printf("  %-8lld %-6s %10.1f %9.1f%%\n", static_cast<long long>(r["prompt_tokens"].get<int64_t>()),
                  r["mode"].get<std::string>().c_str(), r["tok_s"].get<double>(), 100 * r["flops_efficiency"].get<double>());
    }
  }
  if (report.contains("prefix_hit")) {
    std::printf("prefix hit (90%% cached)\n  %-5s %-7s %8s %10s %10s %8s\n", "tier", "mode", "cached", "ttft s", "cold s", "speedup");
    for (const auto& r : report["prefix_hit"]) {
      std::printf("  %-5s %-7s %8lld %10.3f %10.3f %7.1fx\n", r["tier"].get<std::string>().c_str(),
                  r["mode"].get<std::string>().c_str(), static_cast<long long>(r["cached_tokens"].get<int64_t>()),
                  r["ttft_s"].get<double>(), r["cold_ttft_s"].get<double>(), r["speedup"].get<double>());
    }
  }
  if (report.contains("long_context")) {
    const nlohmann::json& lc = report["long_context"];
    if (lc.contains("prefill")) std::printf("long context: cold prefill\n  %-8s %-6s %10s %10s %12s\n", "prompt", "mode", "tok/s", "of peak", "ms/token");
    for (const auto& r : lc.value("prefill", nlohmann::json::array())) {
      std::printf("  %-8lld %-6s %10.1f %9.1f%% %12.3f\n", static_cast<long long>(r["prompt_tokens"].get<int64_t>()),
                  r["mode"].get<std::string>().c_str(), r["tok_s"].get<double>(), 100 * r["flops_efficiency"].get<double>(),
                  1e3 / r["tok_s"].get<double>());
    }
    if (lc.contains("decode")) std::printf("long context: decode\n  %-8s %10s %12s %14s\n", "context", "tok/s", "ms/token", "of first");
    for (const auto& r : lc.value("decode", nlohmann::json::array())) {
      const double first = lc["decode"][0]["tok_s"].get<double>();
      std::printf("  %-8lld %10.2f %12.3f %13.2fx\n", static_cast<long long>(r["context"].get<int64_t>()), r["tok_s"].get<double>(),
                  1e3 / r["tok_s"].get<double>(), r["tok_s"].get<double>() / first);
    }
    if (lc.contains("prefix_hit")) {
      std::printf("long context: prefix hit\n  %-5s %-7s %8s %6s %10s %10s %8s\n", "tier", "mode", "cached", "new", "ttft s",
                  "cold s", "speedup");
    }
    for (const auto& r : lc.value("prefix_hit", nlohmann::json::array())) {
      std::printf("  %-5s %-7s %8lld %6lld %10.3f %10.3f %7.1fx\n", r["tier"].get<std::string>().c_str(),
                  r["mode"].get<std::string>().c_str(), static_cast<long long>(r["cached_tokens"].get<int64_t>()),
                  static_cast<long long>(r["new_tokens"].get<int64_t>()), r["ttft_s"].get<double>(), r["cold_ttft_s"].get<double>(),
                  r["speedup"].get<double>());
    }
  }
  if (report.contains("vision")) {
    std::printf("vision tower (one image at a time)\n  %-11s %-11s %8s %7s %9s %12s %9s %8s %8s\n", "image", "resized",
                "patches", "tokens", "seconds", "image tok/s", "GFLOP/s", "of peak", "of unit");
    for (const auto& r : report["vision"]) {
      const std::string size = std::to_string(r["width"].get<int64_t>()) + "x" + std::to_string(r["height"].get<int64_t>());
      std::printf("  %-11s %-11s %8lld %7lld %9.3f %12.1f %9.1f %7.1f%% %7.1f%%\n", size.c_str(),
                  r["resized"].get<std::string>().c_str(), static_cast<long long>(r["vit_patches"].get<int64_t>()),
                  static_cast<long long>(r["image_tokens"].get<int64_t>()), r["seconds"].get<double>(),
                  r["image_tokens_s"].get<double>(), r["gflops"].get<double>(), 100 * r["flops_efficiency"].get<double>(),
                  100 * r.value("unit_efficiency", 0.0));
    }
  }
  if (report.contains("concurrency")) {
    std::printf("concurrency\n");
    for (const auto& r : report["concurrency"]) {
      std::printf("  %d streams: %.2f tok/s aggregate\n", r["streams"].get<int>(), r["aggregate_tok_s"].get<double>());
    }
  }
  if (report.contains("agent_fleet")) {
    const nlohmann::json& f = report["agent_fleet"];
    std::printf("agent fleet: %d sessions x %d turns\n  %-14s %8s %9s %9s %9s %9s %9s %8s %9s %9s\n", f["sessions"].get<int>(),
                f["turns"].get<int>(), "run", "wall s", "ttft p50", "ttft p99", "gap p50", "gap p99", "gap max",
                "cached", "prompt/s", "gen/s");
    for (const char* run : {"fleet", "one_at_a_time"}) {
      const nlohmann::json& r = f[run];
      std::printf("  %-14s %8.1f %7.0fms %7.0fms %7.1fms %7.1fms %7.1fms %7.1f%% %9.1f %9.1f\n", run,
                  r["wall_seconds"].get<double>(), r["ttft_ms"]["p50"].get<double>(), r["ttft_ms"]["p99"].get<double>(),
                  r["gap_ms"]["p50"].get<double>(), r["gap_ms"]["p99"].get<double>(), r["gap_ms"]["max"].get<double>(),
                  100 * r["cached_share_after_first_turn"].get<double>(), r["prompt_tok_s"].get<double>(),
                  r["generated_tok_s"].get<double>());
    }
  }
  if (report.contains("engram")) {
    std::printf("engram lookups\n  %-6s %12s %10s\n", "tier", "us/step", "rows/step");
    for (const auto& r : report["engram"]) {
      std::printf("  %-6s %12.2f %10d\n", r["tier"].get<std::string>().c_str(), r["us_per_step"].get<double>(),
                  r["rows_per_step"].get<int>());
    }
  }
  std::fflush(stdout);
  return finish();
}

}  // namespace dsv41::cli
