#include "model/model.h"

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include "model/blocks.h"
#include "numeric/formats.h"
#include "numeric/row_codecs.h"
#include "state/sequence_access.h"
#include "util/error.h"
#include "util/regular_file.h"
#include "util/host_memory.h"

namespace dsv41 {

namespace {

// One call's share of a forward over several.
struct CallRows {
  ForwardContext ctx;
  int64_t count = 0;       // the call's tokens
  int64_t late_first = 0;  // tail mode: its first row the late layers run (count: none)
  int64_t kept_from = 0;   // its first row still in the stream (late_first once the tail is cut)
  int64_t row0 = 0;        // where its rows start in the stream
  int64_t rows() const { return count - kept_from; }
  std::vector<float> view;  // capture_blocks: its stream as the layers leave it, every row
};

// Engram row fetches started before the layers run; whatever the call did not collect (it failed on
// the way) is collected here, since a started fetch must be. In an expert-parallel job only the rows
// this rank holds are fetched ahead; the others come from their owners when the layer gathers them.
class EngramFetches {
 public:
  EngramFetches(const ModelConfig& c, const ModelWeights& w, ExpertPeers* peers) : c_(c), w_(w), peers_(peers) {}
  ~EngramFetches() {
    for (size_t slot = 0; slot < tickets_.size(); ++slot) {
      if (gathered_[slot]) continue;
      try {  // only the rows fetched here: the other ranks keep nothing for a call
        EngramStore& t = table(slot);
        std::vector<uint8_t> codes(local_[slot].size() * static_cast<size_t>(t.row_bytes()));
        std::vector<uint8_t> scales(local_[slot].size() * static_cast<size_t>(t.scale_bytes()));
        t.gather(tickets_[slot], codes.data(), scales.data());
      } catch (const Error&) {
        // the call is already failing; the fetch only had to be collected
      }
    }
  }
  void start(size_t slot, std::vector<int64_t> ids) {
    if (tickets_.size() <= slot) {
      tickets_.resize(slot + 1);
      ids_.resize(slot + 1);
      local_.resize(slot + 1);
      gathered_.resize(slot + 1, true);
    }
    const auto [first, end] = table(slot).held();
    std::vector<int64_t> local;
    local_[slot].clear();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] >= first && ids[i] < end) {
        local.push_back(ids[i]);
        local_[slot].push_back(i);
      }
    }
    tickets_[slot] = table(slot).prefetch(local);
    ids_[slot] = std::move(ids);
    gathered_[slot] = false;
  }
  // The rows in prefetch order: codes [n, row_bytes] and scales [n, scale_bytes].
  std::pair<std::vector<uint8_t>, std::vector<uint8_t>> gather(size_t slot) {
    EngramStore& t = table(slot);
    const size_t rb = static_cast<size_t>(t.row_bytes()), sb = static_cast<size_t>(t.scale_bytes());
    std::vector<uint8_t> codes(ids_[slot].size() * rb), scales(ids_[slot].size() * sb);
    const std::vector<size_t>& local = local_[slot];
    gathered_[slot] = true;
    if (local.size() == ids_[slot].size()) {
      t.gather(tickets_[slot], codes.data(), scales.data());
    } else {
      std::vector<uint8_t> lc(local.size() * rb), ls(local.size() * sb);
      t.gather(tickets_[slot], lc.data(), ls.data());
      for (size_t j = 0; j < local.size(); ++j) {
        std::copy_n(&lc[j * rb], rb, &codes[local[j] * rb]);
        std::copy_n(&ls[j * sb], sb, &scales[local[j] * sb]);
      }
    }
    if (peers_ != nullptr) {
      peers_->engram_rows(static_cast<int>(slot), ids_[slot], t.rows(), t.row_bytes(), t.scale_bytes(), codes.data(),
                          scales.data());
    }
    return {std::move(codes), std::move(scales)};
  }

 private:
  EngramStore& table(size_t slot) const { return *w_.layers[c_.engram_layer_ids[slot]].engram->table; }
  const ModelConfig& c_;
  const ModelWeights& w_;
  ExpertPeers* peers_;
  std::vector<EngramStore::Ticket> tickets_;
  std::vector<std::vector<int64_t>> ids_;
  std::vector<std::vector<size_t>> local_;  // positions in ids_ of the rows held here
  std::vector<bool> gathered_;
};

}  // namespace

