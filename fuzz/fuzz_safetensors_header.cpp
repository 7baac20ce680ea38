// libFuzzer target for the safetensors header parser. Each input is tried two ways:
//   1. as a whole file image (8-byte length, header, data), through the same code SafetensorsFile uses;
//   2. as a bare header, against a data section whose size comes from the input length, so that
//      both tight ranges and near-2^64 ranges (offset arithmetic overflow) are exercised.
// dsv41::Error is the expected outcome for bad input; any other exception, a sanitizer report, or a
// parsed header that breaks the documented guarantees is a bug and aborts.
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <set>
#include <string_view>

#include "io/safetensors_header.h"
#include "util/error.h"

namespace {

void check(bool ok) {
  if (!ok) std::abort();
}

// What parse_safetensors_header promises about a header it accepts.
void check_invariants(const dsv41::SafetensorsHeader& h, uint64_t data_size) {
  std::set<std::string_view> names;
  const dsv41::TensorInfo* prev = nullptr;
  uint64_t furthest_end = 0;
  for (const dsv41::TensorInfo& t : h.tensors) {
    check(names.insert(t.name).second);
    check(dsv41::dtype_from_name(dsv41::dtype_name(t.dtype)) == t.dtype);
    check(t.begin <= t.end && t.end <= data_size);
    if (prev) check(prev->begin <= t.begin);  // sorted by offset
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      check(d >= 0);
      check(!__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel));
    }
    check(t.end - t.begin == numel * dsv41::dtype_size(t.dtype));
    if (t.begin != t.end) {
      check(t.begin >= furthest_end);  // no overlap with any earlier non-empty tensor
      furthest_end = t.end;
    }
    prev = &t;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const dsv41::SafetensorsImage image = dsv41::parse_safetensors_image(data, size, "fuzz.safetensors");
    check(image.data_start >= 8 && image.data_start <= size);
    check_invariants(image.header, size - image.data_start);
  } catch (const dsv41::Error&) {
  }

  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const uint64_t data_size = size % 2 ? std::numeric_limits<uint64_t>::max() : uint64_t{size} * 16;
  try {
    check_invariants(dsv41::parse_safetensors_header(text, data_size, "fuzz.json"), data_size);
  } catch (const dsv41::Error&) {
  }
  return 0;
}
