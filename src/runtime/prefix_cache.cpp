#include "runtime/prefix_cache.h"

#include <algorithm>

#include "io/cache_namespace.h"
#include "state/disk_cache.h"
#include "state/sequence_sections.h"
#include "state/sequence_snapshot.h"
#include "util/error.h"

namespace dsv41 {

PrefixCache::PrefixCache(const Model& model, StatePools& pools, CacheMode mode, uint64_t ram_budget_bytes,
                         std::string disk_dir, IndexKeysMode index_keys, DiskTierOptions disk)
    : model_(model), pools_(pools), mode_(mode), ram_budget_(ram_budget_bytes), index_keys_(index_keys),
      tree_(static_cast<size_t>(kTokensPerPage)) {
  for (const LayerRole& r : model.roles()) {
    if (r.kv_source) sources_.push_back(r.layer);
  }
  if (!disk_dir.empty()) {
    disk_ = std::make_unique<CacheFolder>(std::move(disk_dir), model.fingerprint(),
                                          cache_mode_name(mode), disk.budget_bytes, std::move(disk.log));
  }
}

PrefixCache::~PrefixCache() { forget_all_blocks(); }

void PrefixCache::forget_all_blocks() {
  for (auto& [id, block] : blocks_) release(block);
  blocks_.clear();
  tree_.clear();
}

void PrefixCache::clear_ram() {
  const bool held = !blocks_.empty();
  forget_all_blocks();
  if (held && events_) events_({KvCacheEvent::Kind::AllBlocksCleared, {}, std::nullopt, {}});
}

std::vector<uint64_t> PrefixCache::block_hashes() const {
  std::vector<uint64_t> out;
  out.reserve(blocks_.size());
  for (const auto& [id, block] : blocks_) out.push_back(block.hash);
  return out;
}

void PrefixCache::release(Block& b) {
  for (size_t i = 0; i < sources_.size(); ++i) {
    pools_.main_kv(sources_[i]).release(b.main_pages[i]);
    pools_.index_keys(sources_[i]).release(b.key_pages[i]);
  }
  b.main_pages.clear();
  b.key_pages.clear();
}

namespace {

// The largest block boundary at most `tokens` that no image span straddles.
int64_t block_outside_spans(int64_t tokens, const PromptImages* images) {
  int64_t b = tokens / kTokensPerPage * kTokensPerPage;
  while (images && b > 0 && images->cut_at_or_before(b) != b) {
    b = images->cut_at_or_before(b) / kTokensPerPage * kTokensPerPage;
  }
  return b;
}

}  // namespace

void PrefixCache::replay(const std::vector<int32_t>& prompt, int64_t boundary, SequenceState& st, int64_t tail_start,
                         CacheHit& hit, const PromptImages* images) const {
  // Re-run the last `window` tokens before the boundary: enough to refill every window ring, and
  // nothing older can be reached by a window. The global rows of these positions are read only. A
  // span the window's start would cut is replayed whole (from its start, with its rows).
  int64_t start = boundary - std::min<int64_t>(model_.config().window_size, boundary);
  if (images) start = images->cut_at_or_before(start);
  rewind_for_replay(st, start, model_.engram_history(std::vector<int32_t>(prompt.begin(), prompt.begin() + start)),
                    sources_.empty() ? -1 : sources_.back());
  ForwardOptions opt;
  opt.replay = true;
  opt.index_keys = index_keys_;
  opt.tail_start = tail_start;  // decoder windows only where the prompt's tail begins, as in tail mode
  opt.prefill_length = static_cast<int64_t>(prompt.size());  // the lists a one-shot prefill gives them
  std::vector<int32_t> tokens(prompt.begin() + start, prompt.begin() + boundary);
  if (images) {
    opt.spans = images->slice(start, boundary);
    for (int32_t& t : tokens) {
      if (t < 0) t = static_cast<int32_t>(model_.config().vision.image_token_id);  // a key token: the span's id
    }
  }
  model_.forward(st, tokens, opt);
  hit.replayed_tokens = boundary - start;
}

int64_t PrefixCache::fork_boundary(const std::vector<int32_t>& prompt, const PromptImages* images,
                                   const std::string& cache_namespace) const {
  if (mode_ != CacheMode::Exact) return -1;
  const int64_t limit = usable_boundary(static_cast<int64_t>(prompt.size()));
  const PrefixTree::Match m = tree_.match(prompt, cache_namespace);
  const int64_t blocks = block_outside_spans(std::min(m.tokens, limit), images) / kTokensPerPage;
  if (blocks == 0 || blocks * kTokensPerPage < model_.config().window_size) return -1;
  if (blocks_.at(m.path[static_cast<size_t>(blocks - 1)]).snapshot) return -1;  // restore() takes it
  return blocks * kTokensPerPage;
}

int64_t PrefixCache::store_boundary(int64_t n) const {
  const int64_t b = usable_boundary(n);
  return mode_ == CacheMode::Exact && b < model_.config().window_size ? -1 : b;
}

CacheHit PrefixCache::restore(const std::vector<int32_t>& prompt, SequenceState& state, int64_t tail_start,
                              const PromptImages* images, const std::string& cache_namespace) {
  CacheHit hit;
  if (state.length() != 0) fail("prefix cache", "restores only into a fresh sequence");
  const int64_t limit = usable_boundary(static_cast<int64_t>(prompt.size()));
  if (limit <= 0) return hit;

  PrefixTree::Match m = tree_.match(prompt, cache_namespace);
  int64_t blocks = block_outside_spans(std::min(m.tokens, limit), images) / kTokensPerPage;
  if (mode_ == CacheMode::Exact) {  // only a boundary with a snapshot restores bit-identically
    while (blocks > 0 && !blocks_.at(m.path[blocks - 1]).snapshot) --blocks;
  }
  if (disk_ && restore_from_disk(prompt, blocks * kTokensPerPage, state, tail_start, hit, images, cache_namespace)) {
    return hit;
  }
  if (blocks == 0) return hit;

  SequenceState st = model_.new_sequence(pools_);
  for (size_t i = 0; i < sources_.size(); ++i) {
    const int l = sources_[i];
    std::vector<int32_t> main, keys;
    for (int64_t k = 0; k < blocks; ++k) {
      const Block& b = blocks_.at(m.path[k]);
      pools_.main_kv(l).retain(b.main_pages[i]);
      pools_.index_keys(l).retain(b.key_pages[i]);
      main.push_back(b.main_pages[i]);
      keys.push_back(b.key_pages[i]);
    }
    adopt_global_rows(st, l, std::move(main), std::move(keys), blocks * pools_.rows_per_page(l));
  }
  const int64_t boundary = blocks * kTokensPerPage;
  set_restored_length(st, boundary);
  m.path.resize(static_cast<size_t>(blocks));
  m.nodes.resize(static_cast<size_t>(blocks));
  tree_.touch(m, ++clock_);
  if (mode_ == CacheMode::Exact) {
    blocks_.at(m.path.back()).snapshot->apply_to(st);
  } else {
    replay(prompt, boundary, st, tail_start, hit, images);
  }
  state = std::move(st);
  hit.cached_tokens = boundary;
  hit.source = CacheSource::Ram;
  return hit;
}

bool PrefixCache::restore_from_disk(const std::vector<int32_t>& prompt, int64_t better_than, SequenceState& state,
                                    int64_t tail_start, CacheHit& hit, const PromptImages* images,
                                    const std::string& cache_namespace) {
  const int64_t limit = usable_boundary(static_cast<int64_t>(prompt.size()));
  // The best entry is tried first; one that turns out gone or bad is forgotten by the folder, so the
  // next pass finds the next best and every bad file costs one read, once. Each pass but the last
  // forgets an entry, so the passes are bounded by the entries there are.
  const size_t entries = disk_->items().size();
  for (size_t pass = 0; pass <= entries; ++pass) {
    std::string best;
    int64_t best_tokens = better_than;
    for (const auto& [name, item] : disk_->items()) {
      if (item.cache_namespace != cache_namespace) continue;
      const int64_t n = static_cast<int64_t>(item.tokens.size());
      const int64_t common = std::mismatch(item.tokens.begin(), item.tokens.end(), prompt.begin(),
                                           prompt.begin() + std::min<int64_t>(n, static_cast<int64_t>(prompt.size())))
                                 .first - item.tokens.begin();
      int64_t usable = 0;
      if (mode_ == CacheMode::Exact) {
        usable = common == n && n <= limit && n % kTokensPerPage == 0 ? n : 0;  // the snapshot's own boundary only
      } else {
        usable = std::min(common, limit) / kTokensPerPage * kTokensPerPage;
      }
      if (block_outside_spans(usable, images) != usable) usable = mode_ == CacheMode::Exact ? 0 : block_outside_spans(usable, images);
      if (usable > best_tokens) {
        best = name;
        best_tokens = usable;
      }
    }
    if (best.empty()) return false;
    try {
      if (restore_entry(prompt, best, best_tokens, state, tail_start, hit, images)) return true;
    } catch (const std::exception& e) {  // e.g. no memory for a large entry: only the cache is skipped
      disk_->reject(best, std::string("restoring it failed: ") + e.what());
    }
  }
  return false;
}

bool PrefixCache::restore_entry(const std::vector<int32_t>& prompt, const std::string& name, int64_t best_tokens,
                                SequenceState& state, int64_t tail_start, CacheHit& hit, const PromptImages* images) {
  const std::optional<CacheEntry> entry = disk_->read(name);  // gone or bad: logged and forgotten there
  if (!entry) return false;
  auto reject = [&](const std::string& reason) {
    disk_->reject(name, reason);
    return false;
  };
  const std::string why = restore_sections(prompt, *entry, best_tokens, mode_, state, tail_start, hit, images);
  if (!why.empty()) return reject(why);
  hit.source = CacheSource::Disk;
  return true;
}

std::string PrefixCache::restore_sections(const std::vector<int32_t>& prompt, const CacheEntry& entry, int64_t tokens,
                                          CacheMode mode, SequenceState& state, int64_t tail_start, CacheHit& hit,
                                          const PromptImages* images) const {
  SequenceState st = model_.new_sequence(pools_);
  if (!load_global_row_sections(st, model_.config(), entry.sections, tokens)) return "its rows do not fit this model";
  set_restored_length(st, tokens);
  if (mode == CacheMode::Exact) {
    const std::optional<ShortState> s = short_state_of_sections(entry.sections, model_.config(), st);
    if (!s) return "its window snapshot does not fit this model";
    s->apply_to(st);
  } else {
    replay(prompt, tokens, st, tail_start, hit, images);  // as the RAM tier: decoder windows from the tail on
  }
  state = std::move(st);
  hit.cached_tokens = tokens;
  return "";
}

int64_t PrefixCache::ram_hit_tokens(const std::vector<int32_t>& prompt, const std::string& cache_namespace) const {
  const int64_t limit = usable_boundary(static_cast<int64_t>(prompt.size()));
  if (limit <= 0) return 0;
  const PrefixTree::Match m = tree_.match(prompt, cache_namespace);
  int64_t blocks = std::min(m.tokens, limit) / kTokensPerPage;
  if (mode_ == CacheMode::Exact) {
    while (blocks > 0 && !blocks_.at(m.path[blocks - 1]).snapshot) --blocks;
  }
  return blocks * kTokensPerPage;
}

CacheHit PrefixCache::restore_handed(const std::vector<int32_t>& prompt, const CacheEntry& entry, SequenceState& state,
                                     int64_t tail_start, const std::string& cache_namespace) {
  const int64_t n = static_cast<int64_t>(entry.tokens.size());
  const auto refuse = [&](const std::string& why) { fail("handed-over state", why); };
  if (state.length() != 0) refuse("restores only into a fresh sequence");
  if (entry.mode != "exact" && entry.mode != "replay") refuse("mode '" + entry.mode + "' is neither exact nor replay");
  if (n <= 0 || n % kTokensPerPage != 0 || n > usable_boundary(static_cast<int64_t>(prompt.size())))
    refuse("covers " + std::to_string(n) + " tokens, not a block boundary short of the prompt's end");
  if (!std::equal(entry.tokens.begin(), entry.tokens.end(), prompt.begin())) refuse("is not of this prompt's prefix");
  if (entry.cache_namespace != cache_namespace) refuse("belongs to another cache namespace (cache_salt)");
  if (entry.mode == "exact" && n < model_.config().window_size) refuse("exact state inside the first window");
  CacheHit hit;
  const std::string why = restore_sections(prompt, entry, n, parse_cache_mode(entry.mode), state, tail_start, hit);
  if (!why.empty()) refuse(why);
  hit.source = CacheSource::Peer;
  return hit;
}

CacheEntry export_state(const Model& model, const std::vector<int32_t>& tokens, const SequenceState& st, CacheMode mode) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (st.length() != n || n <= 0 || n % kTokensPerPage != 0)
    fail("state export", "takes whole blocks of " + std::to_string(kTokensPerPage) + " tokens at the sequence's end");
  CacheEntry e;
  e.model_fingerprint = model.fingerprint();
  e.mode = cache_mode_name(mode);
  e.tokens = tokens;
  e.sections = global_row_sections(st);
  if (mode == CacheMode::Exact) {
    std::vector<CacheSection> short_state = short_state_sections(st);
    e.sections.insert(e.sections.end(), std::make_move_iterator(short_state.begin()), std::make_move_iterator(short_state.end()));
  }
  return e;
}

