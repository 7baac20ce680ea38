#include "transfer/kv_event_publisher.h"

#include <bit>
#include <chrono>
#include <msgpack.hpp>
#include <zmq.hpp>

#include "util/error.h"

namespace dsv41 {
namespace {

constexpr int64_t kBlockTokens = 64;  // the prompt cache's block (kTokensPerPage)
constexpr const char* kMedium = "CPU";
constexpr auto kReplayPoll = std::chrono::milliseconds(10);  // how often a waiting replay request is seen
constexpr int kLingerMs = 1000;  // what a closing PUB socket may still take to send

std::string be64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 7; i >= 0; --i, v >>= 8) out[static_cast<size_t>(i)] = static_cast<char>(v & 0xff);
  return out;
}

uint64_t from_be64(const zmq::message_t& m) {
  uint64_t v = 0;
  for (size_t i = 0; i < 8; ++i) v = (v << 8) | static_cast<const uint8_t*>(m.data())[i];
  return v;
}

void pack_hashes(msgpack::packer<msgpack::sbuffer>& pk, const std::vector<uint64_t>& hashes) {
  pk.pack_array(static_cast<uint32_t>(hashes.size()));
  for (uint64_t h : hashes) pk.pack_uint64(h);
}

std::string last_endpoint(zmq::socket_t& s) { return s.get(zmq::sockopt::last_endpoint); }

// A msgpack float 64 always: msgpack-c's pack_double writes a whole number as an integer, and the
// timestamp is a float in vLLM's schema.
void pack_float64(msgpack::sbuffer& buf, double v) {
  const uint64_t bits = std::bit_cast<uint64_t>(v);
  char bytes[9] = {static_cast<char>(0xcb)};
  for (int i = 0; i < 8; ++i) bytes[1 + i] = static_cast<char>(bits >> (56 - 8 * i));
  buf.write(bytes, sizeof bytes);
}

}  // namespace

std::string encode_kv_event_batch(const std::vector<KvCacheEvent>& events, double ts, int64_t block_size) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_array(3);
  pack_float64(buf, ts);
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const KvCacheEvent& e : events) {
    switch (e.kind) {
      case KvCacheEvent::Kind::BlockStored:
        pk.pack_array(7);
        pk.pack(std::string("BlockStored"));
        pack_hashes(pk, e.block_hashes);
        if (e.parent_block_hash) {
          pk.pack_uint64(*e.parent_block_hash);
        } else {
          pk.pack_nil();
        }
        pk.pack_array(static_cast<uint32_t>(e.token_ids.size()));
        for (int32_t t : e.token_ids) pk.pack_int32(t);
        pk.pack_int64(block_size);
        pk.pack_nil();  // lora_id: no adapters here
        pk.pack(std::string(kMedium));
        break;
      case KvCacheEvent::Kind::BlockRemoved:
        pk.pack_array(3);
        pk.pack(std::string("BlockRemoved"));
        pack_hashes(pk, e.block_hashes);
        pk.pack(std::string(kMedium));
        break;
      case KvCacheEvent::Kind::AllBlocksCleared:
        pk.pack_array(1);
        pk.pack(std::string("AllBlocksCleared"));
        break;
    }
  }
  pk.pack_int32(0);  // data_parallel_rank: one engine per process
  return std::string(buf.data(), buf.size());
}

ZmqKvEventPublisher::ZmqKvEventPublisher(KvEventPublisherOptions options) : opt_(std::move(options)) {
  if (opt_.endpoint.empty()) fail("--kv-events", "needs an endpoint, e.g. tcp://0.0.0.0:5557");
  std::promise<void> ready;
  std::future<void> bound = ready.get_future();
  thread_ = std::thread([this, &ready] { run(ready); });
  try {
    bound.get();
  } catch (...) {
    thread_.join();
    throw;
  }
}

