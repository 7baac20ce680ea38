#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "model/attention.h"
#include "model/mhc.h"
#include "model/moe.h"
#include "numeric/formats.h"
#include "numeric/row_codecs.h"
#include "util/error.h"

namespace dsv41 {

namespace {

void norm_rows(const float* x, int64_t count, int64_t d, const Bf16Tensor& w, double eps, float* y) {
  for (int64_t i = 0; i < count; ++i) rms_norm(x + i * d, d, w.bits.data(), static_cast<float>(eps), y + i * d, true);
}

}  // namespace

Model::Model(std::shared_ptr<const ModelWeights> weights, EngramTokenMap token_map)
    : weights_(std::move(weights)),
      roles_(derive_layer_roles(weights_->config())),
      hasher_(weights_->config(), std::move(token_map)),
      rope_window_(config().rope_head_dim, 0, config().rope_theta, config().rope_factor, config().beta_fast,
                   config().beta_slow),
      rope_compressed_(config().rope_head_dim, config().original_seq_len, config().compress_rope_theta,
                       config().rope_factor, config().beta_fast, config().beta_slow) {}

SequenceState Model::new_sequence(StatePools& pools) const {
  SequenceState s;
  s.window.resize(roles_.size());
  s.window_from.assign(roles_.size(), 0);
  s.sources.resize(roles_.size());
  for (const LayerRole& r : roles_) {
    if (!r.kv_source) continue;
    s.sources[r.layer] = std::make_unique<KvSourceState>(pools.main_kv(r.layer), pools.index_keys(r.layer),
                                                         main_kv_bytes(config().head_dim),
                                                         index_key_bytes(config().index_head_dim));
  }
  return s;
}

void Model::block(int layer, ForwardContext& ctx, SequenceState& st, float* X, std::vector<float>& pre,
                  int64_t first, int64_t count) const {
  const ModelConfig& c = config();
  const LayerWeights& L = weights_->layers[layer];
  const LayerRole& r = roles_[layer];
  const int64_t hc = c.hc_mult, d = c.dim;
  float* x = X + first * hc * d;
  const float* pre_in = &pre[first * hc];

  // attention sublayer: post/comb from this stream, collapse with the previous sublayer's pre
  Mixes a = hc_mixes(c, x, count, L.hc_attn_fn, L.hc_attn_scale, L.hc_attn_base);
  std::vector<float> u(static_cast<size_t>(count * d)), y(static_cast<size_t>(count * d));
  hc_pre(c, x, pre_in, count, u.data());
  norm_rows(u.data(), count, d, L.attn_norm, c.norm_eps, u.data());
  const RopeTable& rope = r.compress_ratio > 0 ? rope_compressed_ : rope_window_;
  attention_forward(c, r, L.attn, rope, u.data(), ctx, st, y.data());

  // FFN sublayer, one pass: expand the attention's output into the stream (a's post/comb), the FFN's
  // mixes from the new stream, its input collapsed with the attention's pre; its own pre goes to the
  // next block
  Mixes f = hc_step(c, x, y.data(), a, L.hc_ffn_fn, L.hc_ffn_scale, L.hc_ffn_base, count, u.data());
  norm_rows(u.data(), count, d, L.ffn_norm, c.norm_eps, u.data());
  moe_forward(c, layer, L.ffn, u.data(), count, y.data());
  hc_post(c, x, y.data(), f, count);
  std::copy(f.pre.begin(), f.pre.end(), pre.begin() + first * hc);
}

ForwardResult Model::forward(SequenceState& st, const std::vector<int32_t>& tokens, const ForwardOptions& opt) const {
  const ModelConfig& c = config();
  const int64_t s = static_cast<int64_t>(tokens.size()), hc = c.hc_mult, d = c.dim, V = c.vocab_size;
  if (s == 0) fail("forward", "no tokens");
  if (st.length + s > c.max_seq_len) {
    fail("forward", "context of " + std::to_string(st.length + s) + " tokens exceeds the model's " +
                        std::to_string(c.max_seq_len));
  }
  for (int32_t t : tokens) {
    if (t < 0 || t >= V) fail("tokens", "id " + std::to_string(t) + " is outside the vocabulary of " + std::to_string(V));
  }
  ForwardContext ctx;
  ctx.start = st.length;
  ctx.count = s;
  ctx.index_keys = opt.index_keys;
  ctx.replay = opt.replay;
  ctx.record_compressor_rows = opt.record_compressor_rows;
  if (opt.record_compressor_rows) {
    ctx.compressor_kv.resize(roles_.size());
    ctx.compressor_score.resize(roles_.size());
  }
  ctx.topk.resize(roles_.size());
  ctx.topk_written.assign(roles_.size(), false);
  ctx.capture_index = opt.capture_index;
  if (opt.capture_index) ctx.index_captures.resize(roles_.size());

  ForwardResult res;
  // Engram row ids depend only on token ids, so they are computed up front and their rows fetched
  // (asynchronously, with the pread tier) while the layers before each Engram layer run.
  std::vector<std::vector<int64_t>> engram_ids;
  std::vector<EngramStore::Ticket> engram_tickets;
  if (!c.engram_layer_ids.empty()) {
    std::vector<int64_t> compressed = hasher_.compress(tokens);
    for (size_t slot = 0; slot < c.engram_layer_ids.size(); ++slot) {
      engram_ids.push_back(hasher_.row_ids(static_cast<int>(slot), st.engram_recent, compressed));
    }
    // (Engram layers are never in the tail: late_layer_start is past the last one.)
    for (size_t slot = 0; slot < c.engram_layer_ids.size(); ++slot) {
      engram_tickets.push_back(weights_->layers[c.engram_layer_ids[slot]].engram->table->prefetch(engram_ids[slot]));
    }
    st.engram_recent.insert(st.engram_recent.end(), compressed.begin(), compressed.end());
    const size_t keep = static_cast<size_t>(c.engram_max_ngram_size - 1);
    if (st.engram_recent.size() > keep) st.engram_recent.erase(st.engram_recent.begin(), st.engram_recent.end() - keep);
  }

  // A fetch started above must be collected even if this call fails on the way.
  std::vector<bool> gathered(engram_tickets.size(), false);
  struct CollectFetches {
    std::function<void()> run;
    ~CollectFetches() { run(); }
  } collect{[&] {
    for (size_t slot = 0; slot < engram_tickets.size(); ++slot) {
      if (gathered[slot]) continue;
      EngramStore& t = *weights_->layers[c.engram_layer_ids[slot]].engram->table;
      std::vector<uint8_t> codes(engram_ids[slot].size() * static_cast<size_t>(t.row_bytes()));
      std::vector<uint8_t> scales(engram_ids[slot].size() * static_cast<size_t>(t.scale_bytes()));
      try {
        t.gather(engram_tickets[slot], codes.data(), scales.data());
      } catch (const Error&) {
        // the call is already failing; the fetch only had to be collected
      }
    }
  }};

  // embedding, repeated into hc copies; the first pre is the identity collapse
  std::vector<float> X(static_cast<size_t>(s * hc * d));
  for (int64_t i = 0; i < s; ++i) {
    const uint16_t* e = &weights_->embed.bits[static_cast<size_t>(tokens[i]) * d];
    for (int64_t cp = 0; cp < hc; ++cp)
      for (int64_t j = 0; j < d; ++j) X[(i * hc + cp) * d + j] = bf16_to_f32(e[j]);
  }
  std::vector<float> pre(static_cast<size_t>(s * hc), 0.0f);
  for (int64_t i = 0; i < s; ++i) pre[i * hc] = 1.0f;

  const int late = late_layer_start(c);
  // tail mode: past the last KV source only rows from tail_start on matter for any future state
  const int64_t late_first = opt.tail_start < 0 ? 0 : std::clamp<int64_t>(opt.tail_start - ctx.start, 0, s);
  if (opt.capture_blocks) res.block_outputs.resize(static_cast<size_t>(c.n_layers * s * hc * d));
  int64_t taps = 0;
  for (int layer = 0; layer < c.n_layers; ++layer) {
    const LayerRole& r = roles_[layer];
    const int64_t first = layer >= late ? late_first : 0;
    if (first == s) break;  // the whole call lies before the tail: late layers have nothing to do
    if (layer >= late && opt.tail_start >= 0) st.window_from[layer] = std::max(st.window_from[layer], opt.tail_start);
    if (first > 0 && layer == late) {
      // From here on the call is its tail: what earlier layers published per query is trimmed to the
      // tail's queries.
      ctx.start += first;
      ctx.count -= first;
      for (auto& per_query : ctx.topk) {
        if (!per_query.empty()) per_query.erase(per_query.begin(), per_query.begin() + first);
      }
      if (!ctx.candidates.empty()) ctx.candidates.erase(ctx.candidates.begin(), ctx.candidates.begin() + first);
    }
    if (r.engram) {
      size_t slot = 0;
      while (c.engram_layer_ids[slot] != layer) ++slot;
      const EngramWeights& e = *weights_->layers[layer].engram;
      const size_t n = engram_ids[slot].size();
      std::vector<uint8_t> codes(n * static_cast<size_t>(e.table->row_bytes()));
      std::vector<uint8_t> scales(n * static_cast<size_t>(e.table->scale_bytes()));
      e.table->gather(engram_tickets[slot], codes.data(), scales.data());
      gathered[slot] = true;
      engram_forward(c, e, codes.data(), scales.data(), s - first, &X[first * hc * d]);
    }
    if (r.dspark_tap) {  // the block's input stream, averaged over copies in fp32, one bf16 rounding
      res.first_tap_row = first;
      const int64_t n_taps = static_cast<int64_t>(c.dspark_target_layer_ids.size());
      res.dspark_taps.resize(static_cast<size_t>(s * n_taps * d));
      for (int64_t i = first; i < s; ++i)
        for (int64_t j = 0; j < d; ++j) {
          float acc = 0;
          for (int64_t cp = 0; cp < hc; ++cp) acc += X[(i * hc + cp) * d + j];
          res.dspark_taps[(i * n_taps + taps) * d + j] = round_bf16(acc / static_cast<float>(hc));
        }
      ++taps;
    }
    block(layer, ctx, st, X.data(), pre, first, s - first);
    if (opt.capture_blocks) std::copy(X.begin(), X.end(), res.block_outputs.begin() + layer * s * hc * d);
  }
  st.length += s;

  // head: collapse with the last FFN's pre, final norm, fp32 projection
  res.index = std::move(ctx.index_captures);
  res.compressor_kv = std::move(ctx.compressor_kv);
  res.compressor_score = std::move(ctx.compressor_score);
  if (late_first == s && late < c.n_layers) return res;  // no row reached the head
  const int64_t first_row = opt.all_logits ? late_first : s - 1;
  res.rows = s - first_row;
  std::vector<float> y(static_cast<size_t>(res.rows * d));
  hc_pre(c, &X[first_row * hc * d], &pre[first_row * hc], res.rows, y.data());
  norm_rows(y.data(), res.rows, d, weights_->norm, c.norm_eps, y.data());
  res.logits.resize(static_cast<size_t>(res.rows * V));
  linear_f32(y.data(), res.rows, weights_->head.view(), res.logits.data());
  return res;
}

std::vector<std::vector<float>> Model::decode_batch(const std::vector<SequenceState*>& states,
                                                   const std::vector<int32_t>& tokens, IndexKeysMode index_keys) const {
  const ModelConfig& c = config();
  const int64_t n = static_cast<int64_t>(states.size()), hc = c.hc_mult, d = c.dim, V = c.vocab_size;
  if (static_cast<int64_t>(tokens.size()) != n || n == 0) fail("decode_batch", "needs one token per sequence");
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= V) fail("tokens", "id " + std::to_string(tokens[i]) + " is outside the vocabulary");
    if (states[i]->length + 1 > c.max_seq_len) fail("forward", "context exceeds the model's " + std::to_string(c.max_seq_len));
  }
  std::vector<ForwardContext> ctx(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    ctx[i].start = states[i]->length;
    ctx[i].count = 1;
    ctx[i].index_keys = index_keys;
    ctx[i].topk.resize(roles_.size());
    ctx[i].topk_written.assign(roles_.size(), false);
  }
  // Engram rows of every sequence's token, gathered as each Engram layer is reached
  std::vector<std::vector<std::vector<int64_t>>> ids(c.engram_layer_ids.size());
  for (int64_t i = 0; i < n; ++i) {
    if (c.engram_layer_ids.empty()) break;
    std::vector<int64_t> compressed = hasher_.compress({tokens[i]});
    for (size_t slot = 0; slot < c.engram_layer_ids.size(); ++slot) {
      ids[slot].push_back(hasher_.row_ids(static_cast<int>(slot), states[i]->engram_recent, compressed));
    }
    std::vector<int64_t>& recent = states[i]->engram_recent;
    recent.push_back(compressed[0]);
    const size_t keep = static_cast<size_t>(c.engram_max_ngram_size - 1);
    if (recent.size() > keep) recent.erase(recent.begin(), recent.end() - keep);
  }
  std::vector<float> X(static_cast<size_t>(n * hc * d)), pre(static_cast<size_t>(n * hc), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t* e = &weights_->embed.bits[static_cast<size_t>(tokens[i]) * d];
    for (int64_t cp = 0; cp < hc; ++cp)
      for (int64_t j = 0; j < d; ++j) X[(i * hc + cp) * d + j] = bf16_to_f32(e[j]);
    pre[i * hc] = 1.0f;
  }
  std::vector<float> u(static_cast<size_t>(n * d)), y(static_cast<size_t>(n * d));
  const int64_t HD = c.n_heads * c.head_dim;
  std::vector<float> o(static_cast<size_t>(n * HD));  // attention outputs before the O-LoRA
  for (int layer = 0; layer < c.n_layers; ++layer) {
    const LayerWeights& L = weights_->layers[layer];
    const LayerRole& r = roles_[layer];
    if (r.engram) {
      size_t slot = 0;
      while (c.engram_layer_ids[slot] != layer) ++slot;
      // every sequence's rows one after the other, so the Engram projection runs once over all
      EngramStore& table = *L.engram->table;
      const size_t per_token = ids[slot][0].size();
      std::vector<uint8_t> codes(static_cast<size_t>(n) * per_token * static_cast<size_t>(table.row_bytes()));
      std::vector<uint8_t> scales(static_cast<size_t>(n) * per_token * static_cast<size_t>(table.scale_bytes()));
      for (int64_t i = 0; i < n; ++i) {
        const size_t row0 = static_cast<size_t>(i) * per_token;
        table.gather(table.prefetch(ids[slot][i]), &codes[row0 * static_cast<size_t>(table.row_bytes())],
                     &scales[row0 * static_cast<size_t>(table.scale_bytes())]);
      }
      engram_forward(c, *L.engram, codes.data(), scales.data(), n, X.data());
    }
    Mixes a = hc_mixes(c, X.data(), n, L.hc_attn_fn, L.hc_attn_scale, L.hc_attn_base);
    hc_pre(c, X.data(), pre.data(), n, u.data());
    norm_rows(u.data(), n, d, L.attn_norm, c.norm_eps, u.data());
    // the projections once over every sequence's row; the state-dependent core per sequence
    AttentionProjection projected = project_attention(c, r, L.attn, u.data(), n, /*replay=*/false);
    for (int64_t i = 0; i < n; ++i) {
      attention_core(c, r, L.attn, rope(layer), sequence_rows(c, projected, i), ctx[i], *states[i], &o[i * HD]);
    }
    output_projection(c, L.attn, o.data(), n, y.data());
    // expand the attention's output, the FFN's mixes and its input: one pass over the stream
    Mixes f = hc_step(c, X.data(), y.data(), a, L.hc_ffn_fn, L.hc_ffn_scale, L.hc_ffn_base, n, u.data());
    norm_rows(u.data(), n, d, L.ffn_norm, c.norm_eps, u.data());
    moe_forward(c, layer, L.ffn, u.data(), n, y.data());  // all sequences' tokens through one MoE
    hc_post(c, X.data(), y.data(), f, n);
    pre = f.pre;
  }
  for (SequenceState* st : states) ++st->length;
  hc_pre(c, X.data(), pre.data(), n, u.data());
  norm_rows(u.data(), n, d, weights_->norm, c.norm_eps, u.data());
  std::vector<float> logits(static_cast<size_t>(n * V));
  linear_f32(u.data(), n, weights_->head.view(), logits.data());
  std::vector<std::vector<float>> out;
  for (int64_t i = 0; i < n; ++i) out.emplace_back(logits.begin() + i * V, logits.begin() + (i + 1) * V);
  return out;
}

std::vector<int64_t> Model::engram_history(const std::vector<int32_t>& tokens) const {
  if (config().engram_layer_ids.empty()) return {};
  const size_t keep = static_cast<size_t>(config().engram_max_ngram_size - 1);
  const size_t from = tokens.size() > keep ? tokens.size() - keep : 0;
  return hasher_.compress(std::vector<int32_t>(tokens.begin() + static_cast<long>(from), tokens.end()));
}

std::unique_ptr<Model> load_model(const std::string& dir, EngramTier engram_tier) {
  ModelConfig config = load_config(dir);
  auto weights = std::make_shared<const ModelWeights>(dir, config, engram_tier);
  const std::string tok_path = dir + "/tokenizer.json";
  std::ifstream in(tok_path, std::ios::binary);
  if (!in) fail(tok_path, "cannot be opened (the Engram token map is built from it)");
  nlohmann::json tok;
  try {
    tok = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail(tok_path, std::string("is not valid JSON: ") + e.what());
  }
  EngramTokenMap map = build_engram_token_map(tok, config.vocab_size);
  return std::make_unique<Model>(std::move(weights), std::move(map));
}

}  // namespace dsv41
