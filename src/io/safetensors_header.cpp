// Parsing and validation of the safetensors JSON header. Everything here treats its input as
// untrusted (it is the libFuzzer target's code under test): every check happens before a value is
// used, integer arithmetic is overflow-checked, and no JSON value is ever dumped back (dumping is
// recursive, and a hostile header can nest arbitrarily deep).
#include "io/safetensors_header.h"

#include <algorithm>
#include <limits>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace dsv41 {

using json = nlohmann::json;

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::BF16: return 2;
    case DType::F32: return 4;
    case DType::F8_E4M3: return 1;
    case DType::F8_E8M0: return 1;
    case DType::I8: return 1;
  }
  return 0;  // unreachable for valid enumerators
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::BF16: return "BF16";
    case DType::F32: return "F32";
    case DType::F8_E4M3: return "F8_E4M3";
    case DType::F8_E8M0: return "F8_E8M0";
    case DType::I8: return "I8";
  }
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (DType d : {DType::BF16, DType::F32, DType::F8_E4M3, DType::F8_E8M0, DType::I8}) {
    if (name == dtype_name(d)) return d;
  }
  return std::nullopt;
}

namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

[[noreturn]] void tensor_fail(const std::string& file, const std::string& name, const std::string& what) {
  fail(file, "tensor " + name + ": " + what);
}

// A JSON integer as an unsigned value. nlohmann stores non-negative literals as number_unsigned and
// negative ones as number_integer; literals beyond 64 bits become floats and are rejected here.
enum class IntKind { kNotInteger, kNegative, kOk };
IntKind read_uint(const json& j, uint64_t& out) {
  if (j.is_number_unsigned()) {
    out = j.get<uint64_t>();
    return IntKind::kOk;
  }
  if (j.is_number_integer()) {
    const int64_t v = j.get<int64_t>();
    if (v < 0) return IntKind::kNegative;
    out = static_cast<uint64_t>(v);
    return IntKind::kOk;
  }
  return IntKind::kNotInteger;
}

// Parses with a callback that remembers the first key repeated within one object: nlohmann keeps
// only the last of duplicate keys, which would silently hide a duplicated tensor.
json parse_rejecting_duplicates(std::string_view text, const std::string& file) {
  std::vector<std::unordered_set<std::string>> open_objects;  // keys seen per enclosing object
  std::string duplicate;
  size_t duplicate_depth = 0;
  auto callback = [&](int, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start: open_objects.emplace_back(); break;
      case json::parse_event_t::object_end: open_objects.pop_back(); break;
      case json::parse_event_t::key:
        if (!open_objects.back().insert(parsed.get<std::string>()).second && duplicate_depth == 0) {
          duplicate = parsed.get<std::string>();
          duplicate_depth = open_objects.size();
        }
        break;
      default: break;
    }
    return true;
  };
  json root;
  try {
    root = json::parse(text.begin(), text.end(), callback);
  } catch (const json::exception& e) {
    fail(file, std::string("bad JSON in header: ") + e.what());
  }
  if (duplicate_depth == 1) fail(file, "duplicate tensor name " + duplicate + " in header");
  if (duplicate_depth > 1) fail(file, "duplicate key '" + duplicate + "' in header");
  return root;
}

std::map<std::string, std::string> parse_metadata(const json& j, const std::string& file) {
  if (!j.is_object()) fail(file, "__metadata__ is not an object");
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : j.items()) {
    if (!value.is_string()) fail(file, "__metadata__ value for '" + key + "' is not a string");
    out.emplace(key, value.get<std::string>());
  }
  return out;
}

