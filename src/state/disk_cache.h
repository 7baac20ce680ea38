// The on-disk prompt-cache entry: the state of a sequence after a prefix of tokens, so that a later
// process can skip that prefix's prefill (model-spec §5). What goes in is decided by the caller
// (global KV always; window rings and compressor tails only for "exact" entries); this file only
// stores named byte sections and guarantees that whatever comes back out is exactly what went in.
//
// Layout (all integers little-endian):
//   "DSV41KVC"  u32 version  u32 header_length  header (JSON, header_length bytes)
//   token ids (i32 × tokens)  body (sections back to back, in table order)  logits (f32 × logits)
//   XXH3-64 of every byte before it (u64)
// The JSON header holds fingerprint, mode, tokens, logits, body_bytes and the section table
// (name, layer, rows, offset, size; offsets relative to the body). Version 1 is an entry of the
// shared namespace; version 2 adds the header's "namespace", a salted one's (io/cache_namespace.h).
// The reader trusts none of it: every count is capped and the whole layout must add up to exactly
// the file's size.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dsv41 {

struct CacheSection {  // one state class of one owner layer, as raw bytes
  std::string name;    // e.g. "main_kv", "index_keys", "window", "compressor_tail", "engram_recent", "window_from"
  int32_t layer = -1;  // -1: not tied to a layer
  int64_t rows = 0;    // rows held (for per-token classes), informational for fixed ones
  std::vector<uint8_t> bytes;
};

struct CacheEntry {
  std::string model_fingerprint;  // config identity: a different model must never reuse an entry
  std::string mode;               // "exact" or "replay"
  std::string cache_namespace;    // "" or a cache salt's digest: shared only with the same salt
  std::vector<int32_t> tokens;    // the cached prefix
  std::vector<CacheSection> sections;
  std::vector<float> last_logits;  // logits at the prefix's last position (may be empty)
};

constexpr uint32_t kCacheFormatVersion = 2;  // the newest this build reads and writes
constexpr const char* kCacheFileExtension = ".dsv41kv";

// Writes atomically (temp file in the same folder, fsync, rename) and returns the bytes written.
// Throws Error for an entry the reader would refuse (unknown mode, empty section name, counts
// beyond the format's caps) or when the file cannot be written.
uint64_t write_cache_entry(const std::string& path, const CacheEntry& entry);

// The bytes write_cache_entry puts in a file (the same checks; `path` only names the entry in an
// Error), for moving an entry without a file (a prefill server's handover to a decode server).
std::vector<uint8_t> encode_cache_entry(const CacheEntry& entry, const std::string& path);
// Verifies and reads entry bytes as read_cache_entry does a file; `what` names them in *why.
std::optional<CacheEntry> decode_cache_entry(const uint8_t* data, size_t size, const std::string& expected_fingerprint,
                                             const std::string& what, std::string* why);

// Reads and verifies an entry. Returns std::nullopt and sets *why (if given) to a one-line reason
// naming the file for anything wrong: missing, truncated, bad magic, other version, header not JSON
// or inconsistent, checksum mismatch, or a fingerprint other than `expected_fingerprint`.
// Never throws for bad file content and never reads outside the file.
std::optional<CacheEntry> read_cache_entry(const std::string& path, const std::string& expected_fingerprint,
                                           std::string* why);

// Reads only header and tokens of every "*.dsv41kv" file directly in `dir`, with the same checks as
// read_cache_entry except the checksum (the full read verifies it). Files that fail, including
// entries for another model, are skipped with a warning. Items come sorted by path.
struct CacheIndexItem {
  std::string path;
  std::vector<int32_t> tokens;
  std::string mode;
  std::string cache_namespace;
  uint64_t file_bytes = 0;
  int64_t modified_ns = 0;  // the file's modification time: its place in a least-recently-used order
};
std::vector<CacheIndexItem> scan_cache_dir(const std::string& dir, const std::string& expected_fingerprint,
                                           std::vector<std::string>* warnings);

// True for the name of a temporary file write_cache_entry makes (through write_file_atomic) while it
// writes an entry: "." + the entry's name + ".tmp." + a unique suffix.
bool is_cache_temporary_name(const std::string& name);

// Removes the temporary files of unfinished writes directly in `dir` that were last modified at least
// `min_age` ago: a crash leaves them behind, while a live writer (this process or another) renames its
// own within moments. Returns the paths removed; a file it cannot remove adds a warning.
std::vector<std::string> remove_stale_cache_temporaries(const std::string& dir, std::chrono::seconds min_age,
                                                        std::vector<std::string>* warnings);

// File name for a prefix: 16 hex digits of an XXH3-64 over fingerprint, mode, namespace and tokens,
// plus kCacheFileExtension. Stable across processes and versions of this code.
std::string cache_file_name(const std::string& fingerprint, const std::string& mode,
                            const std::vector<int32_t>& tokens, const std::string& cache_namespace = {});

}  // namespace dsv41
