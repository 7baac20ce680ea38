#include "state/cache_folder.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <system_error>

#include "io/safetensors_writer.h"
#include "util/error.h"

namespace dsv41 {

namespace fs = std::filesystem;

namespace {

// A writer renames its temporary moments after its last write, so one untouched for a minute was left
// by a crash. Younger ones may belong to another process writing into the same folder.
constexpr std::chrono::seconds kStaleTemporaryAge{60};

std::string errno_text(int err) { return std::generic_category().message(err); }

}  // namespace

CacheFolder::CacheFolder(std::string dir, std::string fingerprint, std::string mode, uint64_t budget_bytes,
                         Log log_sink, Writer writer)
    : dir_(std::move(dir)), fingerprint_(std::move(fingerprint)), mode_(std::move(mode)), budget_(budget_bytes),
      log_(std::move(log_sink)), write_(std::move(writer)) {
  if (!write_) {
    write_ = [](const std::string& path, const std::vector<uint8_t>& bytes) {
      write_file_atomic(path, bytes.data(), bytes.size());
    };
  }
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_, ec)) {
    fail(dir_, "cannot create the prompt-cache folder: " + (ec ? ec.message() : "a file of that name is in the way"));
  }
  std::vector<std::string> warnings;
  counts_.temporaries_removed = remove_stale_cache_temporaries(dir_, kStaleTemporaryAge, &warnings).size();
  std::vector<CacheIndexItem> found = scan_cache_dir(dir_, fingerprint_, &warnings);
  for (const std::string& w : warnings) log(w);
  // Entries of the other mode are good files for another configuration: left alone, not counted.
  found.erase(std::remove_if(found.begin(), found.end(), [&](const CacheIndexItem& i) { return i.mode != mode_; }),
              found.end());
  // The modification times order what earlier processes used (a restore refreshes a file's time).
  std::stable_sort(found.begin(), found.end(),
                   [](const CacheIndexItem& a, const CacheIndexItem& b) { return a.modified_ns < b.modified_ns; });
  for (CacheIndexItem& f : found) {
    Item& item = items_[fs::path(f.path).filename().string()];
    item.path = std::move(f.path);
    item.tokens = std::move(f.tokens);
    item.cache_namespace = std::move(f.cache_namespace);
    item.bytes = f.file_bytes;
    item.last_use = ++clock_;
    bytes_ += item.bytes;
  }
  const uint64_t before = items_.size();
  evict_to_budget();
  if (items_.size() < before) {
    log(dir_ + ": removed the " + std::to_string(before - items_.size()) +
        " least recently used prompt-cache entries to fit the budget of " + std::to_string(budget_) + " bytes");
  }
}

void CacheFolder::log(const std::string& line) const {
  if (log_) {
    log_(line);
  } else {
    std::fprintf(stderr, "dsv41: prompt cache: %s\n", line.c_str());
  }
}

CacheFolder::Stats CacheFolder::stats() const {
  Stats s = counts_;
  s.files = items_.size();
  s.bytes = bytes_;
  return s;
}

std::optional<CacheEntry> CacheFolder::read(const std::string& name) {
  const auto it = items_.find(name);
  if (it == items_.end()) return std::nullopt;
  Item& item = it->second;
  std::string why;
  std::optional<CacheEntry> entry = read_cache_entry(item.path, fingerprint_, &why);
  if (!entry) {
    forget(name, why);
    return std::nullopt;
  }
  // The caller chose this entry by the tokens indexed: a file replaced meanwhile must not stand in.
  if (entry->mode != mode_ || entry->tokens != item.tokens || entry->cache_namespace != item.cache_namespace) {
    forget(name, item.path + ": holds another prefix than when the folder was indexed");
    return std::nullopt;
  }
  item.last_use = ++clock_;
  // Best effort: the file's time carries its recent use over to the next process's order.
  static_cast<void>(::utimensat(AT_FDCWD, item.path.c_str(), nullptr, 0));
  return entry;
}

void CacheFolder::reject(const std::string& name, const std::string& reason) {
  const auto it = items_.find(name);
  if (it != items_.end()) forget(name, it->second.path + ": " + reason);
}