Model::Model(std::shared_ptr<const Backend> backend, std::shared_ptr<const ModelWeights> weights,
             EngramTokenMap token_map, uint64_t expert_cache_bytes, std::shared_ptr<ExpertPeers> expert_peers)
    : backend_(std::move(backend)),
      weights_(std::move(weights)),
      roles_(derive_layer_roles(weights_->config())),
      hasher_(weights_->config(), std::move(token_map)),
      rope_window_(config().rope_head_dim, 0, config().rope_theta, config().rope_factor, config().beta_fast,
                   config().beta_slow),
      rope_compressed_(config().rope_head_dim, config().original_seq_len, config().compress_rope_theta,
                       config().rope_factor, config().beta_fast, config().beta_slow),
      fingerprint_(model_fingerprint(config(), weights_->checkpoint().fingerprint())),
      expert_peers_(std::move(expert_peers)) {
  if (!backend_) fail("model", "needs a backend");
  if (expert_cache_bytes > 0) expert_cache_ = std::make_unique<ExpertCache>(*weights_, backend_, expert_cache_bytes);
}

SequenceState Model::new_sequence(StatePools& pools) const {
  SequenceState seq;
  SequenceParts& s = parts_of(seq);
  s.window.resize(roles_.size());
  s.window_from.assign(roles_.size(), 0);
  s.sources.resize(roles_.size());
  for (const LayerRole& r : roles_) {
    if (!r.kv_source) continue;
    s.sources[r.layer] =
        std::make_unique<KvSourceState>(pools.main_kv(r.layer), pools.index_keys(r.layer),
                                        main_kv_bytes(config().head_dim), index_key_bytes(config().index_head_dim));
  }
  return seq;
}

ForwardResult Model::forward(SequenceState& state, const std::vector<int32_t>& tokens,
                             const ForwardOptions& options) const {
  std::vector<ForwardCall> calls{{&state, tokens, options}};
  return std::move(forward(calls)[0]);
}

