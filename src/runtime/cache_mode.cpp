#include "runtime/cache_mode.h"

#include "util/error.h"

namespace dsv41 {

CacheMode parse_cache_mode(const std::string& text) {
  if (text == "exact") return CacheMode::Exact;
  if (text == "replay") return CacheMode::Replay;
  fail("--cache-mode", "must be exact or replay, got \"" + text + "\"");
}

const char* cache_mode_name(CacheMode mode) { return mode == CacheMode::Exact ? "exact" : "replay"; }

}  // namespace dsv41
