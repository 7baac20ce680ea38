// What both sides of the expert-parallel exchange derive alike from what they both hold: which token
// rows a rank's experts need, and the wire form of a row (bf16 bits: every value exchanged is a bf16
// value held in a float, so the bits are exact and the bytes half).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/op_types.h"

namespace dsv41 {

// The distinct tokens of the dispatch entries of experts [first, end), ascending.
std::vector<int64_t> tokens_of_experts(const MoeDispatch& d, int64_t first, int64_t end);

// Appends rows `tokens` of x [*, dim] as bf16 bits to `out`.
void append_bf16_rows(const float* x, int64_t dim, const std::vector<int64_t>& tokens, std::vector<uint16_t>& out);
// n values of bf16 bits into floats.
void bf16_to_floats(const uint16_t* in, int64_t n, float* out);
void floats_to_bf16(const float* in, int64_t n, uint16_t* out);

}  // namespace dsv41
