// A sequence's state as the sections of a prompt-cache entry (state/disk_cache.h) and back: the
// global rows of every KV source, and in exact mode the short-lived state (a ShortState). Reading a
// file never trusts it: a section that is missing or does not fit this model's shapes makes the
// restore fail, and the caller skips the file.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "io/config.h"
#include "state/disk_cache.h"
#include "state/sequence_snapshot.h"
#include "state/sequence_state.h"

namespace dsv41 {

// "main_kv" and "index_keys" of every KV source, all the rows the sequence holds.
std::vector<CacheSection> global_row_sections(const SequenceState& state);
// "window" per layer that has one, "tail_kv" / "tail_score" per source with a compressor tail,
// "window_from", "engram_recent", "last_index_keys_layer".
std::vector<CacheSection> short_state_sections(const SequenceState& state);

const CacheSection* find_section(const std::vector<CacheSection>& sections, const std::string& name, int layer);

// Reads the global rows of the first `tokens` positions into `state` (a fresh sequence): false when
// a KV source's sections are missing or hold fewer rows than that.
bool load_global_row_sections(SequenceState& state, const ModelConfig& config, const std::vector<CacheSection>& sections,
                              int64_t tokens);
// The short-lived state in `sections`, or nothing when it does not fit a sequence of `config`
// shaped like `state`.
std::optional<ShortState> short_state_of_sections(const std::vector<CacheSection>& sections, const ModelConfig& config,
                                                  const SequenceState& state);

}  // namespace dsv41
