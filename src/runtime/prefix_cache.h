// The prefix cache (model-spec §5): prompts that start like an earlier one reuse its state instead of
// being prefilled again. In RAM, a radix tree over 64-token blocks maps prompt prefixes to the pages
// of global rows they produced (shared, reference-counted, copy-on-write); on disk, finished prefixes
// are kept as verified files that a later process finds again (state/cache_folder.h: an index built at
// start, a byte budget, and disk problems that only ever cost a recompute, each logged once).
//
// Every method that finds or keeps a prefix takes the request's cache namespace (io/cache_namespace.h:
// "" or its cache salt's digest): a prefix is found only in its own namespace, in RAM, on disk and in
// a handover.
//
// Two restore modes:
//  - exact: the windows, compressor tails and the rest of the short-lived state at the block boundary
//    are kept too, so the restored state is bit-identical to having prefilled the prefix;
//  - replay (the V4.1 design): only the global rows are kept; on a hit the last `window` tokens before
//    the boundary are re-run through the model to rebuild the encoder windows (the global rows are
//    read, never rewritten) and the decoder windows are rebuilt from the prompt's tail, as in tail mode.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/model.h"
#include "runtime/cache_mode.h"
#include "runtime/kv_events.h"
#include "runtime/prompt_images.h"
#include "state/cache_folder.h"
#include "state/prefix_tree.h"
#include "state/sequence_snapshot.h"
#include "state/state_pools.h"

namespace dsv41 {

struct CacheHit {
  int64_t cached_tokens = 0;    // prompt tokens whose state came from the cache
  int64_t replayed_tokens = 0;  // tokens re-run to rebuild windows (replay mode)
  CacheSource source = CacheSource::None;
};

struct DiskTierOptions {
  uint64_t budget_bytes = kDefaultPromptCacheDiskBytes;  // the files' total; least recently used go first
  CacheFolder::Log log;  // files skipped, writes failing (each once); null: stderr
};

class PrefixCache {
 public:
  // ram_budget_bytes bounds the pages and snapshots the RAM tier keeps (LRU over leaf blocks);
  // disk_dir empty = no disk tier. With one, the folder is made if missing (Error when it cannot be)
  // and indexed here, once.
  PrefixCache(const Model& model, StatePools& pools, CacheMode mode, uint64_t ram_budget_bytes, std::string disk_dir,
              IndexKeysMode index_keys = IndexKeysMode::Owner, DiskTierOptions disk = {});
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  CacheMode mode() const { return mode_; }
  // The longest block boundary the cache may restore for a prompt of `n` tokens: at least one token
  // is always computed, so the first sampled token has fresh logits.
  static int64_t usable_boundary(int64_t n) { return ((n - 1) / kTokensPerPage) * kTokensPerPage; }
  // Where a prompt of `n` tokens should be stored: its usable boundary, except that an exact-mode
  // cache takes none inside the first window (-1). A prefill's lists there are as wide as its prompt
  // (ForwardOptions::prefill_length), so a snapshot made there belongs to its own prompt's length and
  // would not restore another prompt's bits; from the first full window on every prompt's agree.
  int64_t store_boundary(int64_t n) const;

  // Restores the longest usable cached prefix of `prompt` into `state` (a fresh sequence). In replay
  // mode this runs the bounded replay; `tail_start` is where the prompt's tail (the decoder's rows)
  // begins, -1 for the exact path. A prompt with images (runtime/prompt_images.h) is given as its key
  // tokens with `images`: no boundary falls inside a span, and a replay takes the spans' rows and
  // starts where no span is cut.
  CacheHit restore(const std::vector<int32_t>& prompt, SequenceState& state, int64_t tail_start,
                   const PromptImages* images = nullptr, const std::string& cache_namespace = {});

  // Exact mode: the deepest boundary of `prompt` (a usable one, outside its image spans and past the
  // first window) whose blocks the RAM tier holds without a snapshot there, where no snapshot
  // deeper in the match exists either; -1 when there is none (or in replay mode, which restores any
  // block). Another prompt stored these blocks and went on past them: a prefill that stores its
  // state here (store() of the prefix) lets every later prompt sharing them, such as agents' common
  // system prompt, restore them instead of computing them again.
  int64_t fork_boundary(const std::vector<int32_t>& prompt, const PromptImages* images = nullptr,
                        const std::string& cache_namespace = {}) const;

