#include "state/state_graph.h"

#include <algorithm>
#include <set>

#include "numeric/row_codecs.h"

namespace dsv41 {

const char* lifetime_name(Lifetime lifetime) {
  switch (lifetime) {
    case Lifetime::Global: return "global";
    case Lifetime::Window: return "window";
    case Lifetime::Step: return "step";
    case Lifetime::Tokens: return "tokens";
  }
  return "?";
}

std::vector<int> StateClass::owner_layers() const {
  std::vector<int> out;
  for (const StateOwner& o : owners) if (o.layer >= 0) out.push_back(o.layer);
  return out;
}

std::vector<int> StateClass::consumer_layers() const {
  std::set<int> all;
  for (const StateOwner& o : owners) all.insert(o.consumers.begin(), o.consumers.end());
  return {all.begin(), all.end()};
}

double StateClass::bytes_per_token() const {
  double sum = 0;
  for (const StateOwner& o : owners) sum += o.bytes_per_token;
  return sum;
}

int64_t StateClass::bytes_per_sequence() const {
  int64_t sum = 0;
  for (const StateOwner& o : owners) sum += o.bytes_per_sequence;
  return sum;
}

double StateGraph::global_bytes_per_token() const {
  double sum = 0;
  for (const StateClass& c : classes) if (c.lifetime == Lifetime::Global) sum += c.bytes_per_token();
  return sum;
}

int64_t StateGraph::fixed_bytes_per_sequence() const {
  int64_t sum = 0;
  for (const StateClass& c : classes) if (c.lifetime != Lifetime::Step) sum += c.bytes_per_sequence();
  return sum;
}

const StateClass* StateGraph::find(const std::string& name) const {
  for (const StateClass& c : classes) if (c.name == name) return &c;
  return nullptr;
}

StateGraph build_state_graph(const ModelConfig& c, const std::vector<LayerRole>& roles) {
  auto consumers_of = [&](auto pred) {
    std::vector<int> v;
    for (const LayerRole& r : roles) if (pred(r)) v.push_back(r.layer);
    return v;
  };
  StateGraph g;

  StateClass main_kv{"main_kv", "e2m1 + e4m3 scale per 16", Lifetime::Global, true, {}};
  StateClass index_keys{"index_keys", "e2m1 + e8m0 scale per 32", Lifetime::Global, true, {}};
  StateClass tails{"compressor_tail", "fp32 kv + score, ratio rows", Lifetime::Window, false, {}};
  for (const LayerRole& r : roles) {
    if (!r.kv_source) continue;
    const int l = r.layer;
    StateOwner kv{l, r.compress_ratio, consumers_of([&](const LayerRole& x) { return x.kv_from == l; }),
                  main_kv_bytes(c.head_dim), 0, 0};
    kv.bytes_per_token = static_cast<double>(kv.row_bytes) / r.compress_ratio;
    main_kv.owners.push_back(kv);
    StateOwner keys{l, r.compress_ratio,
                    consumers_of([&](const LayerRole& x) { return x.index_keys_from == l; }),
                    index_key_bytes(c.index_head_dim), 0, 0};
    keys.bytes_per_token = static_cast<double>(keys.row_bytes) / r.compress_ratio;
    index_keys.owners.push_back(keys);
    if (r.compress_ratio > 1) {
      // a group still filling up: r pending rows of projected kv and gate scores, in fp32
      tails.owners.push_back({l, r.compress_ratio, {l}, 0, 0, int64_t{r.compress_ratio} * c.head_dim * 4 * 2});
    }
  }
  g.classes.push_back(main_kv);
  g.classes.push_back(index_keys);

  StateClass window{"window", "fp8 e4m3 + e8m0 scale per 32", Lifetime::Window, false, {}};
  StateClass dspark_window{"dspark_window", "fp8 e4m3 + e8m0 scale per 32", Lifetime::Window, false, {}};
  for (const LayerRole& r : roles) {
    if (r.dspark && !c.has_dspark()) continue;
    StateOwner o{r.layer, 0, {r.layer}, window_row_bytes(c.head_dim), 0, c.window_size * window_row_bytes(c.head_dim)};
    (r.dspark ? dspark_window : window).owners.push_back(o);
  }
  g.classes.push_back(window);
  if (!tails.owners.empty()) g.classes.push_back(tails);
  if (!dspark_window.owners.empty()) g.classes.push_back(dspark_window);

  StateClass topk{"topk", "int32 row ids", Lifetime::Step, false, {}};
  for (const LayerRole& r : roles) {
    if (!r.index_source) continue;
    const int l = r.layer;
    topk.owners.push_back({l, r.compress_ratio, consumers_of([&](const LayerRole& x) { return x.topk_from == l; }),
                           int64_t{c.index_topk} * 4, 0, 0});
  }
  if (!topk.owners.empty()) g.classes.push_back(topk);
  if (c.candidate_source_layer >= 0) {
    const int l = c.candidate_source_layer;
    StateClass cand{"candidates", "int32 block ids", Lifetime::Step,
                    false, {}};
    cand.owners.push_back({l, c.compress_ratios[l],
                           consumers_of([&](const LayerRole& x) { return x.candidates_from == l; }),
                           int64_t{c.candidate_topk_blocks} * 4, 0, 0});
    g.classes.push_back(cand);
  }
  if (!c.engram_layer_ids.empty()) {
    // the last max_ngram-1 compressed token ids: the n-gram context of the next position
    StateClass hist{"engram_history", "int64 compressed ids", Lifetime::Tokens, false, {}};
    hist.owners.push_back({-1, 0, c.engram_layer_ids, 8, 0, int64_t{c.engram_max_ngram_size - 1} * 8});
    g.classes.push_back(hist);
  }
  return g;
}

}  // namespace dsv41
