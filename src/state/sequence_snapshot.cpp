#include "state/sequence_snapshot.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "state/sequence_access.h"
#include "util/error.h"

namespace dsv41 {

ShortState ShortState::of(const SequenceState& seq) {
  const SequenceParts& st = parts_of(seq);
  ShortState s;
  s.window = st.window;
  s.window_from = st.window_from;
  s.tail_kv.resize(st.sources.size());
  s.tail_score.resize(st.sources.size());
  for (size_t l = 0; l < st.sources.size(); ++l) {
    if (!st.sources[l]) continue;
    s.tail_kv[l] = st.sources[l]->tail_kv;
    s.tail_score[l] = st.sources[l]->tail_score;
  }
  s.engram_recent = st.engram_recent;
  s.last_index_keys_layer = st.last_index_keys_layer;
  return s;
}

void ShortState::apply_to(SequenceState& seq) const {
  SequenceParts& st = parts_of(seq);
  if (window.size() != st.window.size() || window_from.size() != st.window_from.size() ||
      tail_kv.size() != st.sources.size() || tail_score.size() != st.sources.size()) {
    fail("sequence state", "the snapshot is of a model with other layers");
  }
  st.window = window;
  st.window_from = window_from;
  for (size_t l = 0; l < st.sources.size(); ++l) {
    if (!st.sources[l]) continue;
    st.sources[l]->tail_kv = tail_kv[l];
    st.sources[l]->tail_score = tail_score[l];
  }
  st.engram_recent = engram_recent;
  st.last_index_keys_layer = last_index_keys_layer;
}

size_t ShortState::bytes() const {
  size_t n = window_from.size() * 8 + engram_recent.size() * 8;
  for (const auto& w : window) n += w.size();
  for (const auto& t : tail_kv) n += t.size() * 4;
  for (const auto& t : tail_score) n += t.size() * 4;
  return n;
}

GlobalRowBytes global_row_bytes(const SequenceState& seq) {
  const SequenceParts& st = parts_of(seq);
  GlobalRowBytes b;
  for (const auto& src : st.sources) {
    if (!src) continue;
    b.main_kv += static_cast<uint64_t>(src->compressed.size()) * src->compressed.row_bytes();
    b.index_keys += static_cast<uint64_t>(src->index_keys.size()) * src->index_keys.row_bytes();
  }
  return b;
}

void adopt_global_rows(SequenceState& seq, int layer, std::vector<int32_t> main_pages, std::vector<int32_t> key_pages,
                       int64_t rows) {
  SequenceParts& st = parts_of(seq);
  KvSourceState& src = *st.sources.at(static_cast<size_t>(layer));
  src.compressed = PagedRows::adopt(src.compressed.pool(), src.compressed.row_bytes(), std::move(main_pages), rows);
  src.index_keys = PagedRows::adopt(src.index_keys.pool(), src.index_keys.row_bytes(), std::move(key_pages), rows);
}

bool load_global_rows(SequenceState& seq, int layer, const std::vector<uint8_t>& main, const std::vector<uint8_t>& keys,
                      int64_t rows) {
  SequenceParts& st = parts_of(seq);
  KvSourceState& src = *st.sources.at(static_cast<size_t>(layer));
  const auto fits = [rows](const std::vector<uint8_t>& bytes, const PagedRows& to) {
    return bytes.size() % to.row_bytes() == 0 && static_cast<int64_t>(bytes.size() / to.row_bytes()) >= rows;
  };
  if (!fits(main, src.compressed) || !fits(keys, src.index_keys)) return false;
  for (auto [bytes, to] : {std::pair{&main, &src.compressed}, std::pair{&keys, &src.index_keys}}) {
    const size_t rb = to->row_bytes();
    for (int64_t i = 0; i < rows; ++i) std::memcpy(to->append(), bytes->data() + static_cast<size_t>(i) * rb, rb);
  }
  return true;
}

void set_restored_length(SequenceState& seq, int64_t tokens) { parts_of(seq).length = tokens; }

void rewind_for_replay(SequenceState& seq, int64_t start, std::vector<int64_t> engram_recent, int last_index_keys_layer) {
  SequenceParts& st = parts_of(seq);
  st.length = start;
  std::fill(st.window_from.begin(), st.window_from.end(), start);
  st.engram_recent = std::move(engram_recent);
  st.last_index_keys_layer = last_index_keys_layer;
}

VerifyCheckpoint::VerifyCheckpoint(const ModelConfig& c, const SequenceState& seq, int64_t positions)
    : config_(&c), first_(seq.length()), positions_(positions) {
  const SequenceParts& st = parts_of(seq);
  if (positions < 1 || positions > c.window_size) fail("speculative", "a verify step must fit in the window ring");
  const int64_t W = c.window_size;
  slots_.resize(st.window.size());
  for (size_t l = 0; l < st.window.size(); ++l) {
    const std::vector<uint8_t>& ring = st.window[l];
    if (ring.empty()) continue;
    const size_t row = ring.size() / static_cast<size_t>(W);
    for (int64_t pos = first_; pos < first_ + positions; ++pos) {
      const uint8_t* slot = &ring[static_cast<size_t>(pos % W) * row];
      slots_[l].insert(slots_[l].end(), slot, slot + row);
    }
  }
  tail_kv_.resize(st.sources.size());
  tail_score_.resize(st.sources.size());
  for (size_t l = 0; l < st.sources.size(); ++l) {
    if (!st.sources[l]) continue;
    tail_kv_[l] = st.sources[l]->tail_kv;
    tail_score_[l] = st.sources[l]->tail_score;
  }
  last_index_keys_layer_ = st.last_index_keys_layer;
}

void VerifyCheckpoint::roll_back(SequenceState& seq, int64_t kept, const std::vector<std::vector<float>>& compressor_kv,
                                 const std::vector<std::vector<float>>& compressor_score,
                                 std::vector<int64_t> engram_recent) const {
  SequenceParts& st = parts_of(seq);
  if (config_ == nullptr) fail("speculative", "no checkpoint was taken");
  const ModelConfig& c = *config_;
  const int64_t end = first_ + positions_, W = c.window_size, D = c.head_dim;
  if (st.length != end) fail("speculative", "the verify forward did not run every checkpointed position");
  if (kept < first_ || kept > end) fail("speculative", "kept positions outside the verified ones");
  // window slots of the rejected positions
  for (size_t l = 0; l < st.window.size(); ++l) {
    if (slots_[l].empty()) continue;
    const size_t row = st.window[l].size() / static_cast<size_t>(W);
    for (int64_t pos = kept; pos < end; ++pos) {
      std::memcpy(&st.window[l][static_cast<size_t>(pos % W) * row], &slots_[l][static_cast<size_t>(pos - first_) * row], row);
    }
  }
  // compressed rows and keys past the kept positions, the compressor tails, the last key publisher
  int keys_layer = last_index_keys_layer_;
  for (size_t l = 0; l < st.sources.size(); ++l) {
    KvSourceState* src = st.sources[l].get();
    if (!src) continue;
    const int64_t ratio = c.compress_ratios[l];
    src->compressed.truncate(kept / ratio);
    src->index_keys.truncate(kept / ratio);
    if (kept / ratio > first_ / ratio) keys_layer = static_cast<int>(l);  // emitted a row within the kept part
    const bool recorded = l < compressor_kv.size() && !compressor_kv[l].empty();
    if (ratio > 1 && recorded) {
      if (static_cast<int64_t>(compressor_kv[l].size()) < positions_ * D ||
          static_cast<int64_t>(compressor_score[l].size()) < positions_ * D) {
        fail("speculative", "the verify forward recorded too few compressor rows");
      }
      src->tail_kv = tail_kv_[l];
      src->tail_score = tail_score_[l];
      if (src->tail_kv.empty()) {
        src->tail_kv.assign(static_cast<size_t>(ratio * D), 0.0f);
        src->tail_score.assign(static_cast<size_t>(ratio * D), -INFINITY);
      }
      for (int64_t pos = first_; pos < kept; ++pos) {
        std::copy_n(&compressor_kv[l][(pos - first_) * D], D, &src->tail_kv[(pos % ratio) * D]);
        std::copy_n(&compressor_score[l][(pos - first_) * D], D, &src->tail_score[(pos % ratio) * D]);
      }
    }
  }
  st.last_index_keys_layer = keys_layer;
  st.engram_recent = std::move(engram_recent);
  st.length = kept;
}

}  // namespace dsv41
