// The backend: the model's math as ops behind one interface. A Backend is made for one kernel level
// and owns what the ops run on — its worker pool, each worker's scratch, the allocator for packed
// weights and state pages — so two backends (levels, thread counts) can live in one process. The
// model calls ops only; nothing here is global.
//
// Every op has one scalar reference (kernels/reference.h) in the reference's numerics (model-spec
// §3; K41 = the reference's kernel port, line numbers). The base class runs the references; a
// faster level overrides the ops it has kernels for and must give the same bits, which
// tests/ops_test.cpp checks op by op against the reference for every level the machine runs.
//
// A new backend: a subclass overriding what it accelerates, one entry in backend_levels()
// (backend.cpp), and the op harness tests it (docs/backend.md).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/allocator.h"
#include "kernels/cpu_features.h"
#include "kernels/exec.h"
#include "kernels/op_types.h"
#include "kernels/packed_weights.h"

namespace dsv41 {

struct BackendOptions {
  std::optional<Isa> level;  // default: default_isa(), the fastest level this machine runs
  int threads = 0;           // 0: one per hardware thread
  // Re-lay the weight matrices at load for the SIMD kernels (packed_weights.h): twice the decode
  // speed, at the cost of load time and of a second copy of the weights while they load.
  bool pack_weights = true;
};

class Backend {
 public:
  virtual ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  Isa level() const { return level_; }
  const char* name() const { return isa_name(level_); }
  // The unit the indexer's scores run on: "avx512_vnni_int8" where an AVX-512 level computes them in
  // integers (index_score_vnni.cpp), else "fp32". The bits are the same either way.
  virtual const char* index_score_unit() const { return "fp32"; }
  int threads() const { return pool_.threads(); }
  const Exec& exec() const { return exec_; }
  Allocator& allocator() const { return allocator_; }

  // ---- weights ----------------------------------------------------------------------------------
  // Rows per packed tile the linear ops read, 0 when they read the checkpoint's row-major layout.
  int weight_tile_rows() const { return options_.pack_weights ? tile_rows_ : 0; }
  // The packed copy of a matrix for this backend's linear ops (null when weight_tile_rows() is 0),
  // in memory from allocator(); it must outlive every view that points into it.
  std::unique_ptr<PackedWeights> pack(const Fp8Matrix& w) const;
  std::unique_ptr<PackedWeights> pack(const Fp4Matrix& w) const;
  std::unique_ptr<PackedWeights> pack(const Bf16Matrix& w) const;

  // ---- linear layers: y[m, n] = x[m, k] · Wᵀ, one row (a decode step) or many --------------------
  // Summation order, which every level reproduces bit for bit (model-spec §3.1 fixes only "fp32 in K
  // order" between blocks):
  //  * fp8 / fp4: per output, per 32-block, partial = ((0 + p0) + p1) + … + p31 in k order (each p = a·w
  //    exact in fp32), then acc = acc + (partial·a_s)·w_s over blocks in k order; rounded to bf16.
  //  * bf16 / f32: acc = ((0 + p0) + p1) + … in k order, one chain per output.
  // FP8 weight (W8A8): x is act_quant'ed to FP8 per 32 with power-of-two scales first.
  virtual void linear_fp8(const float* x, int64_t m, const Fp8Matrix& w, float* y) const;
  // FP4 expert weight (W4A8): the same with E2M1 weights and per-row, per-32 E8M0 scales.
  virtual void linear_fp4(const float* x, int64_t m, const Fp4Matrix& w, float* y) const;
  // BF16 weight, bf16 activation (torch F.linear in bf16): fp32 accumulation, output rounded to bf16.
  virtual void linear_bf16(const float* x, int64_t m, const Bf16Matrix& w, float* y) const;
  // BF16 weight promoted to fp32, fp32 activation, fp32 output (router, head, ratio-2 compressor).
  virtual void linear_f32(const float* x, int64_t m, const Bf16Matrix& w, float* y) const;

