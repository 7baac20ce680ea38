#include "parallel/exchange.h"

#include <algorithm>

#include "numeric/formats.h"

namespace dsv41 {

std::vector<int64_t> tokens_of_experts(const MoeDispatch& d, int64_t first, int64_t end) {
  std::vector<int64_t> tokens(d.token.begin() + d.offsets[static_cast<size_t>(first)],
                              d.token.begin() + d.offsets[static_cast<size_t>(end)]);
  std::sort(tokens.begin(), tokens.end());
  tokens.erase(std::unique(tokens.begin(), tokens.end()), tokens.end());
  return tokens;
}

void append_bf16_rows(const float* x, int64_t dim, const std::vector<int64_t>& tokens, std::vector<uint16_t>& out) {
  const size_t at = out.size();
  out.resize(at + tokens.size() * static_cast<size_t>(dim));
  for (size_t i = 0; i < tokens.size(); ++i) floats_to_bf16(x + tokens[i] * dim, dim, &out[at + i * static_cast<size_t>(dim)]);
}

void bf16_to_floats(const uint16_t* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(in[i]);
}

void floats_to_bf16(const float* in, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_from_f32(in[i]);
}

}  // namespace dsv41
