// Writing safetensors checkpoints (make-tiny, tests). Files are written to a temporary name in the
// target folder, fsynced and renamed, so a reader never sees a half-written file.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "io/safetensors_header.h"
#include "util/error.h"

namespace dsv41 {

struct TensorBlob {
  std::string name;
  DType dtype = DType::BF16;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // exactly numel × dtype_size bytes (checked on write)
  // No bytes: the data is a hole of numel × dtype_size bytes in a sparse file, read back as zeros
  // (the released layout at full size without its data: make-tiny --preset released-sparse).
  bool hole = false;
};

// Writes one safetensors file atomically. Tensors are laid out in name order, header padded with
// spaces to a multiple of 8 bytes (as the reference writer does).
void write_safetensors(const std::string& path, const std::vector<const TensorBlob*>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Streams tensors into shards of at most `max_shard_bytes` of data each (a single larger tensor gets
// a shard of its own) and, on finish(), renames them model-0000k-of-0000N.safetensors and writes
// model.safetensors.index.json ({"metadata": {"total_size": ...}, "weight_map": {...}}).
class ShardedWriter {
 public:
  ShardedWriter(std::string dir, uint64_t max_shard_bytes);
  ~ShardedWriter();  // removes temporary shards if finish() was never called
  void add(TensorBlob blob);
  void finish();

 private:
  void flush();
  std::string dir_;
  uint64_t max_shard_bytes_;
  std::vector<TensorBlob> pending_;
  uint64_t pending_bytes_ = 0;
  std::vector<std::string> temp_shards_;
  std::vector<std::vector<std::string>> shard_names_;  // tensor names per shard
  std::set<std::string> names_;  // every tensor added, to reject duplicates across shards
  uint64_t total_bytes_ = 0;
  bool finished_ = false;
};

// What the atomic writes throw when the system refuses a step: an Error naming the file, with the
// errno, so that a caller can tell a full disk (which freeing space may cure) from the rest.
class FileWriteError : public Error {
 public:
  FileWriteError(const std::string& path, const std::string& what, int error_number);
  int error_number() const { return error_number_; }
  // No space left on the file system (ENOSPC) or the quota spent (EDQUOT).
  bool out_of_space() const;

 private:
  int error_number_;
};

// Atomic whole-file write of text or bytes: temp file in the same folder, fsync, rename, fsync folder.
// A step the system refuses throws FileWriteError, and the temporary file is removed.
void write_file_atomic(const std::string& path, const void* data, size_t size);

}  // namespace dsv41