  // ---- norms, rotary, quantized rows --------------------------------------------------------------
  // Each of `rows` rows of n: y = w · (x · rsqrt(mean(x²) + eps)) in fp32, rounded to bf16 when asked.
  // mean(x²) is the fp32 sum of the rounded squares in torch's cascade (cascade_sum.h), divided by n.
  virtual void rms_norm(const float* x, int64_t rows, int64_t n, const uint16_t* weight_bf16, float eps, float* y,
                        bool round_to_bf16) const;
  // Interleaved pairs (x[2i], x[2i+1]) of each row's rope lanes as complex numbers times
  // (cos, sin) of the fp32 angle fp32(pos)·f_i (conjugate when inverse), each product rounded, one
  // bf16 rounding per value.
  virtual void rope(const RopeTable& table, const RotaryRows& rows, bool inverse) const;
  // Quantizes `rows` rows of `dim` into the packed format (the reference's quantize-dequantize: same
  // codes, same scales); row r goes to out[r].
  virtual void pack_kv_rows(KvFormat format, const float* x, int64_t rows, int64_t dim, uint8_t* const* out) const;

  // ---- compressed attention -----------------------------------------------------------------------
  // The compressor's pooling of one group (model-spec §3.3 step 3): per channel, softmax over the
  // group's `ratio` gate scores (max subtracted, fp32), the weighted sum of their rows, bf16.
  // kv, score: [ratio, dim]; out: [dim].
  virtual void compressor_pool(const float* kv, const float* score, int64_t ratio, int64_t dim, float* out) const;
  // The indexer's queries for scoring (model-spec §3.3 step 4), after their RoPE: each query's
  // heads·dim values FP4 quantize-dequantized (E8M0 per 32), each head weight round_bf16(w·head_scale).
  virtual void quantize_index_queries(float* q, float* weights, int64_t count, int64_t heads, int64_t dim,
                                      float head_scale) const;
  // Indexer scores over packed FP4 index keys (the reference's bf16 indexer). For query i, key t:
  //   for h in order: dot = Σ_e q[i][h][e]·key_t[e]   (fp32, one chain in e order, mul then add)
  //                   dot = max(bf16(dot), 0); sum = sum + bf16(dot·w[i][h])   (sum starts at 0)
  //   score = bf16(sum)
  // scores[i·n_keys + t] for t < n_keys; -inf where t >= visible[i]. q: [nq, nh, K] (FP4 QDQ'd),
  // weights: [nq, nh]; keys: n_keys packed rows; K a positive multiple of 32.
  virtual void index_scores(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                            const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores) const;
  // The same, scoring only the keys in query i's candidate pool (pools[i]: ascending ids of blocks of
  // block_size keys); every other key scores -inf. The work grows with the pool, not the history.
  virtual void index_scores_in_pool(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                                    const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                                    const std::vector<int32_t>* pools, int64_t block_size, float* scores) const;
  // Indices of the k largest scores (equal ones kept as `ties` says), ascending: the reference's
  // topk(sorted=False) then sort. -inf entries are selectable when fewer than k are finite.
  virtual std::vector<int32_t> topk_ascending(const float* scores, int64_t n, int64_t k, TopkTies ties) const;
  // Level one of the two-level selection (select_candidate_blocks) for one query: `scores` (n rows,
  // -inf where not visible) padded to whole blocks, each block scored by its best row, the block of
  // the newest visible row pinned, the best `topk_blocks` kept unless -inf; ascending block ids.
  virtual std::vector<int32_t> select_candidate_blocks(const float* scores, int64_t n, int64_t visible,
                                                       int64_t topk_blocks, int64_t block_size, TopkTies ties) const;
  // sparse_attn for one query (K41:296-403): q[h·d] (bf16 values) over `rows` in list order, in
  // chunks of 64 with an online softmax whose running max starts at -1e30; P is rounded to bf16
  // (relative to the running max) before P·V; the denominator sums fp32 P and gets
  // exp(sink_h − max), the sink not scaled. out[h·d] is rounded to bf16.
  virtual void sparse_attention(const float* q, int64_t heads, int64_t d, const KvRows& rows, const float* sink,
                                float scale, float* out) const;

