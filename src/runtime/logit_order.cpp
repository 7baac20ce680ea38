#include "runtime/logit_order.h"

#include <array>
#include <cstring>
#include <utility>

namespace dsv41 {

namespace {

// A key whose ascending unsigned order is the logits' descending order: IEEE floats compare as
// sign-magnitude integers, so flipping every bit of a negative and the sign bit of a positive gives
// ascending order, and the complement of that descending. -0 is folded onto +0 first.
uint32_t descending_key(float logit) {
  uint32_t b;
  std::memcpy(&b, &logit, sizeof b);
  if ((b & 0x7fffffffu) == 0) b = 0;
  const uint32_t ascending = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return ~ascending;
}

}  // namespace

void LogitOrder::sort(const float* logits, int64_t vocab, std::vector<int32_t>& order) {
  const size_t n = vocab > 0 ? static_cast<size_t>(vocab) : 0;
  keys_.resize(n);
  keys_tmp_.resize(n);
  order.resize(n);
  order_tmp_.resize(n);
  std::array<std::array<size_t, 256>, 4> count{};
  for (size_t i = 0; i < n; ++i) {
    const uint32_t k = descending_key(logits[i]);
    keys_[i] = k;
    order[i] = static_cast<int32_t>(i);
    for (int pass = 0; pass < 4; ++pass) ++count[pass][(k >> (8 * pass)) & 0xffu];
  }
  // Least significant byte first; each pass is stable, so equal keys keep ascending ids. A pass whose
  // byte is the same for every key moves nothing and is skipped.
  std::vector<int32_t>* src_order = &order;
  std::vector<int32_t>* dst_order = &order_tmp_;
  for (int pass = 0; pass < 4; ++pass) {
    std::array<size_t, 256>& c = count[pass];
    bool trivial = false;
    for (size_t b = 0; b < 256 && !trivial; ++b) trivial = c[b] == n;
    if (trivial) continue;
    size_t offset = 0;
    for (size_t b = 0; b < 256; ++b) offset += std::exchange(c[b], offset);
    const int shift = 8 * pass;
    for (size_t i = 0; i < n; ++i) {
      const size_t at = c[(keys_[i] >> shift) & 0xffu]++;
      keys_tmp_[at] = keys_[i];
      (*dst_order)[at] = (*src_order)[i];
    }
    keys_.swap(keys_tmp_);
    std::swap(src_order, dst_order);
  }
  if (src_order != &order) order.swap(order_tmp_);
}

}  // namespace dsv41