  // Prompt tokens restore() would take from RAM for `prompt` (0: none), without restoring them.
  int64_t ram_hit_tokens(const std::vector<int32_t>& prompt, const std::string& cache_namespace = {}) const;

  // Restores `entry`, the state after a block-aligned prefix of `prompt` that another server
  // prefilled (serve --role decode), into `state` (a fresh sequence): as a disk entry of the entry's
  // own mode, exact or replayed. Error naming what does not fit (not a prefix of the prompt, not on
  // a usable boundary, another namespace, rows or windows of another shape); `state` is then untouched.
  CacheHit restore_handed(const std::vector<int32_t>& prompt, const CacheEntry& entry, SequenceState& state,
                          int64_t tail_start, const std::string& cache_namespace = {});

  // Records the state after `tokens` (state.length == tokens.size(), a multiple of kTokensPerPage) in
  // RAM (in exact mode the snapshot there, also on a block another prompt stored) and, with a disk
  // tier, in a file. Returns the bytes written to disk: 0 without a disk tier and
  // when the write failed, which is counted and logged but never thrown (the request goes on uncached).
  uint64_t store(const std::vector<int32_t>& tokens, const SequenceState& state, const std::string& cache_namespace = {});

  // Every change to the RAM tier's blocks from here on, as KV events (runtime/kv_events.h), on the
  // calling thread: blocks stored, evicted, or all cleared. Null: none.
  void on_events(std::function<void(KvCacheEvent)> listener) { events_ = std::move(listener); }
  // The RAM tier's blocks by their event hashes, for a check against what the events said.
  std::vector<uint64_t> block_hashes() const;

  uint64_t ram_bytes() const { return tree_.bytes(); }
  uint64_t pages_held() const { return blocks_.size() * sources_.size() * 2; }  // a main and a key page per source
  size_t ram_blocks() const { return blocks_.size(); }
  void clear_ram();
  CacheFolder::Stats disk_stats() const { return disk_ ? disk_->stats() : CacheFolder::Stats{}; }

 private:
  struct Block {
    std::vector<int32_t> main_pages, key_pages;  // one page per KV source, in source order
    std::shared_ptr<const ShortState> snapshot;  // exact mode: the short-lived state at this block's end
    size_t bytes = 0;
    uint64_t hash = 0;  // its name in KV events
  };
  void release(Block& block);
  void forget_all_blocks();
  void replay(const std::vector<int32_t>& prompt, int64_t boundary, SequenceState& state, int64_t tail_start,
              CacheHit& hit, const PromptImages* images) const;
  bool restore_from_disk(const std::vector<int32_t>& prompt, int64_t better_than, SequenceState& state, int64_t tail_start,
                         CacheHit& hit, const PromptImages* images, const std::string& cache_namespace);
  bool restore_entry(const std::vector<int32_t>& prompt, const std::string& name, int64_t best_tokens,
                     SequenceState& state, int64_t tail_start, CacheHit& hit, const PromptImages* images);
  // The first `tokens` tokens of `entry` restored into a fresh sequence moved into `state`, exact or
  // replayed per `mode`; "" then, else why it does not fit this model (`state` untouched).
  std::string restore_sections(const std::vector<int32_t>& prompt, const CacheEntry& entry, int64_t tokens,
                               CacheMode mode, SequenceState& state, int64_t tail_start, CacheHit& hit,
                               const PromptImages* images = nullptr) const;

  const Model& model_;
  StatePools& pools_;
  CacheMode mode_;
  uint64_t ram_budget_;
  IndexKeysMode index_keys_;
  std::unique_ptr<CacheFolder> disk_;  // null: no disk tier
  std::vector<int> sources_;  // KV source layers, in order
  PrefixTree tree_;
  std::unordered_map<PrefixTree::EntryId, Block> blocks_;
  PrefixTree::EntryId next_entry_ = 0;
  uint64_t clock_ = 0;
  std::function<void(KvCacheEvent)> events_;
};

// The state after `tokens` (st.length == tokens.size(), whole blocks) as a prompt-cache entry of
// `mode`: the global rows, and for exact the short-lived state too. What the disk tier writes and a
// prefill server hands over.
CacheEntry export_state(const Model& model, const std::vector<int32_t>& tokens, const SequenceState& st, CacheMode mode);

}  // namespace dsv41