std::vector<ForwardResult> Model::forward(std::vector<ForwardCall>& calls) const {
  const ModelConfig& c = config();
  const Backend& be = *backend_;
  const int64_t hc = c.hc_mult, d = c.dim, V = c.vocab_size, HD = c.n_heads * c.head_dim;
  if (calls.empty()) fail("forward", "no calls");
  std::set<const SequenceState*> seen;
  for (const ForwardCall& call : calls) {
    if (call.state == nullptr || !seen.insert(call.state).second)
      fail("forward", "each call needs a sequence of its own");
    const int64_t s = static_cast<int64_t>(call.tokens.size());
    if (s == 0) fail("forward", "no tokens");
    if (call.state->length() + s > c.max_seq_len) {
      fail("forward", "context of " + std::to_string(call.state->length() + s) + " tokens exceeds the model's " +
                          std::to_string(c.max_seq_len));
    }
    for (int32_t t : call.tokens) {
      if (t < 0 || t >= V)
        fail("tokens", "id " + std::to_string(t) + " is outside the vocabulary of " + std::to_string(V));
    }
  }

  const int late = late_layer_start(c);
  std::vector<CallRows> runs(calls.size());
  std::vector<int32_t> tokens;  // every call's, one after the other: the stream's rows
  for (size_t k = 0; k < calls.size(); ++k) {
    const ForwardCall& call = calls[k];
    const ForwardOptions& opt = call.options;
    CallRows& run = runs[k];
    ForwardContext& ctx = run.ctx;
    run.count = static_cast<int64_t>(call.tokens.size());
    run.row0 = static_cast<int64_t>(tokens.size());
    // tail mode: past the last KV source only rows from tail_start on matter for any future state
    run.late_first = opt.tail_start < 0 ? 0 : std::clamp<int64_t>(opt.tail_start - call.state->length(), 0, run.count);
    if (opt.spans) {
      const SpanEmbeddings& sp = *opt.spans;
      if (static_cast<int64_t>(sp.mask.size()) != run.count)
        fail("image spans", "the mask has " + std::to_string(sp.mask.size()) + " entries for a call of " +
                                std::to_string(run.count) + " tokens");
      const int64_t positions = std::count_if(sp.mask.begin(), sp.mask.end(), [](uint8_t m) { return m != 0; });
      if (static_cast<int64_t>(sp.rows.size()) != positions * d)
        fail("image spans", "hold " + std::to_string(sp.rows.size()) + " values, not span positions·dim = " +
                                std::to_string(positions * d));
      for (int layer = 0; layer < c.n_layers && positions > 0; ++layer) {  // refused before any state moves
        if (weights_->layers[layer].ffn.gate_bias_vl.empty())
          fail("image spans", "the checkpoint has no layers." + std::to_string(layer) +
                                  ".ffn.gate.bias_vl to route image tokens with");
      }
    }
    if (opt.teacher) {
      if (opt.tail_start >= 0) fail("forward", "teacher forcing needs exact mode (no tail_start)");
      const int64_t streams = static_cast<int64_t>(opt.teacher->streams.size()), want = c.n_layers * run.count * hc * d;
      if (streams != 0 && streams != want)
        fail("forward", "teacher-forced streams hold " + std::to_string(streams) +
                            " values, not n_layers·count·hc·dim = " + std::to_string(want));
    }
    ctx.start = call.state->length();
    ctx.count = run.count;
    ctx.prefill_length = opt.prefill_length;
    ctx.index_keys = opt.index_keys;
    ctx.topk_ties = opt.topk_ties;
    ctx.replay = opt.replay;
    ctx.record_compressor_rows = opt.record_compressor_rows;
    if (opt.record_compressor_rows) {
      ctx.compressor_kv.resize(roles_.size());
      ctx.compressor_score.resize(roles_.size());
    }
    ctx.topk.resize(roles_.size());
    ctx.topk_written.assign(roles_.size(), false);
    ctx.capture_index = opt.capture_index;
    ctx.teacher = opt.teacher.get();
    if (opt.capture_index) ctx.index_captures.resize(roles_.size());
    tokens.insert(tokens.end(), call.tokens.begin(), call.tokens.end());
  }

  // Engram row ids depend only on token ids, so they are computed up front and their rows fetched
  // (asynchronously, with the pread tier) while the layers before each Engram layer run.
  EngramFetches fetches(c, *weights_, expert_peers_.get());
  if (!c.engram_layer_ids.empty()) {
    std::vector<std::vector<int64_t>> ids(c.engram_layer_ids.size());
    for (ForwardCall& call : calls) {
      SequenceParts& st = parts_of(*call.state);
      std::vector<int64_t> compressed = hasher_.compress(call.tokens);
      if (call.options.spans) {  // span positions are DEAD for Engram, also in the history kept
        for (size_t i = 0; i < compressed.size(); ++i)
          if (call.options.spans->mask[i] != 0) compressed[i] = kEngramDead;
      }
      for (size_t slot = 0; slot < ids.size(); ++slot) {
        const std::vector<int64_t> rows = hasher_.row_ids(static_cast<int>(slot), st.engram_recent, compressed);
        ids[slot].insert(ids[slot].end(), rows.begin(), rows.end());
      }
      st.engram_recent.insert(st.engram_recent.end(), compressed.begin(), compressed.end());
      const size_t keep = static_cast<size_t>(c.engram_max_ngram_size - 1);
      if (st.engram_recent.size() > keep)
        st.engram_recent.erase(st.engram_recent.begin(), st.engram_recent.end() - keep);
    }
    for (size_t slot = 0; slot < ids.size(); ++slot) fetches.start(slot, std::move(ids[slot]));
  }

  std::vector<ForwardResult> results(calls.size());
  Stream x = embed_tokens(be, c, weights_->embed, tokens.data(), static_cast<int64_t>(tokens.size()));
  // image spans: their assembled rows replace the token embeddings in every copy (vision-spec §6.1)
  for (size_t k = 0; k < calls.size(); ++k) {
    if (!calls[k].options.spans) continue;
    const SpanEmbeddings& sp = *calls[k].options.spans;
    x.span.resize(static_cast<size_t>(x.rows), 0);
    const float* row = sp.rows.data();
    for (int64_t i = 0; i < runs[k].count; ++i) {
      if (sp.mask[static_cast<size_t>(i)] == 0) continue;
      const int64_t at = runs[k].row0 + i;
      x.span[static_cast<size_t>(at)] = 1;
      for (int64_t cp = 0; cp < hc; ++cp) {  // as a bf16 write (the reference's span rows are bf16)
        for (int64_t j = 0; j < d; ++j) x.X[(at * hc + cp) * d + j] = round_bf16(row[j]);
      }
      row += d;
    }
  }
  const int64_t width = hc * d, n_taps = static_cast<int64_t>(c.dspark_target_layer_ids.size());
  for (size_t k = 0; k < calls.size(); ++k) {
    if (calls[k].options.capture_blocks) {
      runs[k].view.assign(x.X.begin() + runs[k].row0 * width, x.X.begin() + (runs[k].row0 + runs[k].count) * width);
      results[k].block_outputs.resize(static_cast<size_t>(c.n_layers * runs[k].count * width));
    }
    if (calls[k].options.dspark_taps) results[k].dspark_taps.resize(static_cast<size_t>(runs[k].count * n_taps * d));
  }
  bool replay = true;  // the compressor's projections are left out only when no call needs them
  for (const ForwardCall& call : calls) replay = replay && call.options.replay;

  int64_t tap = 0;
  for (int layer = 0; layer < c.n_layers; ++layer) {
    const LayerRole& r = roles_[layer];
    const LayerWeights& L = weights_->layers[layer];
    if (layer == late) {
      // From here on a tail-mode call is its tail: its earlier rows leave the stream, and what earlier
      // layers published per query is trimmed to the tail's queries.
      std::vector<int64_t> kept;
      int64_t row0 = 0;
      for (size_t k = 0; k < runs.size(); ++k) {
        CallRows& run = runs[k];
        for (int64_t i = run.late_first; i < run.count; ++i) kept.push_back(run.row0 + i);
        const int64_t first = run.late_first;
        run.kept_from = first;
        run.row0 = row0;
        row0 += run.rows();
        // A one-shot tail-mode prefill runs its late layers from the tail's start, a call that does not
        // start at 0, so in the decode layout; each chunk of a chunked one does the same.
        if (calls[k].options.tail_start > 0) run.ctx.prefill_length = -1;
        if (first == 0 || first == run.count) continue;
        run.ctx.start += first;
        run.ctx.count -= first;
        for (auto& per_query : run.ctx.topk) {
          if (!per_query.empty()) per_query.erase(per_query.begin(), per_query.begin() + first);
        }
        if (!run.ctx.candidates.empty())
          run.ctx.candidates.erase(run.ctx.candidates.begin(), run.ctx.candidates.begin() + first);
      }
      x.keep(kept, hc, d);
    }
    if (x.rows == 0) break;  // every call lies before its tail: late layers have nothing to do
    for (size_t k = 0; k < calls.size(); ++k) {
      const int64_t tail_start = calls[k].options.tail_start;
      if (layer >= late && tail_start >= 0 && runs[k].rows() > 0) {
        int64_t& from = parts_of(*calls[k].state).window_from[layer];
        from = std::max(from, tail_start);
      }
    }
    if (r.engram) {
      // (Engram layers are never in the tail: late_layer_start is past the last one.)
      if (x.rows != static_cast<int64_t>(tokens.size())) fail("forward", "an Engram layer lies in the tail");
      size_t slot = 0;
      while (c.engram_layer_ids[slot] != layer) ++slot;
      const auto [codes, scales] = fetches.gather(slot);
      engram_forward(be, c, *L.engram, codes.data(), scales.data(), x.rows, x.span.empty() ? nullptr : x.span.data(),
                     x.X.data());
    }
    if (r.dspark_tap) {  // the block's input stream, averaged over copies in fp32, one bf16 rounding
      for (size_t k = 0; k < calls.size(); ++k) {
        if (!calls[k].options.dspark_taps) continue;
        const CallRows& run = runs[k];
        results[k].first_tap_row = run.kept_from;
        be.stream_mean(&x.X[run.row0 * width], run.rows(), hc, d,
                       &results[k].dspark_taps[(run.kept_from * n_taps + tap) * d], n_taps * d);
      }
      ++tap;
    }
    run_block(be, c, r, L, x, replay, [&](AttentionProjection& p, float* o) {
      for (size_t k = 0; k < calls.size(); ++k) {
        CallRows& run = runs[k];
        if (run.rows() == 0) continue;
        attention_core(be, c, r, L.attn, rope(layer), sequence_rows(c, p, run.row0), run.ctx, *calls[k].state,
                       o + run.row0 * HD);
      }
    }, expert_cache_.get(), expert_peers_.get());
    for (size_t k = 0; k < calls.size(); ++k) {
      CallRows& run = runs[k];
      if (calls[k].options.capture_blocks) {
        std::copy_n(&x.X[run.row0 * width], run.rows() * width, &run.view[run.kept_from * width]);
        std::copy(run.view.begin(), run.view.end(), results[k].block_outputs.begin() + layer * run.count * width);
      }
      const TeacherForcing* teacher = calls[k].options.teacher.get();
      if (teacher != nullptr && !teacher->streams.empty())
        std::copy_n(teacher->streams.begin() + layer * run.count * width, run.count * width, &x.X[run.row0 * width]);
    }
  }
  for (size_t k = 0; k < calls.size(); ++k) parts_of(*calls[k].state).length += runs[k].count;

  // head: collapse with the last FFN's pre, final norm, fp32 projection, over the rows of every call
  // that reaches it
  std::vector<int64_t> head_rows;
  for (size_t k = 0; k < calls.size(); ++k) {
    const CallRows& run = runs[k];
    ForwardResult& res = results[k];
    res.index = std::move(runs[k].ctx.index_captures);
    res.compressor_kv = std::move(runs[k].ctx.compressor_kv);
    res.compressor_score = std::move(runs[k].ctx.compressor_score);
    if (run.late_first == run.count && late < c.n_layers) continue;  // no row reached the head
    const int64_t first_row = calls[k].options.all_logits ? run.late_first : run.count - 1;
    res.rows = run.count - first_row;
    for (int64_t i = first_row; i < run.count; ++i) head_rows.push_back(run.row0 + i - run.kept_from);
  }
  if (head_rows.empty()) return results;
  x.keep(head_rows, hc, d);
  std::vector<float> logits(static_cast<size_t>(x.rows * V));
  run_head(be, c, x, 0, x.rows, weights_->norm, weights_->head, logits.data());
  int64_t row = 0;
  for (ForwardResult& res : results) {
    res.logits.assign(logits.begin() + row * V, logits.begin() + (row + res.rows) * V);
    row += res.rows;
  }
  return results;
}

