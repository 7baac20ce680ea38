// KV events over ZeroMQ (`serve --kv-events ENDPOINT`): vLLM's publisher, which NVIDIA Dynamo's KV
// router, llm-d and TensorRT-LLM's consumers read. Every batch goes out on a PUB socket as three
// frames: the topic, a sequence number (u64 big-endian, from 0), and the batch in msgpack. With a
// replay endpoint, a ROUTER socket answers a subscriber that missed batches: it sends the first
// sequence number it wants (8 bytes big-endian, after the empty frame a REQ or DEALER socket puts
// first) and gets every batch still buffered from there on, each as [sequence, payload], then
// [-1 as 8 bytes, empty]. (A REQ socket takes only the first answer: use DEALER for the rest.)
//
// The payload is vLLM's KVEventBatch in its array form (msgspec array_like):
//   [ts (float seconds since the epoch), [event, ...], data_parallel_rank (0)]
//   ["BlockStored", [block_hash, ...], parent_block_hash | nil, [token_id, ...], block_size, lora_id (nil), medium]
//   ["BlockRemoved", [block_hash, ...], medium]
//   ["AllBlocksCleared"]
// Block hashes are unsigned 64-bit integers (io/cache_namespace.h: cache_block_hash), block_size is
// the prompt cache's 64, and medium is "CPU": the host memory the engine computes from.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/kv_events.h"

namespace dsv41 {

struct KvEventPublisherOptions {
  std::string endpoint;         // the PUB socket's, bound: tcp://HOST:PORT (PORT "*": any free one), ipc://PATH
  std::string replay_endpoint;  // the ROUTER socket's, bound; empty: no replay
  std::string topic;            // every message's first frame (vLLM's default: empty)
  size_t replay_batches = 10000;  // batches kept for replay (vLLM's buffer_steps)
  size_t queue_batches = 100000;  // batches waiting to be sent; past it they are dropped and counted
};

// The msgpack bytes of one batch, as above.
std::string encode_kv_event_batch(const std::vector<KvCacheEvent>& events, double ts, int64_t block_size);

class ZmqKvEventPublisher final : public KvEventSink {
 public:
  // Binds both sockets on a thread of its own; Error naming the endpoint when one cannot be bound.
  explicit ZmqKvEventPublisher(KvEventPublisherOptions options);
  ~ZmqKvEventPublisher() override;  // sends what is queued, then closes (linger 1 s)
  ZmqKvEventPublisher(const ZmqKvEventPublisher&) = delete;
  ZmqKvEventPublisher& operator=(const ZmqKvEventPublisher&) = delete;

  void publish(std::vector<KvCacheEvent> batch) override;
  uint64_t dropped() const override { return dropped_.load(std::memory_order_relaxed); }
  // What the sockets are bound to, ports resolved ("tcp://127.0.0.1:5557").
  const std::string& endpoint() const { return bound_; }
  const std::string& replay_endpoint() const { return bound_replay_; }

 private:
  struct Queued {
    double ts = 0;
    std::vector<KvCacheEvent> events;
  };
  // The thread: binds the sockets, reports the endpoints (or why not) through `ready`, then sends.
  void run(std::promise<void>& ready);

  KvEventPublisherOptions opt_;
  std::string bound_, bound_replay_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;  // under mu_
  bool stopping_ = false;     // under mu_
  std::atomic<uint64_t> dropped_{0};
  std::thread thread_;
};

}  // namespace dsv41