uint64_t PrefixCache::store(const std::vector<int32_t>& tokens, const SequenceState& st,
                            const std::string& cache_namespace) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (st.length() != n || n <= 0 || n % kTokensPerPage != 0) {
    fail("prefix cache", "stores whole blocks of " + std::to_string(kTokensPerPage) + " tokens at the sequence's end");
  }
  const int64_t blocks = n / kTokensPerPage;
  std::shared_ptr<const ShortState> snap =
      mode_ == CacheMode::Exact ? std::make_shared<const ShortState>(ShortState::of(st)) : nullptr;
  std::vector<uint64_t> hashes(static_cast<size_t>(blocks));
  for (int64_t k = 0; k < blocks; ++k) {
    hashes[k] = cache_block_hash(k > 0 ? &hashes[k - 1] : nullptr, cache_namespace, tokens.data() + k * kTokensPerPage,
                                 static_cast<size_t>(kTokensPerPage));
  }
  int64_t first_new = -1;  // the tree makes a prompt's new blocks at the end of its chain, in order
  tree_.insert(
      tokens, blocks,
      [&](int64_t k) {
        Block b;
        for (int l : sources_) {
          const GlobalPages pages = st.global_pages(l, k);
          const int32_t mp = pages.main_kv, kp = pages.index_keys;
          pools_.main_kv(l).retain(mp);  // the block now keeps these pages alive
          pools_.index_keys(l).retain(kp);
          b.main_pages.push_back(mp);
          b.key_pages.push_back(kp);
          b.bytes += pools_.main_kv(l).page_bytes() + pools_.index_keys(l).page_bytes();
        }
        if (snap && k == blocks - 1) {
          b.snapshot = snap;
          b.bytes += snap->bytes();
        }
        b.hash = hashes[k];
        if (first_new < 0) first_new = k;
        const PrefixTree::EntryId id = next_entry_++;
        blocks_.emplace(id, std::move(b));
        return id;
      },
      [&](PrefixTree::EntryId id) { return blocks_.at(id).bytes; }, cache_namespace);
  const PrefixTree::Match stored = tree_.match(tokens, cache_namespace);
  if (snap && first_new < 0 && stored.tokens == n) {
    // every block was there already (another prompt stored them and went on): the snapshot makes
    // this boundary restorable too
    Block& last = blocks_.at(stored.path.back());
    if (!last.snapshot) {
      last.snapshot = snap;
      last.bytes += snap->bytes();
      tree_.grow(stored.nodes.back(), snap->bytes());
    }
  }
  tree_.touch(stored, ++clock_);
  if (events_ && first_new >= 0) {
    KvCacheEvent e;
    e.block_hashes.assign(hashes.begin() + first_new, hashes.end());
    if (first_new > 0) e.parent_block_hash = hashes[first_new - 1];
    e.token_ids.assign(tokens.begin() + first_new * kTokensPerPage, tokens.end());
    events_(std::move(e));
  }
  KvCacheEvent removed{KvCacheEvent::Kind::BlockRemoved, {}, std::nullopt, {}};
  for (PrefixTree::EntryId id : tree_.evict_until(ram_budget_, [](PrefixTree::EntryId) { return true; })) {
    removed.block_hashes.push_back(blocks_.at(id).hash);
    release(blocks_.at(id));
    blocks_.erase(id);
  }
  if (events_ && !removed.block_hashes.empty()) events_(std::move(removed));
  if (!disk_) return 0;

  CacheEntry entry = export_state(model_, tokens, st, mode_);
  entry.cache_namespace = cache_namespace;
  return disk_->store(entry);  // never throws: a failed write leaves the request uncached
}

}  // namespace dsv41