TensorInfo parse_entry(const std::string& name, const json& entry, uint64_t data_size,
                       const std::string& file) {
  TensorInfo t;
  t.name = name;
  if (name.empty()) fail(file, "empty tensor name in header");
  if (!entry.is_object()) tensor_fail(file, name, "entry is not an object");
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(key)) tensor_fail(file, name, std::string("missing ") + key);
  }

  const json& dtype = entry.at("dtype");
  if (!dtype.is_string()) tensor_fail(file, name, "dtype is not a string");
  const auto parsed_dtype = dtype_from_name(dtype.get_ref<const std::string&>());
  if (!parsed_dtype) {
    fail(file, "unsupported dtype '" + dtype.get<std::string>() + "' for tensor " + name);
  }
  t.dtype = *parsed_dtype;

  // numel must not wrap around. Zero-size dims are legal, but the product of the other dims must
  // still fit in int64 because code computes strides from them.
  const json& shape = entry.at("shape");
  if (!shape.is_array()) tensor_fail(file, name, "shape is not an array");
  uint64_t stride_bound = 1;
  bool has_zero = false;
  for (const json& dim : shape) {
    uint64_t d = 0;
    switch (read_uint(dim, d)) {
      case IntKind::kNotInteger: tensor_fail(file, name, "shape has a dimension that is not an integer");
      case IntKind::kNegative: tensor_fail(file, name, "shape has a negative dimension");
      case IntKind::kOk: break;
    }
    if (d == 0) has_zero = true;
    if (__builtin_mul_overflow(stride_bound, std::max<uint64_t>(d, 1), &stride_bound) ||
        stride_bound > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      tensor_fail(file, name, "shape element count overflows 64 bits");
    }
    t.shape.push_back(static_cast<int64_t>(d));
  }
  const uint64_t numel = has_zero ? 0 : stride_bound;  // an empty shape is a scalar: 1 element
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, dtype_size(t.dtype), &nbytes)) {
    tensor_fail(file, name, "byte size overflows 64 bits");
  }

  const json& offsets = entry.at("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2) {
    tensor_fail(file, name, "data_offsets must be an array of 2 integers");
  }
  for (size_t i = 0; i < 2; ++i) {
    if (read_uint(offsets[i], i == 0 ? t.begin : t.end) != IntKind::kOk) {
      tensor_fail(file, name, "data_offsets must be non-negative integers");
    }
  }
  if (t.begin > t.end) {
    tensor_fail(file, name, "data_offsets [" + std::to_string(t.begin) + "," + std::to_string(t.end) +
                                "] are reversed");
  }
  if (t.end > data_size) {
    tensor_fail(file, name, "data_offsets [" + std::to_string(t.begin) + "," + std::to_string(t.end) +
                                "] out of range: the data section is " + std::to_string(data_size) +
                                " bytes");
  }
  if (t.end - t.begin != nbytes) {
    tensor_fail(file, name, "byte span mismatch: shape " + shape_string(t.shape) + " x " +
                                dtype_name(t.dtype) + " is " + std::to_string(nbytes) +
                                " bytes but data_offsets span " + std::to_string(t.end - t.begin));
  }
  return t;
}

}  // namespace

SafetensorsHeader parse_safetensors_header(std::string_view text, uint64_t data_size,
                                           const std::string& file) {
  if (text.empty()) fail(file, "empty header");
  const json root = parse_rejecting_duplicates(text, file);
  if (!root.is_object()) fail(file, "header is not a JSON object");

  SafetensorsHeader header;
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      header.metadata = parse_metadata(value, file);
    } else {
      header.tensors.push_back(parse_entry(key, value, data_size, file));
    }
  }

  // Sort by offset (name breaks ties between empty tensors) so overlap is a neighbour check.
  std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
  });
  // Overlapping spans are rejected: two tensors aliasing the same bytes is corruption. Gaps and
  // trailing bytes are accepted (the reference format is contiguous, but padding is harmless and
  // some writers align tensors). Empty tensors occupy no bytes, so they cannot overlap anything.
  const TensorInfo* furthest = nullptr;  // the non-empty tensor reaching furthest so far
  for (const TensorInfo& t : header.tensors) {
    if (t.begin == t.end) continue;
    if (furthest && t.begin < furthest->end) {
      fail(file, "tensors " + furthest->name + " and " + t.name + " overlap in the data section");
    }
    if (!furthest || t.end > furthest->end) furthest = &t;
  }
  return header;
}

SafetensorsImage parse_safetensors_image(const uint8_t* bytes, size_t size, const std::string& file) {
  if (size < 8) {
    fail(file, "file is " + std::to_string(size) +
                   " bytes, shorter than the 8-byte header length (truncated)");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];  // little-endian regardless of host
  if (n == 0) fail(file, "header length is 0 (empty header)");
  if (n > size - 8) {
    fail(file, "header length " + std::to_string(n) + " is longer than the file (" +
                   std::to_string(size - 8) + " bytes after the length; truncated?)");
  }
  if (n > kMaxSafetensorsHeaderBytes) {
    fail(file, "header length " + std::to_string(n) + " exceeds the limit of " +
                   std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  SafetensorsImage image;
  image.data_start = 8 + n;
  const std::string_view text(reinterpret_cast<const char*>(bytes + 8), static_cast<size_t>(n));
  image.header = parse_safetensors_header(text, size - image.data_start, file);
  return image;
}

}  // namespace dsv41