void CacheFolder::forget(const std::string& name, const std::string& why) {
  log(why + "; skipped: a request that would have used it computes its prefix instead");
  const auto it = items_.find(name);
  bytes_ -= it->second.bytes;
  items_.erase(it);
}

uint64_t CacheFolder::store(const CacheEntry& entry) {
  uint64_t least = 4 * (entry.tokens.size() + entry.last_logits.size());
  for (const CacheSection& s : entry.sections) least += s.bytes.size();
  if (least > budget_) {  // could only be evicted again at once
    if (!warned_too_big_) {
      log(dir_ + ": a prompt-cache entry of at least " + std::to_string(least) + " bytes exceeds the budget of " +
          std::to_string(budget_) + " bytes; prefixes that large are not stored on disk");
    }
    warned_too_big_ = true;
    return 0;
  }
  const std::string name = cache_file_name(entry.model_fingerprint, entry.mode, entry.tokens, entry.cache_namespace);
  const std::string path = dir_ + "/" + name;
  uint64_t written = 0;
  try {
    std::error_code ec;
    if (fs::create_directories(dir_, ec)) {  // removed while we ran: nothing indexed is there any more
      log(dir_ + ": the prompt-cache folder was gone and has been made again");
      items_.clear();
      bytes_ = 0;
    }
    const std::vector<uint8_t> bytes = encode_cache_entry(entry, path);
    write_making_room(name, path, bytes);  // a folder that cannot be made fails here, naming the file
    written = bytes.size();
  } catch (const std::exception& e) {
    ++counts_.write_failures;
    if (writing_) {
      log(std::string(e.what()) + "; requests go on without storing their prefixes on disk until writes work again");
    }
    writing_ = false;
    return 0;
  }
  if (!writing_) {
    log(dir_ + ": prompt-cache writes work again (" + std::to_string(counts_.write_failures) + " failed so far)");
  }
  writing_ = true;
  Item& item = items_[name];
  bytes_ = bytes_ - item.bytes + written;  // the same prefix stored again replaces its file
  item.path = path;
  item.tokens = entry.tokens;
  item.cache_namespace = entry.cache_namespace;
  item.bytes = written;
  item.last_use = ++clock_;
  evict_to_budget();
  return items_.count(name) ? written : 0;
}

void CacheFolder::write_making_room(const std::string& name, const std::string& path, const std::vector<uint8_t>& bytes) {
  try {
    write_(path, bytes);
    disk_full_ = false;
    return;
  } catch (const FileWriteError& e) {
    if (!e.out_of_space()) throw;
    ++counts_.disk_full;
    // The disk is full (of this folder's entries or of anything else): the least recently used entries
    // make room for this one, the most recent, and the write is tried once more. A second refusal goes
    // to the caller, which gives the entry up.
    uint64_t files = 0, freed = 0;
    while (freed < bytes.size() && !items_.empty()) {
      freed += evict_least_recent();
      ++files;
    }
    if (files == 0) throw;
    if (!disk_full_) {
      log(dir_ + ": the disk is full (" + errno_text(e.error_number()) + "); removed " + std::to_string(files) +
          " least recently used prompt-cache entries (" + std::to_string(freed) + " bytes) to store " + name +
          " (logged once until a write finds room again)");
    }
    disk_full_ = true;
  }
  write_(path, bytes);
}

uint64_t CacheFolder::evict_least_recent() {
  const auto oldest = std::min_element(items_.begin(), items_.end(), [](const auto& a, const auto& b) {
    return a.second.last_use < b.second.last_use;
  });
  const Item& item = oldest->second;
  // Gone already (another process evicted it, or the folder was cleared): forgotten all the same.
  if (::unlink(item.path.c_str()) != 0 && errno != ENOENT) {
    log(item.path + ": cannot remove this prompt-cache entry to make room: " + errno_text(errno));
  }
  const uint64_t freed = item.bytes;
  bytes_ -= freed;
  items_.erase(oldest);
  ++counts_.evictions;
  return freed;
}

void CacheFolder::evict_to_budget() {
  while (bytes_ > budget_ && !items_.empty()) evict_least_recent();
}

}  // namespace dsv41
