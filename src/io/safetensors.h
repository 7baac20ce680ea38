// Memory-mapped safetensors checkpoints: one file, or shards listed by model.safetensors.index.json.
// Tensors are zero-copy views into the mapping. Every malformed input is rejected with an Error that
// names the file (and tensor) and the problem; nothing is read outside the mapped bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "io/safetensors_header.h"

namespace dsv41 {

// A read-only memory mapping of a whole file (empty files are rejected by the safetensors layer).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);  // throws Error naming the path
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// A tensor inside a mapped file.
struct TensorView {
  const TensorInfo* info = nullptr;
  const uint8_t* data = nullptr;  // first byte of the tensor
  const std::string* file = nullptr;  // path of the file holding it
  uint64_t file_offset = 0;  // byte offset of `data` within `file`, for readers that bypass the mapping
  const std::string& name() const { return info->name; }
  DType dtype() const { return info->dtype; }
  const std::vector<int64_t>& shape() const { return info->shape; }
  size_t nbytes() const { return static_cast<size_t>(info->end - info->begin); }
  int64_t numel() const;
};

// One safetensors file: 8-byte little-endian header length, JSON header, data section.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  const std::string& path() const { return map_.path(); }
  const std::vector<TensorInfo>& infos() const { return infos_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorView* find(std::string_view name) const;

 private:
  MappedFile map_;
  std::vector<TensorInfo> infos_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, TensorView, std::less<>> views_;
};

// A model folder (model.safetensors.index.json + shards, or a single model.safetensors) or one file.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& path);
  const std::string& path() const { return path_; }
  size_t tensor_count() const { return views_.size(); }
  std::vector<std::string> names() const;
  const TensorView* find(std::string_view name) const;
  // 16 hex digits that tell this checkpoint's contents from another's with the same config (a
  // fine-tune, another seed): XXH3 over every tensor's name, dtype, shape and size, in name order,
  // and its first and last 32 bytes of data. It reads at most two pages per tensor, not the weights.
  std::string fingerprint() const;
  // The tensor, or Error "<checkpoint>: missing tensor NAME".
  const TensorView& get(std::string_view name) const;
  // get() plus a dtype and shape check against what the config implies:
  // Error "<file>: tensor NAME has shape [..] dtype X, the config expects [..] Y".
  const TensorView& expect(std::string_view name, DType dtype, const std::vector<int64_t>& shape) const;

 private:
  std::string path_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*, std::less<>> views_;
};

}  // namespace dsv41
