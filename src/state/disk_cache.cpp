#include "state/disk_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t by value instead of heap-allocated
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <nlohmann/json.hpp>

#include "io/safetensors_writer.h"
#include "io/cache_namespace.h"
#include "util/error.h"

namespace dsv41 {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Token ids, section bytes and logits are copied between memory and file as they are.
static_assert(std::endian::native == std::endian::little, "the prompt-cache format is little-endian");

namespace {

constexpr char kMagic[8] = {'D', 'S', 'V', '4', '1', 'K', 'V', 'C'};
constexpr uint64_t kPreambleBytes = 16;  // magic, version, header length
// Caps far above any real entry. They keep a corrupted count from asking for gigabytes before the
// file-size check, and keep every sum of capped values far from overflowing 64 bits.
constexpr uint64_t kMaxHeaderBytes = uint64_t{16} << 20;
constexpr int kMaxJsonDepth = 8;  // the real header is three levels deep
constexpr int64_t kMaxTokens = int64_t{1} << 28;
constexpr int64_t kMaxLogits = int64_t{1} << 24;
constexpr int64_t kMaxSections = int64_t{1} << 16;
constexpr int64_t kMaxBodyBytes = int64_t{1} << 46;
constexpr int64_t kMaxRows = int64_t{1} << 40;
constexpr int64_t kMaxLayer = int64_t{1} << 16;

// Why an entry was refused; caught at the public entry points, which turn it into `why`.
struct Rejected {
  std::string reason;
};
[[noreturn]] void reject(std::string reason) { throw Rejected{std::move(reason)}; }

std::string errno_text(int err) { return std::generic_category().message(err); }

// File content quoted in a message: short, one line, plain ASCII.
std::string printable(const std::string& s) {
  std::string out = s.substr(0, 80);
  for (char& c : out) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return out + (s.size() > 80 ? "..." : "");
}

bool is_mode(const std::string& mode) { return mode == "exact" || mode == "replay"; }

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// An open entry read strictly front to back, hashing everything it reads for the checksum. Every
// read is checked against the size fstat reported, and a short read (the file shrank) is a
// truncation too, so nothing outside the file is ever touched.
class EntryReader {
 public:
  explicit EntryReader(const std::string& path) {
    // O_NONBLOCK: a FIFO that happens to carry our extension must not hang a folder scan.
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    XXH3_64bits_reset(&hash_);
    if (fd_ < 0) reject(errno == ENOENT ? "no such file" : "cannot open: " + errno_text(errno));
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);  // the destructor does not run when the constructor throws
      reject("not a regular file");
    }
    size_ = static_cast<uint64_t>(st.st_size);
    modified_ns_ = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  }
  // An entry held in memory (a prefill server's handover): the same checks, no file.
  EntryReader(const uint8_t* data, uint64_t size) : data_(data), size_(size) { XXH3_64bits_reset(&hash_); }
  ~EntryReader() {
    if (fd_ >= 0) ::close(fd_);
  }
  EntryReader(const EntryReader&) = delete;
  EntryReader& operator=(const EntryReader&) = delete;

  uint64_t size() const { return size_; }
  int64_t modified_ns() const { return modified_ns_; }
  uint64_t digest() const { return XXH3_64bits_digest(&hash_); }

  void read(void* dst, uint64_t n, const char* what) {
    if (n > size_ - pos_) {
      reject(std::string("truncated in the ") + what + " (needs " + std::to_string(n) + " bytes at offset " +
             std::to_string(pos_) + ", file has " + std::to_string(size_) + ")");
    }
    auto* p = static_cast<uint8_t*>(dst);
    if (data_ != nullptr) std::memcpy(p, data_ + pos_, n);
    for (uint64_t done = data_ != nullptr ? n : 0; done < n;) {
      const ssize_t got = ::read(fd_, p + done, n - done);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) reject(std::string("cannot read the ") + what + ": " + errno_text(errno));
      if (got == 0) reject(std::string("truncated in the ") + what + " (file shrank while reading)");
      done += static_cast<uint64_t>(got);
    }
    XXH3_64bits_update(&hash_, dst, n);
    pos_ += n;
  }

 private:
  int fd_ = -1;
  const uint8_t* data_ = nullptr;  // in memory instead of a file
  uint64_t size_ = 0;
  int64_t modified_ns_ = 0;
  uint64_t pos_ = 0;
  XXH3_state_t hash_;
};

