// Tenants of one prompt cache (vLLM's `cache_salt`): a request that carries a salt shares cached
// prefixes only with requests that carry the same salt, and a request without one only with others
// without one, so one tenant cannot learn another's prompt from a hit's speed or `cached_tokens`.
//
// The cache never holds a salt, only its namespace: a 128-bit digest of it, which the RAM tier's
// tree, the disk tier's files and their names, and a prefill server's handover all carry. The digest
// is XXH3-128 (a fast hash, not a secret-keyed one): a tenant who does not know another's salt
// cannot aim at its namespace, and one who knows it could send it anyway.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dsv41 {

// Longest salt a request may carry (vLLM recommends 43 characters of base64, 256 bits).
constexpr size_t kMaxCacheSaltBytes = 1024;

// "" for no salt (the shared namespace), else 32 lowercase hex digits.
std::string cache_namespace_of_salt(const std::string& salt);

// True for "" and for what cache_namespace_of_salt returns: what a file or a peer may name.
bool is_cache_namespace(const std::string& ns);

// The name of a prompt-cache block in KV events (runtime/kv_events.h): XXH3-64 of its tokens, seeded
// with its parent block's hash, or for a prompt's first block with a digest of the namespace. It
// depends on nothing but the tokens before and in the block and the namespace, so every process of
// the same model names the same prefix alike, and salted tenants' blocks never share a name.
uint64_t cache_block_hash(const uint64_t* parent, const std::string& ns, const int32_t* tokens, size_t count);

}  // namespace dsv41
