#include "io/cache_namespace.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>

namespace dsv41 {

std::string cache_namespace_of_salt(const std::string& salt) {
  if (salt.empty()) return "";
  // a prefix of its own, so the digest of a salt is never that of some other use of the same bytes
  const std::string keyed = "dsv41 prompt-cache salt\n" + salt;
  const XXH128_hash_t h = XXH3_128bits(keyed.data(), keyed.size());
  char hex[33];
  std::snprintf(hex, sizeof hex, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return hex;
}

uint64_t cache_block_hash(const uint64_t* parent, const std::string& ns, const int32_t* tokens, size_t count) {
  uint64_t seed = 0;
  if (parent != nullptr) {
    seed = *parent;
  } else {
    const std::string root = "dsv41 prompt-cache root\n" + ns;
    seed = XXH3_64bits(root.data(), root.size());
  }
  return XXH3_64bits_withSeed(tokens, count * sizeof(int32_t), seed);
}

bool is_cache_namespace(const std::string& ns) {
  return ns.empty() || (ns.size() == 32 && std::all_of(ns.begin(), ns.end(), [](char c) {
                          return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
                        }));
}

}  // namespace dsv41
