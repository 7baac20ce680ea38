#include "io/safetensors_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <system_error>
#include <utility>

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace dsv41 {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string errno_text(int err) { return std::generic_category().message(err); }

// Validates a blob and returns its byte size: non-negative dims, no overflow, and exactly
// numel × dtype_size bytes, so every file we write passes our own reader.
uint64_t blob_nbytes(const TensorBlob& blob, const std::string& where) {
  if (blob.name.empty() || blob.name == "__metadata__") {
    fail(where, "invalid tensor name '" + blob.name + "'");
  }
  uint64_t numel = 1;
  for (int64_t d : blob.shape) {
    if (d < 0) fail(where, "tensor " + blob.name + " has a negative dimension");
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
      fail(where, "tensor " + blob.name + " shape element count overflows");
    }
  }
  uint64_t nbytes = 0;
  const bool overflow = __builtin_mul_overflow(numel, dtype_size(blob.dtype), &nbytes);
  if (blob.hole && !overflow && blob.bytes.empty()) return nbytes;
  if (overflow || nbytes != blob.bytes.size()) {
    fail(where, "tensor " + blob.name + " has " + std::to_string(blob.bytes.size()) +
                    " bytes, but its shape and dtype " + dtype_name(blob.dtype) + " need " +
                    std::to_string(numel) + " x " + std::to_string(dtype_size(blob.dtype)));
  }
  return nbytes;
}

struct Chunk {
  const void* data;  // null: a hole of `size` bytes (skipped, read back as zeros)
  size_t size;
};

// Removes the temporary file unless the write got as far as renaming it.
struct TempFile {
  std::string path;
  int fd = -1;
  bool renamed = false;
  ~TempFile() {
    if (fd >= 0) ::close(fd);
    if (!renamed) ::unlink(path.c_str());
  }
};

void fsync_dir(const std::string& dir, const std::string& path) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw FileWriteError(path, "cannot open folder " + dir + " to sync it", errno);
  // Some filesystems cannot sync a directory (EINVAL); the rename has happened either way.
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) throw FileWriteError(path, "cannot sync folder " + dir, err);
}

// Writes `chunks` back to back into `path` atomically: a reader sees either the old file or the
// complete new one, never a prefix, and after return the data survives a crash.
void write_chunks_atomic(const std::string& path, const std::vector<Chunk>& chunks) {
  const fs::path target(path);
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";
  // The temporary lives in the target folder so that rename() stays within one filesystem; mkstemp
  // picks a name no other writer, in this process or another, holds.
  TempFile tmp;
  std::string name = (fs::path(dir) / ("." + target.filename().string() + ".tmp.XXXXXX")).string();
  tmp.fd = ::mkostemp(name.data(), O_CLOEXEC);
  tmp.path = name;
  if (tmp.fd >= 0) ::fchmod(tmp.fd, 0644);  // mkstemp creates 0600; the file replaces one readable as usual
  if (tmp.fd < 0) {
    tmp.renamed = true;  // nothing was created, so there is nothing to remove
    throw FileWriteError(path, "cannot create temporary file " + tmp.path, errno);
  }
  off_t end = 0;
  for (const Chunk& c : chunks) {
    end += static_cast<off_t>(c.size);
    if (c.data == nullptr) {
      if (::lseek(tmp.fd, static_cast<off_t>(c.size), SEEK_CUR) < 0) {
        throw FileWriteError(path, "cannot seek in " + tmp.path, errno);
      }
      continue;
    }
    const char* p = static_cast<const char*>(c.data);
    size_t left = c.size;
    while (left > 0) {
      const ssize_t n = ::write(tmp.fd, p, left);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw FileWriteError(path, "cannot write " + tmp.path, errno);
      p += n;
      left -= static_cast<size_t>(n);
    }
  }
  // A trailing hole: the file ends where the data does.
  if (::ftruncate(tmp.fd, end) != 0) throw FileWriteError(path, "cannot size " + tmp.path, errno);
  if (::fsync(tmp.fd) != 0) throw FileWriteError(path, "cannot sync " + tmp.path, errno);
  const int fd = std::exchange(tmp.fd, -1);
  if (::close(fd) != 0) throw FileWriteError(path, "cannot close " + tmp.path, errno);
  if (::rename(tmp.path.c_str(), path.c_str()) != 0) {
    throw FileWriteError(path, "cannot rename " + tmp.path + " into place", errno);
  }
  tmp.renamed = true;
  fsync_dir(dir, path);  // makes the rename itself durable
}