  // ---- mHC (model-spec §3.2) -----------------------------------------------------------------------
  // X is [count, hc, dim]; y and u are [count, dim]. Each dot product is one sequential fp32 chain
  // over the token's hc·dim values (copy-major), products rounded before the add; the sum of squares
  // is torch's cascade (cascade_sum.h); the expand's and the collapse's sums run over the copies in
  // order, from 0.
  // mixes: rsqrt over all hc·dim values, (2+hc)·hc dot products with fn, then hc_split_sinkhorn.
  virtual void mhc_mixes(const HcShape& s, const float* X, int64_t count, const HcMixWeights& w,
                         HcCoefficientsOut out) const;
  // collapse: u[j] = Σ_c pre[c]·X[c][j], one bf16 rounding.
  virtual void mhc_collapse(const HcShape& s, const float* X, const float* pre, int64_t count, float* u) const;
  // expand: X'[k][j] = post[k]·y[j] + Σ_src comb[src][k]·X[src][j], one bf16 rounding.
  virtual void mhc_expand(const HcShape& s, float* X, const float* y, const float* post, const float* comb,
                          int64_t count) const;
  // expand with prev, the mixes of `next` from the new X, the collapse of the new X with prev.pre:
  // the step between two sublayers, in one pass. Same bits as the three ops.
  virtual void mhc_step(const HcShape& s, float* X, const float* y, const HcCoefficients& prev,
                        const HcMixWeights& next, int64_t count, HcCoefficientsOut out, float* u) const;

  // ---- MoE (model-spec §3.5) ------------------------------------------------------------------------
  // From the router's fp32 logits: scores (softmax, sigmoid or sqrt(softplus) of logits/temperature),
  // the k best of score + bias (ties toward the lower id), weights from the unbiased scores,
  // renormalised (+1e-20) and scaled. experts, weights: [tokens, k], in selection order.
  virtual void moe_route(const float* logits, int64_t tokens, const RouterParams& p, const float* bias,
                         int32_t* experts, float* weights) const;
  // The tokens of each expert, experts ascending (the order the combine sums in).
  virtual MoeDispatch moe_dispatch(const int32_t* experts, const float* weights, int64_t tokens, int64_t k,
                                   int64_t n_experts) const;
  // out[i] = x[rows[i]] (rows of dim).
  virtual void gather_rows(const float* x, int64_t dim, const int64_t* rows, int64_t count, float* out) const;
  // In place over gate [m, n]: clamp up to ±limit and gate to ≤ limit (limit > 0), silu(gate)·up, times
  // the row's routing weight when given, rounded to bf16.
  virtual void swiglu(float* gate, const float* up, int64_t m, int64_t n, float limit, const float* row_weights) const;
  // One SwiGLU expert over m rows: w1 and w3 (bf16 outputs), swiglu with the routing weights (null:
  // none), then w2. x: [m, dim]; y: [m, dim]. Composed of the ops above unless a level fuses it.
  virtual void expert_ffn(const ExpertMatrices<Fp4Matrix>& w, const float* x, int64_t m, const float* row_weights,
                          float limit, float* y) const;
  virtual void expert_ffn(const ExpertMatrices<Fp8Matrix>& w, const float* x, int64_t m, const float* row_weights,
                          float limit, float* y) const;
  // The routed outputs (one row per dispatch entry, in dispatch order) summed per token in fp32 in
  // ascending expert order, then plus the shared expert's row, rounded to bf16.
  virtual void moe_combine(const MoeDispatch& d, const float* expert_out, const float* shared, int64_t tokens,
                           int64_t dim, float* out) const;

