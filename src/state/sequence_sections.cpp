#include "state/sequence_sections.h"

#include <cstring>

#include "numeric/row_codecs.h"
#include "state/sequence_access.h"

namespace dsv41 {

namespace {

template <typename T>
std::vector<uint8_t> to_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <typename T>
bool from_bytes(const std::vector<uint8_t>& b, std::vector<T>& v) {
  if (b.size() % sizeof(T) != 0) return false;
  v.resize(b.size() / sizeof(T));
  if (!b.empty()) std::memcpy(v.data(), b.data(), b.size());
  return true;
}

std::vector<uint8_t> rows_bytes(const PagedRows& rows) {
  std::vector<uint8_t> b;
  b.reserve(static_cast<size_t>(rows.size()) * rows.row_bytes());
  for (int64_t i = 0; i < rows.size(); ++i) b.insert(b.end(), rows.row(i), rows.row(i) + rows.row_bytes());
  return b;
}

}  // namespace

std::vector<CacheSection> global_row_sections(const SequenceState& seq) {
  const SequenceParts& st = parts_of(seq);
  std::vector<CacheSection> out;
  for (size_t l = 0; l < st.sources.size(); ++l) {
    const KvSourceState* src = st.sources[l].get();
    if (!src) continue;
    const int32_t layer = static_cast<int32_t>(l);
    out.push_back({"main_kv", layer, src->compressed.size(), rows_bytes(src->compressed)});
    out.push_back({"index_keys", layer, src->index_keys.size(), rows_bytes(src->index_keys)});
  }
  return out;
}

std::vector<CacheSection> short_state_sections(const SequenceState& seq) {
  const SequenceParts& st = parts_of(seq);
  std::vector<CacheSection> out;
  for (size_t l = 0; l < st.window.size(); ++l) {
    if (!st.window[l].empty()) out.push_back({"window", static_cast<int32_t>(l), 0, st.window[l]});
  }
  for (size_t l = 0; l < st.sources.size(); ++l) {
    const KvSourceState* src = st.sources[l].get();
    if (!src || src->tail_kv.empty()) continue;
    out.push_back({"tail_kv", static_cast<int32_t>(l), 0, to_bytes(src->tail_kv)});
    out.push_back({"tail_score", static_cast<int32_t>(l), 0, to_bytes(src->tail_score)});
  }
  out.push_back({"window_from", -1, 0, to_bytes(st.window_from)});
  out.push_back({"engram_recent", -1, 0, to_bytes(st.engram_recent)});
  out.push_back({"last_index_keys_layer", -1, 0, to_bytes(std::vector<int32_t>{st.last_index_keys_layer})});
  return out;
}

const CacheSection* find_section(const std::vector<CacheSection>& sections, const std::string& name, int layer) {
  for (const CacheSection& s : sections) {
    if (s.name == name && s.layer == layer) return &s;
  }
  return nullptr;
}

bool load_global_row_sections(SequenceState& seq, const ModelConfig& c, const std::vector<CacheSection>& sections,
                              int64_t tokens) {
  SequenceParts& st = parts_of(seq);
  for (size_t l = 0; l < st.sources.size(); ++l) {
    if (!st.sources[l]) continue;
    const int layer = static_cast<int>(l);
    const CacheSection* main = find_section(sections, "main_kv", layer);
    const CacheSection* keys = find_section(sections, "index_keys", layer);
    if (!main || !keys || !load_global_rows(seq, layer, main->bytes, keys->bytes, tokens / c.compress_ratios[l])) return false;
  }
  return true;
}

std::optional<ShortState> short_state_of_sections(const std::vector<CacheSection>& sections, const ModelConfig& c,
                                                  const SequenceState& seq) {
  const SequenceParts& st = parts_of(seq);
  ShortState s;
  const size_t layers = st.window.size();
  s.window.resize(layers);
  s.tail_kv.resize(st.sources.size());
  s.tail_score.resize(st.sources.size());
  bool ok = true;
  for (size_t l = 0; l < layers; ++l) {
    if (const CacheSection* w = find_section(sections, "window", static_cast<int>(l))) s.window[l] = w->bytes;
  }
  for (size_t l = 0; l < st.sources.size(); ++l) {
    if (!st.sources[l]) continue;
    if (const CacheSection* t = find_section(sections, "tail_kv", static_cast<int>(l))) ok = ok && from_bytes(t->bytes, s.tail_kv[l]);
    if (const CacheSection* t = find_section(sections, "tail_score", static_cast<int>(l))) ok = ok && from_bytes(t->bytes, s.tail_score[l]);
  }
  const CacheSection* from = find_section(sections, "window_from", -1);
  const CacheSection* recent = find_section(sections, "engram_recent", -1);
  const CacheSection* keys = find_section(sections, "last_index_keys_layer", -1);
  ok = ok && from && from_bytes(from->bytes, s.window_from) && s.window_from.size() == layers && recent &&
       from_bytes(recent->bytes, s.engram_recent) && keys && keys->bytes.size() == 4;
  const int64_t ring = c.window_size * window_row_bytes(c.head_dim);
  for (const auto& w : s.window) ok = ok && (w.empty() || static_cast<int64_t>(w.size()) == ring);
  if (!ok) return std::nullopt;
  std::memcpy(&s.last_index_keys_layer, keys->bytes.data(), 4);
  return s;
}

}  // namespace dsv41