// The header after validation: every count capped, sections tiling the body in table order.
struct Layout {
  std::string fingerprint, mode, cache_namespace;
  int64_t tokens = 0, logits = 0, body_bytes = 0;
  std::vector<CacheSection> sections;  // bytes not read yet
  std::vector<int64_t> sizes;
};

int64_t get_int(const json& obj, const char* key, int64_t lo, int64_t hi, const std::string& what) {
  const auto it = obj.find(key);
  if (it == obj.end() || !it->is_number_integer()) reject(what + " has no integer '" + key + "'");
  // Compared in the type nlohmann parsed into: an unsigned value above INT64_MAX must not wrap.
  const bool ok = it->is_number_unsigned() ? it->get<uint64_t>() <= static_cast<uint64_t>(hi)
                                           : it->get<int64_t>() >= lo && it->get<int64_t>() <= hi;
  if (!ok) reject(what + " '" + key + "' = " + it->dump() + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return it->get<int64_t>();
}

std::string get_string(const json& obj, const char* key, const std::string& what) {
  const auto it = obj.find(key);
  if (it == obj.end() || !it->is_string()) reject(what + " has no string '" + key + "'");
  return it->get<std::string>();
}

// nlohmann's parser keeps its own stack, but 16 MiB of '[' would still build millions of nested
// values; refuse anything deeper than the real header before parsing.
bool nesting_within(const std::string& text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      in_string = escaped || c != '"';
      escaped = !escaped && c == '\\';
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

Layout parse_header(const std::string& text, uint32_t version) {
  if (!nesting_within(text, kMaxJsonDepth)) reject("header nests deeper than " + std::to_string(kMaxJsonDepth));
  const json h = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (h.is_discarded()) reject("header is not valid JSON");
  if (!h.is_object()) reject("header is not a JSON object");
  Layout l;
  l.fingerprint = get_string(h, "fingerprint", "header");
  l.mode = get_string(h, "mode", "header");
  if (!is_mode(l.mode)) reject("header mode '" + printable(l.mode) + "' is neither exact nor replay");
  // a version-2 entry belongs to a salted namespace; a version-1 entry to the shared one
  const bool has_namespace = h.contains("namespace");
  if (version == 1 && has_namespace) reject("a format version 1 header names a namespace");
  if (version == 2) {
    l.cache_namespace = get_string(h, "namespace", "header");
    if (l.cache_namespace.empty() || !is_cache_namespace(l.cache_namespace)) {
      reject("header namespace '" + printable(l.cache_namespace) + "' is not 32 lowercase hex digits");
    }
  }
  l.tokens = get_int(h, "tokens", 0, kMaxTokens, "header");
  l.logits = get_int(h, "logits", 0, kMaxLogits, "header");
  l.body_bytes = get_int(h, "body_bytes", 0, kMaxBodyBytes, "header");
  const auto table = h.find("sections");
  if (table == h.end() || !table->is_array()) reject("header has no 'sections' array");
  if (table->size() > static_cast<size_t>(kMaxSections)) reject("header lists too many sections");
  int64_t next = 0;  // where the next section must start
  for (size_t i = 0; i < table->size(); ++i) {
    const json& s = (*table)[i];
    const std::string what = "section " + std::to_string(i);
    if (!s.is_object()) reject(what + " is not a JSON object");
    CacheSection sec;
    sec.name = get_string(s, "name", what);
    if (sec.name.empty()) reject(what + " has an empty name");
    sec.layer = static_cast<int32_t>(get_int(s, "layer", -1, kMaxLayer, what));
    sec.rows = get_int(s, "rows", 0, kMaxRows, what);
    const int64_t offset = get_int(s, "offset", 0, kMaxBodyBytes, what);
    const int64_t size = get_int(s, "size", 0, kMaxBodyBytes, what);
    if (offset + size > l.body_bytes) reject(what + " lies outside the body of " + std::to_string(l.body_bytes) + " bytes");
    if (offset < next) reject(what + " overlaps the section before it");
    if (offset > next) reject(what + " leaves a gap before it");
    next = offset + size;
    l.sections.push_back(std::move(sec));
    l.sizes.push_back(size);
  }
  if (next != l.body_bytes) reject("sections cover " + std::to_string(next) + " of " + std::to_string(l.body_bytes) + " body bytes");
  return l;
}

// Preamble, header and token ids: all a folder scan needs. Checks that the layout adds up to
// exactly the file's size before allocating anything the header asks for.
Layout read_front(EntryReader& r, const std::string& expected_fingerprint, std::vector<int32_t>* tokens) {
  uint8_t pre[kPreambleBytes];
  r.read(pre, sizeof pre, "preamble");
  if (std::memcmp(pre, kMagic, sizeof kMagic) != 0) reject("bad magic: not a dsv41 prompt-cache entry");
  const uint32_t version = load<uint32_t>(pre + 8);
  if (version < 1 || version > kCacheFormatVersion) {
    reject("format version " + std::to_string(version) + ", this build reads 1 to " + std::to_string(kCacheFormatVersion));
  }
  const uint32_t header_bytes = load<uint32_t>(pre + 12);
  if (header_bytes > kMaxHeaderBytes) reject("header length " + std::to_string(header_bytes) + " exceeds the 16 MiB cap");
  std::string text(header_bytes, '\0');
  r.read(text.data(), header_bytes, "header");
  Layout l = parse_header(text, version);
  const uint64_t expected = kPreambleBytes + header_bytes + 4 * static_cast<uint64_t>(l.tokens) +
                            static_cast<uint64_t>(l.body_bytes) + 4 * static_cast<uint64_t>(l.logits) + 8;
  if (expected > r.size()) {
    reject("truncated: header describes " + std::to_string(expected) + " bytes, file has " + std::to_string(r.size()));
  }
  if (expected < r.size()) reject(std::to_string(r.size() - expected) + " trailing bytes after the checksum");
  if (l.fingerprint != expected_fingerprint) {
    reject("written for a different model (fingerprint '" + printable(l.fingerprint) + "', expected '" +
           printable(expected_fingerprint) + "')");
  }
  tokens->resize(static_cast<size_t>(l.tokens));
  r.read(tokens->data(), 4 * tokens->size(), "token ids");
  for (size_t i = 0; i < tokens->size(); ++i) {
    if ((*tokens)[i] < 0) reject("token id at position " + std::to_string(i) + " is negative");
  }
  return l;
}

}  // namespace

std::vector<uint8_t> encode_cache_entry(const CacheEntry& entry, const std::string& path) {
  // Refuse here whatever the reader would refuse, so every file written can be read back.
  if (!is_mode(entry.mode)) fail(path, "cache mode '" + entry.mode + "' is neither exact nor replay");
  if (!is_cache_namespace(entry.cache_namespace)) fail(path, "cache namespace is not 32 lowercase hex digits");
  if (entry.tokens.size() > kMaxTokens || entry.last_logits.size() > kMaxLogits || entry.sections.size() > kMaxSections) {
    fail(path, "cache entry has more tokens, logits or sections than the format allows");
  }
  if (std::any_of(entry.tokens.begin(), entry.tokens.end(), [](int32_t t) { return t < 0; })) {
    fail(path, "negative token id in a cache entry");
  }
  json table = json::array();
  uint64_t body = 0;
  for (const CacheSection& s : entry.sections) {
    if (s.name.empty()) fail(path, "cache section with an empty name");
    if (s.layer < -1 || s.layer > kMaxLayer || s.rows < 0 || s.rows > kMaxRows) {
      fail(path, "section " + s.name + " has layer or rows out of range");
    }
    table.push_back({{"name", s.name}, {"layer", s.layer}, {"rows", s.rows}, {"offset", body}, {"size", s.bytes.size()}});
    body += s.bytes.size();
    if (body > static_cast<uint64_t>(kMaxBodyBytes)) fail(path, "cache sections exceed the format's size cap");
  }
  json header = {{"fingerprint", entry.model_fingerprint}, {"mode", entry.mode},
                 {"tokens", entry.tokens.size()},          {"logits", entry.last_logits.size()},
                 {"body_bytes", body},                     {"sections", std::move(table)}};
  // An entry of the shared namespace is written as version 1, which builds that predate namespaces
  // share too; a salted one as version 2, which they refuse rather than serve it to every tenant.
  const uint32_t version = entry.cache_namespace.empty() ? 1 : 2;
  if (version == 2) header["namespace"] = entry.cache_namespace;
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception&) {  // a fingerprint or section name that is not UTF-8
    fail(path, "cache entry strings must be valid UTF-8");
  }
  if (text.size() > kMaxHeaderBytes) fail(path, "cache entry header exceeds the 16 MiB cap");

  // write_file_atomic takes one buffer, so the file is assembled in memory first.
  std::vector<uint8_t> file;
  file.reserve(kPreambleBytes + text.size() + 4 * entry.tokens.size() + body + 4 * entry.last_logits.size() + 8);
  const auto append = [&file](const void* p, size_t n) {
    file.insert(file.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
  };
  const uint32_t preamble[2] = {version, static_cast<uint32_t>(text.size())};
  append(kMagic, sizeof kMagic);
  append(preamble, sizeof preamble);
  append(text.data(), text.size());
  append(entry.tokens.data(), 4 * entry.tokens.size());
  for (const CacheSection& s : entry.sections) append(s.bytes.data(), s.bytes.size());
  append(entry.last_logits.data(), 4 * entry.last_logits.size());
  const uint64_t checksum = XXH3_64bits(file.data(), file.size());
  append(&checksum, sizeof checksum);
  return file;
}

uint64_t write_cache_entry(const std::string& path, const CacheEntry& entry) {
  const std::vector<uint8_t> file = encode_cache_entry(entry, path);
  write_file_atomic(path, file.data(), file.size());
  return file.size();
}

namespace {

// The whole entry from `r`, verified; Rejected for anything wrong.
CacheEntry read_entry(EntryReader& r, const std::string& expected_fingerprint) {
  CacheEntry e;
  Layout l = read_front(r, expected_fingerprint, &e.tokens);
  for (size_t i = 0; i < l.sections.size(); ++i) {
    l.sections[i].bytes.resize(static_cast<size_t>(l.sizes[i]));
    r.read(l.sections[i].bytes.data(), l.sections[i].bytes.size(), "section bytes");
  }
  e.last_logits.resize(static_cast<size_t>(l.logits));
  r.read(e.last_logits.data(), 4 * e.last_logits.size(), "logits");
  const uint64_t computed = r.digest();
  uint8_t stored[8];
  r.read(stored, sizeof stored, "checksum");
  if (load<uint64_t>(stored) != computed) reject("checksum mismatch: the file is corrupted");
  e.model_fingerprint = std::move(l.fingerprint);
  e.mode = std::move(l.mode);
  e.cache_namespace = std::move(l.cache_namespace);
  e.sections = std::move(l.sections);
  return e;
}

}  // namespace

std::optional<CacheEntry> read_cache_entry(const std::string& path, const std::string& expected_fingerprint,
                                           std::string* why) {
  try {
    EntryReader r(path);
    CacheEntry e = read_entry(r, expected_fingerprint);
    if (why) why->clear();
    return e;
  } catch (const Rejected& r) {
    if (why) *why = path + ": " + r.reason;
    return std::nullopt;
  }
}

std::optional<CacheEntry> decode_cache_entry(const uint8_t* data, size_t size, const std::string& expected_fingerprint,
                                             const std::string& what, std::string* why) {
  try {
    EntryReader r(data, size);
    CacheEntry e = read_entry(r, expected_fingerprint);
    if (why) why->clear();
    return e;
  } catch (const Rejected& r) {
    if (why) *why = what + ": " + r.reason;
    return std::nullopt;
  }
}

std::vector<CacheIndexItem> scan_cache_dir(const std::string& dir, const std::string& expected_fingerprint,
                                           std::vector<std::string>* warnings) {
  const auto warn = [warnings](std::string w) {
    if (warnings) warnings->push_back(std::move(w));
  };
  std::vector<CacheIndexItem> items;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) {
    warn(dir + ": cannot list the prompt-cache folder: " + ec.message());
    return items;
  }
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    const fs::path& p = it->path();
    // Temporary files of an unfinished write start with '.' and do not carry the extension.
    if (p.extension() != kCacheFileExtension || p.filename().string().front() == '.') continue;
    try {
      EntryReader r(p.string());
      CacheIndexItem item;
      item.path = p.string();
      const Layout l = read_front(r, expected_fingerprint, &item.tokens);
      item.mode = l.mode;
      item.cache_namespace = l.cache_namespace;
      item.file_bytes = r.size();
      item.modified_ns = r.modified_ns();
      items.push_back(std::move(item));
    } catch (const Rejected& r) {
      warn(p.string() + ": " + r.reason + " (skipped)");
    }
  }
  if (ec) warn(dir + ": listing the prompt-cache folder stopped early: " + ec.message());
  std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.path < b.path; });
  return items;
}

