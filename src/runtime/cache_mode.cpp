#include "runtime/cache_mode.h"

#include "util/error.h"

namespace dsv41 {

CacheMode parse_cache_mode(const std::string& text) {
  if (text == "exact") return CacheMode::Exact;
  if (text == "replay") return CacheMode::Replay;
  fail("--cache-mode", "must be exact or replay, got \"" + text + "\"");
}

const char* cache_mode_name(CacheMode mode) { return mode == CacheMode::Exact ? "exact" : "replay"; }

const char* cache_source_name(CacheSource source) {
  switch (source) {
    case CacheSource::None: return "none";
    case CacheSource::Ram: return "ram";
    case CacheSource::Disk: return "disk";
    case CacheSource::Peer: return "peer";
  }
  return "none";
}

}  // namespace dsv41
