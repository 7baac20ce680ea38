// The arguments of the backend's ops (kernels/backend.h): weight views and the small structures that
// describe rows. Activations are fp32 arrays; where the reference holds a tensor in bf16, the values
// stored are bf16-representable (rounded with round_bf16).
#pragma once

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

// The three matrices of a SwiGLU expert: w2 · (silu(w1·x) · (w3·x)).
template <class Matrix>
struct ExpertMatrices {
  Matrix w1, w2, w3;
};

// ---- rotary -------------------------------------------------------------------------------------
// Rotary frequencies for one layer: f_i = 1/base^(2i/dim) in fp32, with YaRN when original_seq_len > 0
// (model-spec §3.1, "Frequencies"). The table is data the rope op reads.
// YaRN's ramp ends for `rope_dim` lanes, evaluated in double as the reference's python does:
// corr(r) = dim·ln(orig/(r·2π)) / (2·ln base), low = max(floor(corr(beta_fast)), 0),
// high = min(ceil(corr(beta_slow)), dim − 1). For base 160000, dim 64, orig 65536, betas 32/1: 15, 25.
struct YarnRange {
  int64_t low = 0, high = 0;
};
YarnRange yarn_range(int64_t rope_dim, int64_t original_seq_len, double base, double beta_fast, double beta_slow);

class RopeTable {
 public:
  RopeTable(int64_t rope_dim, int64_t original_seq_len, double base, double factor, double beta_fast, double beta_slow);
  int64_t dim() const { return dim_; }
  const std::vector<float>& freqs() const { return freqs_; }

 private:
  int64_t dim_;
  std::vector<float> freqs_;
};

// Rows rotated by the rope op: the rope lanes of row r are x[r·stride .. r·stride + table.dim()),
// rotated at position first + (r / rows_per_position)·step (the heads of one token share a position).
struct RotaryRows {
  float* x = nullptr;
  int64_t rows = 0, stride = 0;
  int64_t rows_per_position = 1;
  int64_t first = 0, step = 1;
};

// ---- attention ----------------------------------------------------------------------------------
// Which of several equal scores a top-k selection keeps (the indexer's top-k, the candidate blocks).
// torch.topk leaves it unspecified, and equal scores are common (bf16 and FP4-rounded keys).
enum class TopkTies {
  // A total order: the lower index first. A selection then depends only on the scores, not on how
  // many entries the row has, so chunked prefill, decode and speculative verification pick the
  // same rows as a one-shot prefill (the serving default).
  LowerIndexFirst,
  // What torch's CPU kernel keeps (kernels/select.cpp): the reference's own rows, bit for bit on the
  // goldens, but dependent on the row's width, so its prefill and decode may differ, as the
  // reference's do.
  Torch,
};

// The packed row formats of the per-sequence state (numeric/row_codecs.h).
enum class KvFormat {
  Window,    // sliding-window KV: E4M3 + E8M0 per 32
  MainKv,    // compressed main KV: E2M1 + E4M3 per 16
  IndexKey,  // index keys: E2M1 + E8M0 per 32
};

// The shared K=V rows one query attends over, in list order: `window` rows (KvFormat::Window),
// then `compressed` rows (KvFormat::MainKv), read packed as the state holds them. A null entry is
// an empty slot (the reference's index -1).
struct KvRows {
  const uint8_t* const* window = nullptr;
  int64_t n_window = 0;
  const uint8_t* const* compressed = nullptr;
  int64_t n_compressed = 0;
  int64_t size() const { return n_window + n_compressed; }
};

// ---- mHC ----------------------------------------------------------------------------------------
struct HcShape {
  int64_t hc = 4, dim = 0;
  float norm_eps = 0.0f;  // inside the rsqrt of the mixes
  int sinkhorn_iters = 20;
  float hc_eps = 1e-6f;
  int64_t width() const { return hc * dim; }           // values per token
  int64_t mix_count() const { return (2 + hc) * hc; }  // dot products per token
};

// One sublayer's mix weights, fp32: fn[(2+hc)·hc, hc·dim], scale[3], base[(2+hc)·hc].
struct HcMixWeights {
  const float* fn = nullptr;
  const float* scale = nullptr;
  const float* base = nullptr;
};

// Per-token coefficients of one sublayer: pre[count·hc], post[count·hc], comb[count·hc·hc]
// (comb[j·hc + k]: row j = source copy, column k = destination copy).
struct HcCoefficients {
  const float* pre = nullptr;
  const float* post = nullptr;
  const float* comb = nullptr;
};
struct HcCoefficientsOut {
  float* pre = nullptr;
  float* post = nullptr;
  float* comb = nullptr;
};

// ---- MoE ----------------------------------------------------------------------------------------
enum class ScoreFunction { Softmax, Sigmoid, SqrtSoftplus };

struct RouterParams {
  int64_t experts = 0, k = 0;  // routed experts, experts per token
  ScoreFunction score = ScoreFunction::SqrtSoftplus;
  float temperature = 1.0f;  // logits are divided by it first
  bool norm_topk = true;     // renormalise the k weights (when k > 1)
  float route_scale = 1.0f;  // then scale them
};

// Tokens grouped by the experts they chose, experts in ascending order, each expert's tokens in
// token order: expert e's entries are [offsets[e], offsets[e + 1]).
struct MoeDispatch {
  std::vector<int64_t> offsets;  // [experts + 1]
  std::vector<int64_t> token;    // per entry: the token's row
  std::vector<float> weight;     // per entry: its routing weight
  int64_t entries() const { return static_cast<int64_t>(token.size()); }
};

}  // namespace dsv41