bool is_cache_temporary_name(const std::string& name) {
  // write_file_atomic names its temporary "." + the target's name + ".tmp." + what mkstemp fills in
  // (earlier builds used other suffixes; any suffix after ".tmp." counts).
  const std::string infix = std::string(kCacheFileExtension) + ".tmp.";
  const size_t at = name.find(infix);
  return at != std::string::npos && at > 1 && name.front() == '.' && name.size() > at + infix.size();
}

std::vector<std::string> remove_stale_cache_temporaries(const std::string& dir, std::chrono::seconds min_age,
                                                        std::vector<std::string>* warnings) {
  std::vector<std::string> removed;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) return removed;  // nothing to clean; a folder that cannot be listed is reported by the scan
  const auto now = fs::file_time_type::clock::now();
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!is_cache_temporary_name(name)) continue;
    std::error_code e;
    if (!it->is_regular_file(e)) continue;
    const auto modified = it->last_write_time(e);
    // A writer keeps its temporary's time fresh until the rename; an old one was left by a crash.
    if (e || now - modified < min_age) continue;
    if (fs::remove(it->path(), e)) {
      removed.push_back(it->path().string());
    } else if (e && warnings) {
      warnings->push_back(it->path().string() + ": cannot remove this stale temporary file: " + e.message());
    }
  }
  return removed;
}

std::string cache_file_name(const std::string& fingerprint, const std::string& mode,
                            const std::vector<int32_t>& tokens, const std::string& cache_namespace) {
  // Each string is prefixed by its length so that ("ab", "c") and ("a", "bc") hash differently; the
  // shared namespace adds nothing, so its names are those of the builds before namespaces.
  XXH3_state_t h;
  XXH3_64bits_reset(&h);
  for (const std::string* s : {&fingerprint, &mode, &cache_namespace}) {
    if (s == &cache_namespace && s->empty()) continue;
    const uint64_t length = s->size();
    XXH3_64bits_update(&h, &length, sizeof length);
    XXH3_64bits_update(&h, s->data(), s->size());
  }
  XXH3_64bits_update(&h, tokens.data(), 4 * tokens.size());
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(XXH3_64bits_digest(&h)));
  return hex + std::string(kCacheFileExtension);
}

}  // namespace dsv41
