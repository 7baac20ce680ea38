// CPU kernels of the V4.1 forward pass, in the reference's numerics (model-spec §3.1; the reference's
// kernel port, K41 line references). Activations are fp32 arrays; where the reference holds a tensor
// in bf16, the values stored here are bf16-representable (rounded with round_bf16).
// These are the scalar reference versions; faster versions must match them (see tests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dsv41 {

// ---- weight views (zero-copy into the checkpoint mapping) ---------------------------------------
// A copy of a matrix re-laid in tiles of rows for the SIMD kernels (kernels/packed_weights.h), or
// none (tile_rows == 0): the kernels then read the row-major view.
struct PackedView {
  const uint8_t* tiles = nullptr;      // [tile][column][tile_rows] elements
  const uint8_t* scales = nullptr;     // FP4 only: [tile][k/32][tile_rows] E8M0 codes
  const uint8_t* nan_tiles = nullptr;  // FP8 only: 1 where the tile holds a NaN code
  int tile_rows = 0;
  int64_t tile_bytes = 0, scale_tile_bytes = 0;
  // The rows from row0 on (a sub-matrix such as one group of wo_a); none unless row0 starts a tile.
  PackedView from_row(int64_t row0) const;
};
struct Fp8Matrix {  // F8_E4M3 [n, k], F8_E8M0 scale [ceil(n/32), ceil(k/32)]
  const uint8_t* w = nullptr;
  const uint8_t* scale = nullptr;
  int64_t n = 0, k = 0;
  PackedView packed{};
};
struct Fp4Matrix {  // I8 [n, k/2] packed E2M1 (low nibble = even k), F8_E8M0 scale [n, k/32]
  const uint8_t* w = nullptr;
  const uint8_t* scale = nullptr;
  int64_t n = 0, k = 0;
  PackedView packed{};
};
struct Bf16Matrix {  // BF16 [n, k]
  const uint16_t* w = nullptr;
  int64_t n = 0, k = 0;
  PackedView packed{};
};

// ---- linear layers: y[m, n] = x[m, k] · Wᵀ --------------------------------------------------------
// FP8 weight (W8A8): x is act_quant'ed to FP8 per 32 with power-of-two scales, then
// y = Σ_kblock (A_k·B_kᵀ)·a_s·b_s accumulated in fp32 in K order, rounded to bf16.
void linear_fp8(const float* x, int64_t m, const Fp8Matrix& w, float* y);
// FP4 expert weight (W4A8): the same with E2M1 weights and per-row, per-32 E8M0 scales.
void linear_fp4(const float* x, int64_t m, const Fp4Matrix& w, float* y);
// BF16 weight, bf16 activation (torch F.linear in bf16): fp32 accumulation, output rounded to bf16.
void linear_bf16(const float* x, int64_t m, const Bf16Matrix& w, float* y);
// BF16 weight promoted to fp32, fp32 activation, fp32 output (router, head, ratio-2 compressor).
void linear_f32(const float* x, int64_t m, const Bf16Matrix& w, float* y);

// ---- normalisation and rotary ------------------------------------------------------------------
// y = w · (x · rsqrt(mean(x²) + eps)), all in fp32, one rounding to bf16 when round_to_bf16.
void rms_norm(const float* x, int64_t n, const uint16_t* weight_bf16, float eps, float* y, bool round_to_bf16);

// Rotary frequencies for one layer: f_i = 1/base^(2i/dim) in fp32, with YaRN when original_seq_len > 0
// (model-spec §3.1, "Frequencies"). cos/sin are taken of the fp32 angle fp32(pos)·f_i.
// YaRN's ramp ends for `rope_dim` lanes, evaluated in double as the reference's python does:
// corr(r) = dim·ln(orig/(r·2π)) / (2·ln base), low = max(floor(corr(beta_fast)), 0),
// high = min(ceil(corr(beta_slow)), dim − 1). For base 160000, dim 64, orig 65536, betas 32/1: 15, 25.
struct YarnRange {
  int64_t low = 0, high = 0;
};
YarnRange yarn_range(int64_t rope_dim, int64_t original_seq_len, double base, double beta_fast, double beta_slow);

class RopeTable {
 public:
  RopeTable(int64_t rope_dim, int64_t original_seq_len, double base, double factor, double beta_fast,
            double beta_slow);
  int64_t dim() const { return dim_; }
  const std::vector<float>& freqs() const { return freqs_; }
  // Rotates x[0..dim) in place at position pos: interleaved pairs (x[2i], x[2i+1]) as complex numbers,
  // multiplied in fp32 by (cos, sin) (conjugate when inverse), rounded to bf16 once.
  void apply(float* x, int64_t pos, bool inverse) const;

 private:
  int64_t dim_;
  std::vector<float> freqs_;
};

// ---- attention ----------------------------------------------------------------------------------
// sparse_attn for one query (K41:296-403): q[h·d] (bf16 values), rows[j] a pointer to one shared
// K=V row of d values or nullptr for index -1, walked in chunks of 64 in list order with an online
// softmax whose running max starts at -1e30; P is rounded to bf16 (relative to the running max)
// before P·V; the denominator sums fp32 P and gets exp(sink_h − max), the sink not scaled.
// out[h·d] is rounded to bf16.
void sparse_attention(const float* q, int64_t heads, int64_t d, const std::vector<const float*>& rows,
                      const float* sink, float scale, float* out);

// ---- hyper-connections --------------------------------------------------------------------------
// hc_split_sinkhorn (K41:406-458) for one token: mixes[(2+hc)·hc] -> pre[hc], post[hc], comb[hc·hc]
// (comb[j·hc + k]: row j = source copy, column k = destination copy).
void hc_split_sinkhorn(const float* mixes, const float* scale3, const float* base, int hc, int iters,
                       float eps, float* pre, float* post, float* comb);

// ---- selection ----------------------------------------------------------------------------------
// Indices of the k largest scores (ties broken toward the lower index), returned in ascending index
// order, as the reference's topk(sorted=False) followed by a sort. -inf entries can be selected when
// fewer than k are finite (the caller maps unreachable ones to -1).
std::vector<int32_t> topk_ascending(const float* scores, int64_t n, int64_t k);

// Level one of the two-level selection (the reference's select_candidate_blocks) for one query:
// pad `scores` (n compressed rows, -inf where not visible) to whole blocks of `block_size`, score each
// block by its best row, pin the block holding the newest visible row (`visible` rows are visible;
// none is pinned when it is 0), keep the best `topk_blocks` blocks whose score is not -inf. Returns the
// kept block ids in ascending order (block b holds rows b·block_size ..).
std::vector<int32_t> select_candidate_blocks(const float* scores, int64_t n, int64_t visible, int64_t topk_blocks,
                                             int64_t block_size);

}  // namespace dsv41
