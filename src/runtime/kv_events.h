// What the prompt cache's RAM tier stores and evicts, told to the world outside (`serve --kv-events`):
// the events a cache-aware router (NVIDIA Dynamo's KV router, llm-d) follows to place each agent's
// next turn on the replica that holds its history. They mirror vLLM's KV events: a block is one
// 64-token block of the prefix cache (PrefixCache, kTokensPerPage), named by a hash that chains its
// parent's (io/cache_namespace.h: cache_block_hash), so equal prefixes have equal hashes on every
// replica of the same model and a salted tenant's blocks have hashes of their own.
//
// The engine knows only this interface; transfer/ publishes it over ZeroMQ.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace dsv41 {

struct KvCacheEvent {
  enum class Kind { BlockStored, BlockRemoved, AllBlocksCleared };
  Kind kind = Kind::BlockStored;
  // BlockStored: the new blocks of one prompt, root side first; BlockRemoved: the evicted blocks
  std::vector<uint64_t> block_hashes;
  // BlockStored: the block the first new one follows (none: the first block of a prompt)
  std::optional<uint64_t> parent_block_hash;
  std::vector<int32_t> token_ids;  // BlockStored: the new blocks' tokens, back to back
};

class KvEventSink {
 public:
  virtual ~KvEventSink() = default;
  // A batch of events, in order, as the cache makes them; called on the scheduler thread (sometimes
  // holding the engine's lock), so it must not block or call the engine.
  virtual void publish(std::vector<KvCacheEvent> batch) = 0;
  // Batches given up so far (a publisher that cannot keep up): subscribers see a gap.
  virtual uint64_t dropped() const = 0;
};

}  // namespace dsv41
