// How the prefix cache restores a cached prefix (runtime/prefix_cache.h says what each keeps), where a
// restored prefix came from, and how much disk the cache's files may take by default.
#pragma once

#include <cstdint>
#include <string>

namespace dsv41 {

enum class CacheMode { Exact, Replay };
CacheMode parse_cache_mode(const std::string& text);  // "exact" | "replay"
const char* cache_mode_name(CacheMode mode);

// Where a prompt's cached prefix came from: nowhere, the RAM tier, the disk tier, or a prefill
// server's handover (serve --role decode).
enum class CacheSource { None, Ram, Disk, Peer };
const char* cache_source_name(CacheSource source);  // "none", "ram", "disk", "peer"

// The prompt-cache folder's default budget: 8 GiB holds about 9.6 million tokens of the released model's
// global KV (890 B/token) — some ninety 100k-token prompts with their exact-mode windows — while
// staying a small share of a serving machine's disk. Past it the least recently used files go.
constexpr uint64_t kDefaultPromptCacheDiskBytes = uint64_t{8} << 30;

}  // namespace dsv41
