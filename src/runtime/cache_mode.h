// How the prefix cache restores a cached prefix (runtime/prefix_cache.h says what each keeps).
#pragma once

#include <string>

namespace dsv41 {

enum class CacheMode { Exact, Replay };
CacheMode parse_cache_mode(const std::string& text);  // "exact" | "replay"
const char* cache_mode_name(CacheMode mode);

}  // namespace dsv41