std::vector<int64_t> Model::engram_history(const std::vector<int32_t>& tokens) const {
  if (config().engram_layer_ids.empty()) return {};
  const size_t keep = static_cast<size_t>(config().engram_max_ngram_size - 1);
  const size_t from = tokens.size() > keep ? tokens.size() - keep : 0;
  std::vector<int32_t> recent(tokens.begin() + static_cast<long>(from), tokens.end());
  std::vector<bool> dead(recent.size());
  for (size_t i = 0; i < recent.size(); ++i) {
    dead[i] = recent[i] < 0;
    if (dead[i]) recent[i] = 0;
  }
  std::vector<int64_t> out = hasher_.compress(recent);
  for (size_t i = 0; i < out.size(); ++i) {
    if (dead[i]) out[i] = kEngramDead;
  }
  return out;
}

MemoryPlan plan_model_memory(const ModelConfig& config, const Backend& backend, const ModelOptions& options) {
  MemoryPlanRequest r;
  // A budget above the cgroup's limit is refused here, before the load: the kernel would kill the
  // process at the limit, with nothing logged.
  r.ram_bytes = read_host_memory().ram_budget(options.ram_bytes);
  r.tile_rows = backend.weight_tile_rows();
  r.kv_bytes = options.kv_bytes;
  r.prompt_cache_bytes = options.prompt_cache_bytes;
  r.prefill_chunk = options.prefill_chunk;
  r.threads = backend.threads();
  r.engram = options.engram;
  return plan_memory(config, r);
}

