// Sparse attention for one query (model-spec §3.1 "sparse_attn"; the port's sparse_attn,
// K41:296-403). The chunking and the running max are part of the numerics: P is rounded to bf16
// relative to the max of the chunks seen so far, so the list is walked in order, 64 entries at a time.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cascade_sum.h"
#include "kernels/kv_rows.h"
#include "kernels/reference.h"
#include "kernels/torch_math.h"
#include "numeric/formats.h"

// The reference's roundings are the fp32 operations as written (see linear.cpp).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace dsv41 {

namespace {

constexpr size_t kChunk = 64;  // K41:328 `block`
// The kernel's finite floor for the running max (K41:352-355): a chunk with no valid entry then has
// rescale factor exp(0) = 1 and p = exp(-inf) = 0, so it leaves the state unchanged, where -inf
// would give exp(-inf - -inf) = NaN.
constexpr float kMaxFloor = -1e30f;

float dot(const float* a, const float* b, int64_t d) {
  float acc = 0.0f;  // bf16·bf16 products are exact in fp32
  for (int64_t i = 0; i < d; ++i) {
    const float prod = a[i] * b[i];
    acc += prod;
  }
  return acc;
}

}  // namespace

namespace reference {

void sparse_attention(const float* q, int64_t heads, int64_t d, const KvRows& packed, const float* sink, float scale,
                      float* out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // The rows decoded once for every head: the values the reference's dequantized K=V hold.
  std::vector<float> values(static_cast<size_t>(packed.size() * d));
  std::vector<const float*> rows(static_cast<size_t>(packed.size()), nullptr);
  for (int64_t j = 0; j < packed.size(); ++j) {
    const uint8_t* row = kv_row(packed, j);
    if (row == nullptr) continue;
    decode_kv_row(kv_row_format(packed, j), row, d, &values[j * d]);
    rows[j] = &values[j * d];
  }
  std::vector<float> acc(d), chunk_acc(d);
  float scores[kChunk], probs[kChunk];
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * d;
    float running_max = kMaxFloor;
    float sum = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (size_t t = 0; t < rows.size(); t += kChunk) {
      const size_t len = std::min(kChunk, rows.size() - t);
      // Logits: q·k in fp32 (-inf for an empty slot), then times the scale: where(...) * scale.
      float chunk_max = neg_inf;
      for (size_t j = 0; j < len; ++j) {
        const float* row = rows[t + j];
        const float logit = row != nullptr ? dot(qh, row, d) : neg_inf;
        scores[j] = logit * scale;
        chunk_max = std::max(chunk_max, scores[j]);
      }
      const float new_max = std::max(running_max, chunk_max);
      const float rescale = torch_exp(running_max - new_max);
      // The denominator takes the fp32 probabilities, the chunk's sum in torch's order (p.sum(),
      // cascade_sum.h, empty slots as zeros); P·V takes them rounded to bf16 (K41:377). exp is
      // torch's (torch_math.h): with a correctly rounded exp a sequential sum happened to give the
      // goldens' bits, with torch's exp only torch's order does.
      for (size_t j = 0; j < len; ++j) probs[j] = torch_exp(scores[j] - new_max);
      const float chunk_sum = cascade_sum_of(probs, static_cast<int64_t>(len));
      std::fill(chunk_acc.begin(), chunk_acc.end(), 0.0f);
      for (size_t j = 0; j < len; ++j) {
        const float* row = rows[t + j];
        if (row == nullptr) continue;  // a zeroed row with p = 0 adds exactly nothing
        const float p = round_bf16(probs[j]);
        for (int64_t i = 0; i < d; ++i) {
          const float prod = p * row[i];  // bf16·bf16: exact products
          chunk_acc[i] += prod;
        }
      }
      // sum_exp * scale + p.sum(); acc_o * scale + P·V — rescale first, then add the chunk's part.
      const float kept_sum = sum * rescale;
      sum = kept_sum + chunk_sum;
      for (int64_t i = 0; i < d; ++i) {
        const float kept = acc[i] * rescale;
        acc[i] = kept + chunk_acc[i];
      }
      running_max = new_max;
    }
    // The sink joins the denominator unscaled (K41:382-383). With no valid entry at all the max is
    // still -1e30, exp(sink + 1e30) = inf and the output is 0 / inf = 0.
    sum = sum + torch_exp(sink[h] - running_max);
    float* oh = out + h * d;
    for (int64_t i = 0; i < d; ++i) oh[i] = round_bf16(acc[i] / sum);
  }
}

}  // namespace reference

}  // namespace dsv41
