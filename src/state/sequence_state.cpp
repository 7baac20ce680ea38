#include "state/sequence_state.h"

#include <cstring>

#include "state/sequence_access.h"
#include "util/error.h"

namespace dsv41 {

GlobalPages SequenceState::global_pages(int layer, int64_t block) const {
  const auto& sources = parts_.sources;
  if (layer < 0 || static_cast<size_t>(layer) >= sources.size() || !sources[static_cast<size_t>(layer)]) {
    fail("sequence state", "layer " + std::to_string(layer) + " is not a KV source");
  }
  const KvSourceState& src = *sources[static_cast<size_t>(layer)];
  const auto& main = src.compressed.pages();
  const auto& keys = src.index_keys.pages();
  if (block < 0 || static_cast<size_t>(block) >= main.size() || static_cast<size_t>(block) >= keys.size()) {
    fail("sequence state", "layer " + std::to_string(layer) + " holds no block " + std::to_string(block));
  }
  return {main[static_cast<size_t>(block)], keys[static_cast<size_t>(block)]};
}

namespace {

std::string rows_difference(const PagedRows& a, const PagedRows& b) {
  if (a.size() != b.size()) return std::to_string(a.size()) + " rows against " + std::to_string(b.size());
  if (a.row_bytes() != b.row_bytes()) return "rows of other sizes";
  for (int64_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(a.row(i), b.row(i), a.row_bytes()) != 0) return "row " + std::to_string(i);
  }
  return "";
}

}  // namespace

std::string first_difference(const SequenceState& x, const SequenceState& y, StateScope scope) {
  const SequenceParts &a = SequenceAccess::parts(x), &b = SequenceAccess::parts(y);
  if (a.window.size() != b.window.size() || a.sources.size() != b.sources.size()) return "the number of layers";
  const bool all = scope == StateScope::All;
  if (all && a.length != b.length) return "length " + std::to_string(a.length) + " against " + std::to_string(b.length);
  for (size_t l = 0; all && l < a.window.size(); ++l) {
    if (a.window[l] != b.window[l]) return "layer " + std::to_string(l) + "'s window ring";
  }
  if (all && a.window_from != b.window_from) return "where the windows start";
  if (all && a.engram_recent != b.engram_recent) return "the Engram history";
  if (all && a.last_index_keys_layer != b.last_index_keys_layer) return "the last index-key publisher";
  if (all && a.dspark_observed != b.dspark_observed) return "the drafter's observed length";
  for (size_t l = 0; l < a.sources.size(); ++l) {
    if (!a.sources[l] != !b.sources[l]) return "which layers are KV sources";
    if (!a.sources[l]) continue;
    const KvSourceState &p = *a.sources[l], &q = *b.sources[l];
    const std::string layer = "layer " + std::to_string(l) + "'s ";
    if (std::string d = rows_difference(p.compressed, q.compressed); !d.empty()) return layer + "main KV: " + d;
    if (std::string d = rows_difference(p.index_keys, q.index_keys); !d.empty()) return layer + "index keys: " + d;
    if (all && (p.tail_kv != q.tail_kv || p.tail_score != q.tail_score)) return layer + "compressor tail";
  }
  return "";
}

}  // namespace dsv41
