// The safetensors JSON header, parsed and validated on its own so that it can be fuzzed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dsv41 {

// The dtypes of the released checkpoint. I8 holds packed E2M1 pairs for the routed experts.
enum class DType : uint8_t { BF16, F32, F8_E4M3, F8_E8M0, I8 };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);  // the safetensors spelling, e.g. "F8_E4M3"
std::optional<DType> dtype_from_name(std::string_view name);

struct TensorInfo {
  std::string name;
  DType dtype = DType::BF16;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // sorted by begin offset
  std::map<std::string, std::string> metadata;  // "__metadata__", string values only
};

// Parses and validates a header for a data section of `data_size` bytes. `file` names the file in
// errors. Rejects: bad JSON, a non-object, unknown dtype, malformed shape/offsets, shape×dtype size
// different from the byte span, spans past the data section, overlapping spans, duplicate names.
SafetensorsHeader parse_safetensors_header(std::string_view json, uint64_t data_size,
                                           const std::string& file);

// The largest header accepted (as the reference implementation does), so a corrupt length cannot
// make us parse hundreds of megabytes of garbage.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// A whole file image split into its parsed header and the start of its data section.
struct SafetensorsImage {
  SafetensorsHeader header;
  uint64_t data_start = 0;  // 8 + header length
};

// Checks the 8-byte little-endian length prefix of `size` bytes at `bytes` (truncated file, zero or
// oversized header length) and parses the header against the remaining bytes as the data section.
SafetensorsImage parse_safetensors_image(const uint8_t* bytes, size_t size, const std::string& file);

}  // namespace dsv41
