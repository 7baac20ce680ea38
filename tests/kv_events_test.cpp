// KV events (`serve --kv-events`): a subscriber in the shape of a cache-aware router (ZeroMQ SUB and a
// DEALER for replay, msgpack decoded by msgpack-c, not by dsv41's encoder) rebuilds the set of
// blocks the server's prefix cache holds from the events alone. After a mixed workload (shared
// prefixes, a salted tenant, evictions) the rebuilt set has the server's block count, and for every
// prompt the hit it predicts from the events is the hit the server reports.
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <map>
#include <msgpack.hpp>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "serve_process.h"
#include "server_util.h"
#include "test_util.h"
#include "transfer/kv_event_publisher.h"

namespace dsv41::server {
namespace {

constexpr size_t kBlock = 64;

using Tokens = std::vector<int32_t>;

Tokens random_tokens(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Tokens t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(100 + rng() % 900);
  return t;
}

Tokens concat(Tokens a, const Tokens& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

double metric(int port, const std::string& name) {
  const std::string text = request(port, "GET", "/metrics").raw;
  const size_t at = text.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stod(text.substr(at + name.size() + 2));
}

// The endpoint after `key` in the server's first line ("kv events on tcp://...,").
std::string endpoint_after(const std::string& line, const std::string& key) {
  const size_t at = line.find(key);
  if (at == std::string::npos) return "";
  const size_t from = at + key.size();
  return line.substr(from, line.find_first_of(",)", from) - from);
}

struct Event {
  std::string type;
  std::vector<uint64_t> hashes;
  std::optional<uint64_t> parent;
  Tokens tokens;
};

// One payload, decoded and checked against vLLM's KVEventBatch in its array form.
std::vector<Event> decode_batch(const std::string& payload) {
  std::vector<Event> out;
  const msgpack::object_handle h = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& batch = h.get();
  EXPECT_EQ(batch.type, msgpack::type::ARRAY);
  if (batch.type != msgpack::type::ARRAY || batch.via.array.size != 3) return out;
  EXPECT_EQ(batch.via.array.ptr[0].type, msgpack::type::FLOAT64);  // ts
  EXPECT_GT(batch.via.array.ptr[0].as<double>(), 1.7e9);
  EXPECT_EQ(batch.via.array.ptr[2].as<int>(), 0);  // data_parallel_rank
  for (const msgpack::object& o : batch.via.array.ptr[1].as<std::vector<msgpack::object>>()) {
    const std::vector<msgpack::object> f = o.as<std::vector<msgpack::object>>();
    Event e;
    e.type = f.at(0).as<std::string>();
    if (e.type == "BlockStored") {
      EXPECT_EQ(f.size(), 7u);
      e.hashes = f.at(1).as<std::vector<uint64_t>>();
      if (!f.at(2).is_nil()) e.parent = f.at(2).as<uint64_t>();
      e.tokens = f.at(3).as<Tokens>();
      EXPECT_EQ(f.at(4).as<int>(), static_cast<int>(kBlock));  // block_size
      EXPECT_TRUE(f.at(5).is_nil());                            // lora_id
      EXPECT_EQ(f.at(6).as<std::string>(), "CPU");              // medium
      EXPECT_EQ(e.tokens.size(), e.hashes.size() * kBlock);
    } else if (e.type == "BlockRemoved") {
      EXPECT_EQ(f.size(), 3u);
      e.hashes = f.at(1).as<std::vector<uint64_t>>();
    } else {
      EXPECT_EQ(e.type, "AllBlocksCleared");
    }
    out.push_back(std::move(e));
  }
  return out;
}

// A router's view of one server: every batch by sequence number, from the live stream or, for the
// ones it missed (a new subscriber misses the first), from the replay socket.
class Router {
 public:
  Router(const std::string& pub, const std::string& replay) : sub_(ctx_, zmq::socket_type::sub), replay_(ctx_, zmq::socket_type::dealer) {
    sub_.set(zmq::sockopt::subscribe, "");
    sub_.connect(pub);
    replay_.connect(replay);
  }

  // Takes in batches until it holds every one the server has published (its counter says how many).
  void sync(int port) {
    const auto published = static_cast<uint64_t>(metric(port, "dsv41_kv_event_batches_total"));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (next_ < published && std::chrono::steady_clock::now() < deadline) {
      std::vector<zmq::message_t> frames;
      while (zmq::recv_multipart(sub_, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
        EXPECT_EQ(frames.size(), 3u);
        if (frames.size() == 3) {
          ++live_;
          batches_.emplace(seq_of(frames[1]), frames[2].to_string());
        }
        frames.clear();
      }
      apply_ready();
      if (next_ >= published) break;
      if (batches_.empty() || batches_.begin()->first > next_ || !batches_.count(next_)) replay_from(next_);
      apply_ready();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_EQ(next_, published) << "batches published but neither received nor replayed";
  }

  // The events do not say which tenant a chain belongs to (its hash does, to whoever knows the
  // salt): the caller names the salt of the request whose chains have just appeared.
  void label_new_roots(const std::string& salt) {
    for (const auto& [hash, b] : blocks_) {
      if (!b.parent) root_salt_.emplace(hash, salt);
    }
  }

  // The prompt tokens the events say the server can restore for `prompt` under `salt`.
  size_t predicted_hit(const Tokens& prompt, const std::string& salt) const {
    const size_t usable = (prompt.size() - 1) / kBlock * kBlock;
    std::set<uint64_t> at;
    size_t depth = 0;
    for (; (depth + 1) * kBlock <= usable; ++depth) {
      std::set<uint64_t> next;
      const Tokens block(prompt.begin() + static_cast<long>(depth * kBlock), prompt.begin() + static_cast<long>((depth + 1) * kBlock));
      for (const auto& [hash, b] : blocks_) {
        const bool follows = depth == 0 ? !b.parent && root_salt_.at(hash) == salt : b.parent && at.count(*b.parent);
        if (follows && b.tokens == block) next.insert(hash);
      }
      if (next.empty()) break;
      at = std::move(next);
    }
    return depth * kBlock;
  }

  // The hashes of the blocks that start a chain with `first`'s first 64 tokens (one per namespace).
  std::vector<uint64_t> roots_with(const Tokens& first) const {
    std::vector<uint64_t> out;
    for (const auto& [hash, b] : blocks_) {
      if (!b.parent && std::equal(b.tokens.begin(), b.tokens.end(), first.begin())) out.push_back(hash);
    }
    return out;
  }

  size_t blocks() const { return blocks_.size(); }
  std::set<uint64_t> hashes() const {
    std::set<uint64_t> out;
    for (const auto& [hash, b] : blocks_) out.insert(hash);
    return out;
  }
  uint64_t live() const { return live_; }
  uint64_t replayed() const { return replayed_; }
  uint64_t removed() const { return removed_; }

 private:
  struct Block {
    std::optional<uint64_t> parent;
    Tokens tokens;
  };

  static uint64_t seq_of(const zmq::message_t& m) {
    uint64_t v = 0;
    for (size_t i = 0; i < m.size() && i < 8; ++i) v = (v << 8) | static_cast<const uint8_t*>(m.data())[i];
    return v;
  }

  void replay_from(uint64_t first) {
    std::string seq(8, '\0');
    for (int i = 7; i >= 0; --i, first >>= 8) seq[static_cast<size_t>(i)] = static_cast<char>(first & 0xff);
    const std::array<zmq::const_buffer, 2> request = {zmq::const_buffer(nullptr, 0), zmq::buffer(seq)};
    zmq::send_multipart(replay_, request);
    replay_.set(zmq::sockopt::rcvtimeo, 5000);
    for (;;) {
      std::vector<zmq::message_t> frames;
      if (!zmq::recv_multipart(replay_, std::back_inserter(frames))) {
        ADD_FAILURE() << "the replay socket did not answer";
        return;
      }
      EXPECT_EQ(frames.size(), 3u);  // the empty delimiter, the sequence, the payload
      if (frames.size() != 3) return;
      if (frames[2].size() == 0) {
        EXPECT_EQ(seq_of(frames[1]), UINT64_MAX);  // -1: the end
        return;
      }
      const uint64_t s = seq_of(frames[1]);
      const auto [it, added] = batches_.emplace(s, frames[2].to_string());
      if (!added) {
        EXPECT_EQ(it->second, frames[2].to_string()) << "batch " << s << " replayed unlike its live copy";
      }
      replayed_ += added;
    }
  }

  // Applies the batches that follow what was applied, in order.
  void apply_ready() {
    for (auto it = batches_.find(next_); it != batches_.end(); it = batches_.find(next_)) {
      for (const Event& e : decode_batch(it->second)) apply(e);
      ++next_;
    }
  }

  void apply(const Event& e) {
    if (e.type == "AllBlocksCleared") {
      blocks_.clear();
      return;
    }
    if (e.type == "BlockRemoved") {
      for (uint64_t h : e.hashes) {
        EXPECT_EQ(blocks_.erase(h), 1u) << "removed a block never stored";
        ++removed_;
      }
      return;
    }
    // a stored chain hangs from a block the cache holds (or starts a prompt)
    if (e.parent) {
      EXPECT_TRUE(blocks_.count(*e.parent)) << "stored under a parent the cache does not hold";
    }
    std::optional<uint64_t> parent = e.parent;
    for (size_t i = 0; i < e.hashes.size(); ++i) {
      const Tokens block(e.tokens.begin() + static_cast<long>(i * kBlock), e.tokens.begin() + static_cast<long>((i + 1) * kBlock));
      EXPECT_FALSE(blocks_.count(e.hashes[i])) << "stored twice";
      blocks_[e.hashes[i]] = {parent, block};
      parent = e.hashes[i];
    }
  }

  zmq::context_t ctx_{1};
  zmq::socket_t sub_, replay_;
  std::map<uint64_t, std::string> batches_;  // by sequence number
  uint64_t next_ = 0;                        // the first batch not applied yet
  std::map<uint64_t, Block> blocks_;
  std::map<uint64_t, std::string> root_salt_;  // a chain's first block: the salt of the request that stored it
  uint64_t live_ = 0, replayed_ = 0, removed_ = 0;
};

// What the server reports it restored for `prompt`.
int64_t cached_tokens(int port, const Tokens& prompt, const std::string& salt = "") {
  json body = {{"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}};
  if (!salt.empty()) body["cache_salt"] = salt;
  const Reply r = post(port, "/v1/completions", body);
  EXPECT_EQ(r.status, 200) << r.raw;
  if (r.status != 200) return -1;
  EXPECT_EQ(r.body["usage"]["prompt_tokens"].get<size_t>(), prompt.size());
  return r.body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
}

TEST(KvEvents, ASubscriberRebuildsTheCacheAndPredictsEveryHit) {
  // replay mode: any block boundary of a cached chain restores, so a hit is the chain the events
  // describe; 1 MiB of RAM (about 150 blocks of the tiny model) makes the workload evict
  ServeProcess p(test::tiny_model_dir(), "--cache-mode replay --cache-ram-mb 1 --kv-events 'tcp://127.0.0.1:*' "
                                         "--kv-events-replay 'tcp://127.0.0.1:*'");
  ASSERT_GT(p.port(), 0) << p.first_line();
  const std::string pub = endpoint_after(p.first_line(), "kv events on ");
  const std::string replay = endpoint_after(p.first_line(), "replay on ");
  ASSERT_FALSE(pub.empty() || replay.empty()) << p.first_line();
  Router router(pub, replay);

  const Tokens a = random_tokens(1000, 1);
  const Tokens b = concat(Tokens(a.begin(), a.begin() + 512), random_tokens(500, 2));
  const Tokens d = concat(a, random_tokens(300, 3));
  const Tokens e = random_tokens(700, 4);
  const Tokens f(a.begin(), a.begin() + 400);
  const Tokens g = random_tokens(3000, 5), h = random_tokens(3000, 6), i = random_tokens(3000, 7);
  struct Turn {
    const Tokens* prompt;
    std::string salt;
  };
  // A request, then the events it caused.
  const auto run = [&](const Tokens& prompt, const std::string& salt) {
    const int64_t hit = cached_tokens(p.port(), prompt, salt);
    router.sync(p.port());
    router.label_new_roots(salt);
    return hit;
  };
  const std::vector<Turn> workload = {{&a, ""}, {&b, ""}, {&d, ""}, {&e, "tenant-1"}, {&f, "tenant-1"},
                                      {&g, ""}, {&h, ""}, {&i, ""}};
  for (const Turn& t : workload) {
    run(*t.prompt, t.salt);
    // the tenant's copy of a's first blocks is a chain of its own: same tokens, another hash
    if (t.prompt == &f) {
      EXPECT_EQ(router.roots_with(a).size(), 2u);
    }
  }
  EXPECT_GT(router.removed(), 0u) << "the workload must evict";

  // Each prompt again: the hit the events predict is the hit the server reports (a probe that
  // misses stores its prompt again, and the next prediction follows from its events).
  for (const Turn& t : workload) {
    SCOPED_TRACE(std::to_string(t.prompt->size()) + " tokens, salt '" + t.salt + "'");
    const size_t predicted = router.predicted_hit(*t.prompt, t.salt);
    EXPECT_EQ(run(*t.prompt, t.salt), static_cast<int64_t>(predicted));
    std::printf("[ events ] %zu tokens, salt '%s': the events predicted a hit of %zu, as the server reported\n",
                t.prompt->size(), t.salt.c_str(), predicted);
    if (t.prompt == &e) {  // without its salt it hits nothing, and is stored under hashes of its own
      EXPECT_EQ(router.predicted_hit(e, ""), 0u);
      EXPECT_EQ(run(e, ""), 0);
      EXPECT_EQ(router.roots_with(e).size(), 2u);
    }
  }

  // The rebuilt set is as large as what the server holds (the gauge settles when the step ends).
  double held = -1;
  for (int k = 0; k < 100 && held != static_cast<double>(router.blocks()); ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    held = metric(p.port(), "dsv41_prefix_cache_blocks");
  }
  EXPECT_EQ(held, static_cast<double>(router.blocks()));
  std::printf("[ events ] %zu blocks held; %llu batches live, %llu replayed; %llu blocks removed\n", router.blocks(),
              static_cast<unsigned long long>(router.live()), static_cast<unsigned long long>(router.replayed()),
              static_cast<unsigned long long>(router.removed()));
  EXPECT_GT(router.live(), 0u) << "the PUB socket delivered nothing";
  // A router that joins now has missed every batch: it rebuilds the same set from the replay socket.
  Router late(pub, replay);
  late.sync(p.port());
  EXPECT_EQ(late.hashes(), router.hashes());
  EXPECT_EQ(late.replayed(), metric(p.port(), "dsv41_kv_event_batches_total"));
  EXPECT_EQ(metric(p.port(), "dsv41_kv_event_batches_dropped_total"), 0);
}

// The encoder alone, for the two events the workload above may not make, decoded by msgpack-c.
TEST(KvEvents, ClearedAndRootEventsEncodeAsVllmsArrays) {
  std::vector<KvCacheEvent> events(2);
  events[0].kind = KvCacheEvent::Kind::AllBlocksCleared;
  events[1].block_hashes = {UINT64_MAX, 7};
  events[1].token_ids = Tokens(2 * kBlock, 5);
  const std::vector<Event> back = decode_batch(encode_kv_event_batch(events, 1.8e9, kBlock));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0].type, "AllBlocksCleared");
  EXPECT_EQ(back[1].type, "BlockStored");
  EXPECT_EQ(back[1].hashes, (std::vector<uint64_t>{UINT64_MAX, 7}));
  EXPECT_FALSE(back[1].parent.has_value());
}

// Bad flags stop the command, naming the flag.
TEST(KvEvents, BadEndpointsAndStrayFlagsAreRefused) {
  for (const auto& [args, expect] : std::vector<std::pair<std::string, std::string>>{
           {"--kv-events bogus://x", "--kv-events: cannot bind bogus://x"},
           {"--kv-events 'tcp://127.0.0.1:*' --kv-events-replay tcp://256.0.0.1:1", "--kv-events-replay: cannot bind"},
           {"--kv-events-topic t", "--kv-events-topic: needs --kv-events"}}) {
    const test::CommandResult r = test::run_dsv41("serve -m '" + test::tiny_model_dir() + "' --port 0 " + args);
    EXPECT_EQ(r.status, 1) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(expect), std::string::npos) << args << "\n" << r.out;
  }
}

}  // namespace
}  // namespace dsv41::server
