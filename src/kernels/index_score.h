// Indexer scores over packed FP4 index keys (model-spec §3.3 step 4, the reference's bf16 indexer).
//
// For query i and key row t, with q[i] = nh heads of K values (already FP4 quantize-dequantized) and
// w[i] = nh head weights (bf16 values):
//   for h in order: dot = Σ_e q[i][h][e]·key_t[e]   (fp32, one chain in e order, mul then add)
//                   dot = max(bf16(dot), 0)
//                   sum = sum + bf16(dot·w[i][h])    (sum starts at 0)
//   score = bf16(sum)
// key_t is decoded from its packed row (pack_index_key_row's layout: K/2 bytes of E2M1 pairs, low
// nibble = even element, then K/32 E8M0 scales) as e2m1·scale in fp32, the value unpack_index_key_row
// gives. Every level computes these chains exactly as written, so all give the same bits (a NaN's
// sign and payload aside: they depend on the operand order of an add, which no level promises).
#pragma once

#include <cstdint>

namespace dsv41 {

// scores[i·n_keys + t] for i < nq, t < n_keys; -inf where t >= visible[i] (a key the query cannot see
// yet; it is not computed). q: [nq, nh, K]; weights: [nq, nh]; keys: n_keys row pointers; K a
// positive multiple of 32. Runs at the active ISA level, on the kernel thread pool when large.
void index_scores(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                  const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores);

namespace detail {

// The scalar reference (single-threaded) and the fast versions (each needs its ISA: isa_supported;
// on a build without x86 SIMD they run the reference). The tests compare them directly.
void index_scores_scalar(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                         const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores);
void index_scores_avx2(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                       const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores);
void index_scores_avx512(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                         const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores);

// Below this many multiply-adds (nq·n_keys·nh·K) a call stays on the calling thread: waking the pool
// costs more than it saves.
constexpr int64_t kIndexScoreParallelWork = int64_t{1} << 20;

}  // namespace detail

}  // namespace dsv41
