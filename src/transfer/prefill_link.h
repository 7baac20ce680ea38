// The prefill/decode handover between two servers started on their own (`serve --role prefill` and
// `serve --role decode --prefill-peer ADDR`), over UCX (transfer/ucx_link.h). The decode server sends
// a prompt's prefix and the handover mode; the prefill server prefills it and answers with the state
// as a prompt-cache entry (state/disk_cache.h: versioned, the model's fingerprint, the section table
// with every size, a checksum), which the decode side verifies before it restores anything.
//
// Request: JSON {"protocol": "dsv41-prefill", "version": 2, "mode": "exact"|"replay", "tokens": [...],
// "namespace": ""|32 hex digits} (the prompt cache's namespace, io/cache_namespace.h; version 1
// had none, and a server of either version refuses the other's requests: a peer that ignored the
// namespace would serve one tenant's prefix to another).
// Answer: one status byte (0: the entry's bytes follow; 1: an error message follows).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "runtime/prefill_peer.h"
#include "transfer/peer_backoff.h"
#include "transfer/ucx_link.h"

namespace dsv41 {

constexpr int kPrefillProtocolVersion = 2;

// The decode server's side: one connection per prompt, from the calling thread.
class UcxPrefillPeer final : public PrefillPeer {
 public:
  // `max_answer_bytes`: the most a handover may take (the model's whole context of state); `timeout`:
  // how long one prompt's prefill and transfer may take. A peer that lets a handover time out is not
  // asked again for a while (transfer/peer_backoff.h: the timeout, doubling while it stays silent,
  // up to 10 minutes): the prompts meanwhile fail here at once and are prefilled locally.
  UcxPrefillPeer(UcxAddress peer, uint64_t max_answer_bytes, std::chrono::seconds timeout);
  std::vector<uint8_t> prefill(const std::vector<int32_t>& tokens, CacheMode mode,
                               const std::string& cache_namespace) override;
  void stop() override { stopping_ = true; }

 private:
  // One handover: the request sent, the answer's bytes received (status byte first).
  std::vector<uint8_t> exchange(const std::vector<int32_t>& tokens, CacheMode mode, const std::string& cache_namespace,
                                Deadline deadline, const std::string& what);
  std::atomic<bool> stopping_{false};
  UcxAddress peer_;
  uint64_t max_answer_bytes_;
  std::chrono::seconds timeout_;
  PeerBackoff backoff_;
};

// The prefill server's side: a thread that accepts decode servers' requests and answers them one at
// a time with `handler(tokens, mode, cache_namespace, stopping)`'s entry bytes (an Error from it goes back as the
// answer). `stopping` becomes true when the listener is destroyed: a handler ends its work early then.
class PrefillListener {
 public:
  using Handler = std::function<std::vector<uint8_t>(const std::vector<int32_t>& tokens, CacheMode mode,
                                                     const std::string& cache_namespace,
                                                     const std::atomic<bool>& stopping)>;
  // Error naming the address when it cannot listen. `max_tokens`: the longest prompt accepted.
  PrefillListener(const UcxAddress& at, Handler handler, int64_t max_tokens);
  ~PrefillListener();  // stops accepting, ends the request being answered, joins the thread
  PrefillListener(const PrefillListener&) = delete;
  PrefillListener& operator=(const PrefillListener&) = delete;
  uint16_t port() const { return port_; }

 private:
  void serve(UcxListener& listener);
  Handler handler_;
  int64_t max_tokens_;
  uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace dsv41
