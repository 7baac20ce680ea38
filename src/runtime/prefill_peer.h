// The prefill server a decode server hands its prompts to (`serve --role decode --prefill-peer ADDR`):
// the prefill/decode split of the serving stacks. The engine knows only this interface; transfer/
// implements it over UCX.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/cache_mode.h"

namespace dsv41 {

class PrefillPeer {
 public:
  virtual ~PrefillPeer() = default;
  // Prefills `tokens` (whole 64-token blocks) on the peer and returns the state after them as a
  // prompt-cache entry's bytes (state/disk_cache.h) of `mode`: the global rows and, for exact, the
  // window rings and the rest of the short-lived state. The peer's own prompt cache serves and keeps
  // the prefix in `cache_namespace` (io/cache_namespace.h), the request's. Called on a thread of
  // its own, one call per prompt, several at once. Throws Error when the peer cannot (unreachable,
  // refused, died).
  virtual std::vector<uint8_t> prefill(const std::vector<int32_t>& tokens, CacheMode mode,
                                       const std::string& cache_namespace) = 0;
  // Ends every call in progress and to come with an Error (the engine is shutting down).
  virtual void stop() = 0;
};

}  // namespace dsv41