std::unique_ptr<Model> load_model(const std::string& dir, const ModelOptions& options, MemoryPlan* plan_out) {
  std::shared_ptr<const Backend> backend = options.backend ? options.backend : make_backend();
  ModelConfig config = load_config(dir);
  MemoryPlan plan = plan_model_memory(config, *backend, options);
  require_plan_fits(plan, dir);
  // The tokenizer before the weights: a wrong one is refused before a long load.
  const std::string tok_path = dir + "/tokenizer.json";
  nlohmann::json tok;
  try {
    tok = nlohmann::json::parse(read_regular_file(tok_path));
  } catch (const nlohmann::json::exception& e) {
    fail(tok_path, std::string("is not valid JSON: ") + e.what());
  }
  EngramTokenMap map = build_engram_token_map(tok, config.vocab_size);
  tok = nlohmann::json();
  check_engram_token_map(config, map);
  WeightPlacement placement;
  placement.pack_dense = plan.pack_dense;
  placement.pack_experts = plan.pack_experts;
  if (options.expert_peers) placement.share = options.expert_peers->share();
  auto weights = std::make_shared<const ModelWeights>(dir, config, backend, options.engram, placement);
  // Streamed experts go through the expert cache; a backend that packs nothing reads them through the
  // mapping instead (the plan's page-cache placement).
  const uint64_t cache = plan.pack_experts || backend->weight_tile_rows() == 0 ? 0 : plan.expert_cache_bytes;
  if (plan_out != nullptr) *plan_out = std::move(plan);
  return std::make_unique<Model>(std::move(backend), std::move(weights), std::move(map), cache, options.expert_peers);
}

}  // namespace dsv41