std::string shard_name(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k, n);
  return buf;
}

}  // namespace

FileWriteError::FileWriteError(const std::string& path, const std::string& what, int error_number)
    : Error(ErrorKind::InvalidInput, path, what + ": " + errno_text(error_number)), error_number_(error_number) {}

bool FileWriteError::out_of_space() const { return error_number_ == ENOSPC || error_number_ == EDQUOT; }

void write_file_atomic(const std::string& path, const void* data, size_t size) {
  write_chunks_atomic(path, {{data, size}});
}

void write_safetensors(const std::string& path, const std::vector<const TensorBlob*>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<const TensorBlob*> sorted = tensors;
  std::sort(sorted.begin(), sorted.end(),
            [](const TensorBlob* a, const TensorBlob* b) { return a->name < b->name; });

  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const TensorBlob& t = *sorted[i];
    if (i > 0 && sorted[i - 1]->name == t.name) fail(path, "duplicate tensor name " + t.name);
    const uint64_t nbytes = blob_nbytes(t, path);
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }

  // Pad with spaces (valid JSON whitespace) so the data section starts 8-byte aligned in the file.
  std::string text = header.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));

  std::vector<Chunk> chunks = {{length, sizeof length}, {text.data(), text.size()}};
  for (const TensorBlob* t : sorted) {
    chunks.push_back({t->hole ? nullptr : t->bytes.data(), t->hole ? blob_nbytes(*t, path) : t->bytes.size()});
  }
  write_chunks_atomic(path, chunks);
}

ShardedWriter::ShardedWriter(std::string dir, uint64_t max_shard_bytes)
    : dir_(std::move(dir)), max_shard_bytes_(max_shard_bytes) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) fail(dir_, "cannot create folder: " + ec.message());
}

ShardedWriter::~ShardedWriter() {
  if (finished_) return;
  for (const std::string& tmp : temp_shards_) ::unlink(tmp.c_str());  // best effort, never throws
}

void ShardedWriter::add(TensorBlob blob) {
  if (finished_) fail(dir_, "add(" + blob.name + ") after finish()");
  const uint64_t nbytes = blob_nbytes(blob, dir_);
  if (!names_.insert(blob.name).second) fail(dir_, "duplicate tensor name " + blob.name);
  // Start a new shard when this tensor would overflow the current one; a tensor larger than the
  // limit thus ends up alone in its shard.
  if (!pending_.empty() && pending_bytes_ + nbytes > max_shard_bytes_) flush();
  pending_bytes_ += nbytes;
  total_bytes_ += nbytes;
  pending_.push_back(std::move(blob));
}

void ShardedWriter::flush() {
  if (pending_.empty()) return;
  // The final names need the shard count, known only in finish(); until then shards are hidden.
  const std::string tmp = (fs::path(dir_) / (".model-shard-" + std::to_string(temp_shards_.size() + 1) +
                                              ".tmp." + std::to_string(::getpid())))
                              .string();
  std::vector<const TensorBlob*> blobs;
  std::vector<std::string> names;
  for (const TensorBlob& b : pending_) {
    blobs.push_back(&b);
    names.push_back(b.name);
  }
  temp_shards_.push_back(tmp);  // recorded first so the destructor removes it even if the write fails
  write_safetensors(tmp, blobs);
  shard_names_.push_back(std::move(names));
  pending_.clear();
  pending_bytes_ = 0;
}

void ShardedWriter::finish() {
  if (finished_) return;
  flush();
  const size_t n = temp_shards_.size();
  json weight_map = json::object();
  for (size_t k = 0; k < n; ++k) {
    const std::string name = shard_name(k + 1, n);
    const std::string final_path = (fs::path(dir_) / name).string();
    if (::rename(temp_shards_[k].c_str(), final_path.c_str()) != 0) {
      fail(final_path, "cannot rename " + temp_shards_[k] + " into place: " + errno_text(errno));
    }
    for (const std::string& tensor : shard_names_[k]) weight_map[tensor] = name;
  }
  // The index goes last: once it exists, every shard it names is complete.
  const json index = {{"metadata", {{"total_size", total_bytes_}}}, {"weight_map", weight_map}};
  const std::string text = index.dump(2) + "\n";
  write_file_atomic((fs::path(dir_) / "model.safetensors.index.json").string(), text.data(), text.size());
  finished_ = true;
}

}  // namespace dsv41
