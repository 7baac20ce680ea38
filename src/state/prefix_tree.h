// The prefix-cache index: a radix tree over blocks of `block_tokens` token ids. Each node stands for
// one full block following its parent's blocks and names a cache entry (EntryId) owned by the caller,
// typically the global KV pages of that block (model-spec §5: only global KV is kept for a prefix).
// Matching is whole blocks only, so a hit always ends on a block boundary.
//
// Every chain starts at the root of a namespace (io/cache_namespace.h): "" for prompts without a
// cache salt, one root per salt's digest beside it, so no match ever crosses from one to another.
// A namespace's root goes when its last block does.
//
// The tree knows nothing about what an entry holds: the caller creates entries in insert(), says how
// many bytes each one costs, and frees (or spills to disk) whatever evict_until() returns.
//
// Not thread-safe: owned by the scheduler thread, like the page pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

namespace dsv41 {

class PrefixTree {
 public:
  using EntryId = int64_t;
  static constexpr EntryId kNoEntry = -1;

  struct Match {
    int64_t tokens = 0;            // matched tokens, a multiple of block_tokens
    std::vector<EntryId> path;     // entry of each matched node, root side first; -1 where none
    std::vector<uint64_t> nodes;   // ids of the matched nodes, for touch(); stale ids are ignored
  };

  explicit PrefixTree(size_t block_tokens);

  size_t block_tokens() const { return block_tokens_; }

  // Longest chain of full blocks of `tokens` present in the tree under namespace `ns`.
  Match match(const std::vector<int32_t>& tokens, const std::string& ns = {}) const;

  // Ensures nodes exist for the first n_blocks blocks of `tokens` under namespace `ns`. For each node created,
  // make_entry(block_index) supplies its entry (kNoEntry is allowed) and entry_bytes(entry) its
  // size (not called for kNoEntry, which costs 0). Existing nodes are left as they are. New nodes
  // take the latest clock value seen by touch(), so they are not the first to go before the caller
  // touches them.
  void insert(const std::vector<int32_t>& tokens, int64_t n_blocks,
              const std::function<EntryId(int64_t block_index)>& make_entry,
              const std::function<size_t(EntryId)>& entry_bytes, const std::string& ns = {});

  // Marks the matched nodes as used at time `now` (the caller's LRU clock).
  void touch(const Match& match, uint64_t now);
  // Counts `extra` more bytes for the node of a match (an entry that grew); a stale id is ignored.
  void grow(uint64_t node, size_t extra);

  // Removes least-recently-used leaves until bytes() <= max_bytes or nothing more can go. A leaf
  // whose entry is not evictable (pinned by a running sequence) stays, and so do its ancestors.
  // Removing a leaf can make its parent a leaf, which then competes by its own last use.
  // Returns the removed entries (never kNoEntry) in the order they were removed; the caller owns
  // freeing them. Ties in last use go to the older node.
  std::vector<EntryId> evict_until(size_t max_bytes, const std::function<bool(EntryId)>& evictable);

  size_t bytes() const { return bytes_; }
  size_t nodes() const { return nodes_.size() - 1 - roots_.size(); }  // blocks, not counting the roots
  size_t namespaces() const { return roots_.size(); }  // salted namespaces holding blocks now
  // Forgets every node. The entries are the caller's: it must free them itself.
  void clear();

 private:
  struct Node {
    uint64_t parent = 0;
    std::vector<int32_t> key;                            // this node's block of tokens
    std::map<std::vector<int32_t>, uint64_t> children;   // block tokens -> node id
    EntryId entry = kNoEntry;
    uint64_t last_use = 0;
    size_t bytes = 0;
    bool is_root = false;  // a namespace's root: no block, no entry
    std::string ns;        // a root's namespace
  };
  static constexpr uint64_t kRoot = 0;  // the root of namespace ""

  uint64_t root_of(const std::string& ns) const;  // kNoNode when the namespace holds nothing
  static constexpr uint64_t kNoNode = ~uint64_t{0};

  // Nodes live in a flat map by id rather than owning each other, so a very long prompt (a chain of
  // thousands of blocks) is never destroyed by deep recursion, and touch() can find a node by id
  // and notice when it is gone.
  std::unordered_map<uint64_t, Node> nodes_;
  std::unordered_map<std::string, uint64_t> roots_;  // salted namespaces' roots ("" is kRoot)
  size_t block_tokens_;
  uint64_t next_id_ = 1;
  uint64_t clock_ = 0;  // latest `now` passed to touch()
  size_t bytes_ = 0;
};

}  // namespace dsv41