ZmqKvEventPublisher::~ZmqKvEventPublisher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void ZmqKvEventPublisher::publish(std::vector<KvCacheEvent> batch) {
  const double ts = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (queue_.size() >= opt_.queue_batches) {
      dropped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    queue_.push_back({ts, std::move(batch)});
  }
  cv_.notify_one();
}

void ZmqKvEventPublisher::run(std::promise<void>& ready) {
  // The context and sockets belong to this thread alone (ZeroMQ sockets are not thread-safe).
  zmq::context_t context(1);
  zmq::socket_t pub(context, zmq::socket_type::pub);
  zmq::socket_t replay;
  try {
    pub.set(zmq::sockopt::linger, kLingerMs);
    const auto bind = [](zmq::socket_t& s, const std::string& endpoint, const char* flag) {
      try {
        s.bind(endpoint);
      } catch (const zmq::error_t& e) {
        fail(flag, "cannot bind " + endpoint + ": " + e.what());
      }
    };
    bind(pub, opt_.endpoint, "--kv-events");
    bound_ = last_endpoint(pub);
    if (!opt_.replay_endpoint.empty()) {
      replay = zmq::socket_t(context, zmq::socket_type::router);
      replay.set(zmq::sockopt::linger, 0);
      bind(replay, opt_.replay_endpoint, "--kv-events-replay");
      bound_replay_ = last_endpoint(replay);
    }
    ready.set_value();
  } catch (...) {
    ready.set_exception(std::current_exception());
    return;
  }

  std::deque<std::pair<uint64_t, std::string>> buffer;  // (sequence, payload) for replay
  uint64_t next_seq = 0;
  const zmq::const_buffer topic(opt_.topic.data(), opt_.topic.size());
  for (;;) {
    std::deque<Queued> todo;
    bool stop = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      const auto wake = [&] { return stopping_ || !queue_.empty(); };
      if (replay) {
        cv_.wait_for(lock, kReplayPoll, wake);
      } else {
        cv_.wait(lock, wake);
      }
      todo.swap(queue_);
      stop = stopping_;
    }
    for (Queued& q : todo) {
      std::string payload = encode_kv_event_batch(q.events, q.ts, kBlockTokens);
      const std::string seq = be64(next_seq);
      // PUB never blocks: a subscriber past its high-water mark misses batches, which it can replay
      pub.send(topic, zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      pub.send(zmq::buffer(seq), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      pub.send(zmq::buffer(payload), zmq::send_flags::dontwait);
      if (opt_.replay_batches > 0) {
        buffer.emplace_back(next_seq, std::move(payload));
        if (buffer.size() > opt_.replay_batches) buffer.pop_front();
      }
      ++next_seq;
    }
    // Replay requests: [identity, empty, first sequence]. A malformed one still gets the end marker,
    // so a REQ client is not left waiting.
    while (replay) {
      std::vector<zmq::message_t> frames;
      zmq::message_t part;
      bool more = true;
      while (more) {
        if (!replay.recv(part, zmq::recv_flags::dontwait)) break;
        more = part.more();
        frames.push_back(std::move(part));
      }
      if (frames.empty()) break;
      if (frames.size() < 2) continue;  // no identity and delimiter: nobody to answer
      const uint64_t first = frames.size() == 3 && frames[2].size() == 8 ? from_be64(frames[2]) : UINT64_MAX;
      const auto answer = [&](const std::string& seq, const std::string& payload) {
        replay.send(zmq::buffer(frames[0].data(), frames[0].size()), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
        replay.send(zmq::const_buffer(nullptr, 0), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
        replay.send(zmq::buffer(seq), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
        replay.send(zmq::buffer(payload), zmq::send_flags::dontwait);
      };
      for (const auto& [seq, payload] : buffer) {
        if (seq >= first) answer(be64(seq), payload);
      }
      answer(be64(UINT64_MAX), "");  // -1: the end
    }
    if (stop) break;
  }
}

}  // namespace dsv41
