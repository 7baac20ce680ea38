#include "state/prefix_tree.h"

#include <algorithm>
#include <queue>
#include <string>
#include <tuple>

#include "util/error.h"

namespace dsv41 {

PrefixTree::PrefixTree(size_t block_tokens) : block_tokens_(block_tokens) {
  if (block_tokens_ == 0) fail("PrefixTree", "block_tokens must be positive");
  Node root;
  root.is_root = true;
  nodes_.emplace(kRoot, std::move(root));
}

uint64_t PrefixTree::root_of(const std::string& ns) const {
  if (ns.empty()) return kRoot;
  const auto it = roots_.find(ns);
  return it == roots_.end() ? kNoNode : it->second;
}

PrefixTree::Match PrefixTree::match(const std::vector<int32_t>& tokens, const std::string& ns) const {
  Match out;
  const uint64_t root = root_of(ns);
  if (root == kNoNode) return out;
  const Node* node = &nodes_.at(root);
  std::vector<int32_t> block(block_tokens_);
  for (size_t start = 0; start + block_tokens_ <= tokens.size(); start += block_tokens_) {
    std::copy_n(tokens.begin() + static_cast<std::ptrdiff_t>(start), block_tokens_, block.begin());
    auto it = node->children.find(block);
    if (it == node->children.end()) break;
    node = &nodes_.at(it->second);
    out.tokens += static_cast<int64_t>(block_tokens_);
    out.path.push_back(node->entry);
    out.nodes.push_back(it->second);
  }
  return out;
}

void PrefixTree::insert(const std::vector<int32_t>& tokens, int64_t n_blocks,
                        const std::function<EntryId(int64_t)>& make_entry,
                        const std::function<size_t(EntryId)>& entry_bytes, const std::string& ns) {
  if (n_blocks < 0 || static_cast<size_t>(n_blocks) > tokens.size() / block_tokens_)
    fail("PrefixTree", "insert of " + std::to_string(n_blocks) + " blocks of " + std::to_string(block_tokens_) +
                           " tokens from a prompt of " + std::to_string(tokens.size()) + " tokens");
  if (n_blocks == 0) return;
  uint64_t id = root_of(ns);
  if (id == kNoNode) {
    Node root;
    root.is_root = true;
    root.ns = ns;
    id = next_id_++;
    nodes_.emplace(id, std::move(root));
    roots_.emplace(ns, id);
  }
  const uint64_t root = id;
  struct DropEmptyRoot {  // a new namespace whose first block could not be made holds nothing
    PrefixTree* tree;
    uint64_t root;
    ~DropEmptyRoot() {
      const Node& r = tree->nodes_.at(root);
      if (root != kRoot && r.children.empty()) {
        tree->roots_.erase(r.ns);
        tree->nodes_.erase(root);
      }
    }
  } drop_empty_root{this, root};
  for (int64_t b = 0; b < n_blocks; ++b) {
    const auto first = tokens.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(b) * block_tokens_);
    std::vector<int32_t> block(first, first + static_cast<std::ptrdiff_t>(block_tokens_));
    auto& children = nodes_.at(id).children;
    auto it = children.find(block);
    if (it != children.end()) {
      id = it->second;
      continue;
    }
    // Ask for the entry before linking the node: if make_entry or entry_bytes throws, the tree is
    // unchanged from this block on.
    Node node;
    node.entry = make_entry(b);
    node.bytes = node.entry == kNoEntry ? 0 : entry_bytes(node.entry);
    node.parent = id;
    node.key = block;
    node.last_use = clock_;
    const uint64_t child = next_id_++;
    children.emplace(std::move(block), child);
    bytes_ += node.bytes;
    nodes_.emplace(child, std::move(node));
    id = child;
  }
}

void PrefixTree::grow(uint64_t node, size_t extra) {
  auto it = nodes_.find(node);
  if (it == nodes_.end() || it->second.is_root) return;
  it->second.bytes += extra;
  bytes_ += extra;
}

void PrefixTree::touch(const Match& match, uint64_t now) {
  clock_ = std::max(clock_, now);
  for (uint64_t id : match.nodes) {
    auto it = nodes_.find(id);
    if (it != nodes_.end()) it->second.last_use = now;
  }
}

std::vector<PrefixTree::EntryId> PrefixTree::evict_until(size_t max_bytes,
                                                         const std::function<bool(EntryId)>& evictable) {
  std::vector<EntryId> evicted;
  if (bytes_ <= max_bytes) return evicted;
  // Min-heap of current leaves by (last use, id): ids grow with creation, so ties go to the older node.
  using Item = std::pair<uint64_t, uint64_t>;
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> leaves;
  for (const auto& [id, node] : nodes_)
    if (!node.is_root && node.children.empty()) leaves.emplace(node.last_use, id);

  while (bytes_ > max_bytes && !leaves.empty()) {
    const uint64_t id = leaves.top().second;
    leaves.pop();
    Node& node = nodes_.at(id);
    // A pinned leaf stays; since it is never pushed again, its ancestors never become leaves here.
    if (node.entry != kNoEntry && !evictable(node.entry)) continue;
    if (node.entry != kNoEntry) evicted.push_back(node.entry);
    bytes_ -= node.bytes;
    const uint64_t parent_id = node.parent;
    Node& parent = nodes_.at(parent_id);
    parent.children.erase(node.key);
    nodes_.erase(id);
    if (!parent.children.empty()) continue;
    if (!parent.is_root) {
      leaves.emplace(parent.last_use, parent_id);
    } else if (parent_id != kRoot) {  // a salted namespace's last block went
      roots_.erase(parent.ns);
      nodes_.erase(parent_id);
    }
  }
  return evicted;
}

void PrefixTree::clear() {
  // next_id_ keeps counting so that a Match taken before clear() can never touch a newer node.
  nodes_.clear();
  roots_.clear();
  Node root;
  root.is_root = true;
  nodes_.emplace(kRoot, std::move(root));
  bytes_ = 0;
}

}  // namespace dsv41