  // ---- embedding, Engram, the stream --------------------------------------------------------------
  // X[i][c] = the bf16 row of tokens[i], for each of `copies` stream copies. X: [count, copies, dim].
  virtual void embed(const uint16_t* table, int64_t dim, const int32_t* tokens, int64_t count, int64_t copies,
                     float* X) const;
  // Gathered Engram rows dequantized: e4m3 · 2^(scale − 127) per 32 channels, rounded to bf16.
  virtual void engram_rows(const uint8_t* codes, const uint8_t* scales, int64_t rows, int64_t row_len,
                           float* out) const;
  // The Engram gate (model-spec §3.6): kv [count, hc + 1, dim] (a key per copy, then the value); per
  // copy, the dot h·qk·key over rsqrt-normalised h and key, /sqrt(dim), a signed-sqrt sigmoid gate,
  // and X += gate·value rounded to bf16.
  virtual void engram_gate(float* X, int64_t count, int64_t hc, int64_t dim, const float* kv, const float* qk,
                           float eps) const;
  // The mean over the copies of each row (fp32 sum in copy order, one bf16 rounding); row i goes to
  // out + i·out_stride.
  virtual void stream_mean(const float* X, int64_t count, int64_t hc, int64_t dim, float* out,
                           int64_t out_stride) const;
  // y[i] += x[i] in fp32.
  virtual void add(float* y, const float* x, int64_t n) const;

  // ---- the vision tower (vision-spec §4–5): bf16 activations, fp32 inside each op --------------------
  // y[i][j] = bf16(y[i][j] + bias[j]) over [m, n] (a bf16 linear's bias, added to its fp32 output).
  virtual void add_bias_bf16(float* y, int64_t m, int64_t n, const float* bias) const;
  // y[i] = bf16(y[i] + x[i]) (a bf16 residual).
  virtual void add_bf16(float* y, const float* x, int64_t n) const;
  // Rotate-half RoPE in place over `heads` heads of head_dim lanes per row (row r at x + r·row_stride):
  // lane i < head_dim/2 pairs with lane i + head_dim/2 at the angle whose cos and sin are
  // cos[r][i], sin[r][i]: [x1·cos − x2·sin, x2·cos + x1·sin] in fp32, one bf16 rounding per value.
  virtual void rope_rotate_half(const float* cos, const float* sin, int64_t rows, int64_t heads, int64_t head_dim,
                                float* x, int64_t row_stride) const;
  // Bidirectional attention of n rows over themselves, per head (torch's SDPA, no mask): q, k, v rows at
  // stride `stride`, heads·d lanes each (head-major). For each query and head: s_t = (q·k_t, an fp32 chain
  // in lane order)·scale; p_t = exp(s_t − max s); o = Σ_t p_t·v_t in fp32, in t order; out =
  // bf16(o / Σ p_t). out: [n, heads·d].
  virtual void dense_attention(const float* q, const float* k, const float* v, int64_t n, int64_t heads, int64_t d,
                               int64_t stride, float scale, float* out) const;
  // The ViT's SwiGLU (no clamp, bf16 between): gate_up [m, 2n] holds each row's gate then its up
  // values; out[i][j] = bf16(bf16(silu(gate[i][j]))·up[i][j]), out [m, n].
  virtual void silu_mul_bf16(const float* gate_up, int64_t m, int64_t n, float* out) const;
  // x[i] = bf16(GELU(x[i])), the exact (erf) form.
  virtual void gelu_erf_bf16(float* x, int64_t n) const;
  // The aligner's downsample gather (F.unfold, kernel = stride = r) of an nh × nw grid of dim-wide
  // rows, zero-padded right and bottom to multiples of r: out row oy·ceil(nw/r) + ox holds, channel-major,
  // column c·r·r + ky·r + kx = channel c of grid cell (r·oy + ky, r·ox + kx).
  virtual void unfold_cells(const float* x, int64_t nh, int64_t nw, int64_t dim, int64_t r, float* out) const;

 protected:
  // `tile_rows`: rows per packed tile this level's linears read (0: row-major only).
  Backend(Isa level, const BackendOptions& options, int tile_rows);

 private:
  Isa level_;
  BackendOptions options_;
  int tile_rows_;
  mutable ThreadPool pool_;
  mutable std::vector<Scratch> scratch_;
  mutable HostAllocator allocator_;
  Exec exec_;
};

// The levels this build knows, lowest first; those the machine runs are available.
std::vector<Isa> backend_levels();
std::vector<Isa> available_backend_levels();

// A backend of options.level (the best available when unset). Error naming `what` when the level
// does not run on this machine or the thread count is out of range.
std::unique_ptr<Backend> make_backend(const BackendOptions& options = {}, const std::string& what = "backend");

}  // namespace dsv41
