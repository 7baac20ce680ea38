// The base backend (every op by its scalar reference), the SIMD levels (the ops they have kernels
// for, from one table per level) and the list of levels.
#include "kernels/backend.h"

#include "kernels/engram_rows.h"
#include "kernels/index_score.h"
#include "kernels/linear_internal.h"
#include "kernels/mhc_step.h"
#include "kernels/reference.h"
#include "kernels/topk_threshold.h"
#include "util/error.h"

namespace dsv41 {

Backend::Backend(Isa level, const BackendOptions& options, int tile_rows)
    : level_(level),
      options_(options),
      tile_rows_(tile_rows),
      pool_(options.threads > 0 ? options.threads : ThreadPool::hardware_threads()),
      scratch_(static_cast<size_t>(pool_.threads())),
      exec_(pool_, scratch_) {}

Backend::~Backend() = default;

std::unique_ptr<PackedWeights> Backend::pack(const Fp8Matrix& w) const {
  return weight_tile_rows() > 0 ? pack_fp8(exec_, allocator_, w, tile_rows_) : nullptr;
}
std::unique_ptr<PackedWeights> Backend::pack(const Fp4Matrix& w) const {
  return weight_tile_rows() > 0 ? pack_fp4(exec_, allocator_, w, tile_rows_) : nullptr;
}
std::unique_ptr<PackedWeights> Backend::pack(const Bf16Matrix& w) const {
  return weight_tile_rows() > 0 ? pack_bf16(exec_, allocator_, w, tile_rows_) : nullptr;
}

// ---- the references -----------------------------------------------------------------------------

void Backend::linear_fp8(const float* x, int64_t m, const Fp8Matrix& w, float* y) const {
  reference::linear_fp8(x, m, w, y);
}
void Backend::linear_fp4(const float* x, int64_t m, const Fp4Matrix& w, float* y) const {
  reference::linear_fp4(x, m, w, y);
}
void Backend::linear_bf16(const float* x, int64_t m, const Bf16Matrix& w, float* y) const {
  reference::linear_bf16(x, m, w, y);
}
void Backend::linear_f32(const float* x, int64_t m, const Bf16Matrix& w, float* y) const {
  reference::linear_f32(x, m, w, y);
}
void Backend::rms_norm(const float* x, int64_t rows, int64_t n, const uint16_t* weight_bf16, float eps, float* y,
                       bool round_to_bf16) const {
  reference::rms_norm(x, rows, n, weight_bf16, eps, y, round_to_bf16);
}
void Backend::rope(const RopeTable& table, const RotaryRows& rows, bool inverse) const {
  reference::rope(table, rows, inverse);
}
void Backend::pack_kv_rows(KvFormat format, const float* x, int64_t rows, int64_t dim, uint8_t* const* out) const {
  reference::pack_kv_rows(format, x, rows, dim, out);
}
void Backend::compressor_pool(const float* kv, const float* score, int64_t ratio, int64_t dim, float* out) const {
  reference::compressor_pool(kv, score, ratio, dim, out);
}
void Backend::quantize_index_queries(float* q, float* weights, int64_t count, int64_t heads, int64_t dim,
                                     float head_scale) const {
  reference::quantize_index_queries(q, weights, count, heads, dim, head_scale);
}
void Backend::index_scores(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                           const uint8_t* const* keys, int64_t n_keys, const int64_t* visible, float* scores) const {
  reference::index_scores(q, weights, nq, nh, K, keys, n_keys, visible, scores);
}
void Backend::index_scores_in_pool(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                                   const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                                   const std::vector<int32_t>* pools, int64_t block_size, float* scores) const {
  reference::index_scores_in_pool(q, weights, nq, nh, K, keys, n_keys, visible, pools, block_size, scores);
}
std::vector<int32_t> Backend::topk_ascending(const float* scores, int64_t n, int64_t k, TopkTies ties) const {
  // torch's choice among ties follows its algorithm step by step: only the reference reproduces it
  if (ties == TopkTies::LowerIndexFirst) return topk_by_threshold(scores, n, k);
  return reference::topk_ascending(scores, n, k, ties);
}
std::vector<int32_t> Backend::select_candidate_blocks(const float* scores, int64_t n, int64_t visible,
                                                      int64_t topk_blocks, int64_t block_size, TopkTies ties) const {
  if (ties == TopkTies::LowerIndexFirst) return candidate_blocks_by_threshold(scores, n, visible, topk_blocks, block_size);
  return reference::select_candidate_blocks(scores, n, visible, topk_blocks, block_size, ties);
}
void Backend::sparse_attention(const float* q, int64_t heads, int64_t d, const KvRows& rows, const float* sink,
                               float scale, float* out) const {
  reference::sparse_attention(q, heads, d, rows, sink, scale, out);
}
void Backend::mhc_mixes(const HcShape& s, const float* X, int64_t count, const HcMixWeights& w,
                        HcCoefficientsOut out) const {
  reference::mhc_mixes(s, X, count, w, out);
}
void Backend::mhc_collapse(const HcShape& s, const float* X, const float* pre, int64_t count, float* u) const {
  reference::mhc_collapse(s, X, pre, count, u);
}
void Backend::mhc_expand(const HcShape& s, float* X, const float* y, const float* post, const float* comb,
                         int64_t count) const {
  reference::mhc_expand(s, X, y, post, comb, count);
}
void Backend::mhc_step(const HcShape& s, float* X, const float* y, const HcCoefficients& prev, const HcMixWeights& next,
                       int64_t count, HcCoefficientsOut out, float* u) const {
  reference::mhc_step(s, X, y, prev, next, count, out, u);
}
void Backend::moe_route(const float* logits, int64_t tokens, const RouterParams& p, const float* bias, int32_t* experts,
                        float* weights) const {
  reference::moe_route(logits, tokens, p, bias, experts, weights);
}
MoeDispatch Backend::moe_dispatch(const int32_t* experts, const float* weights, int64_t tokens, int64_t k,
                                  int64_t n_experts) const {
  return reference::moe_dispatch(experts, weights, tokens, k, n_experts);
}
void Backend::gather_rows(const float* x, int64_t dim, const int64_t* rows, int64_t count, float* out) const {
  reference::gather_rows(x, dim, rows, count, out);
}
void Backend::swiglu(float* gate, const float* up, int64_t m, int64_t n, float limit, const float* row_weights) const {
  reference::swiglu(gate, up, m, n, limit, row_weights);
}
void Backend::moe_combine(const MoeDispatch& d, const float* expert_out, const float* shared, int64_t tokens,
                          int64_t dim, float* out) const {
  reference::moe_combine(d, expert_out, shared, tokens, dim, out);
}
void Backend::embed(const uint16_t* table, int64_t dim, const int32_t* tokens, int64_t count, int64_t copies,
                    float* X) const {
  reference::embed(table, dim, tokens, count, copies, X);
}
void Backend::engram_rows(const uint8_t* codes, const uint8_t* scales, int64_t rows, int64_t row_len,
                          float* out) const {
  reference::engram_rows(codes, scales, rows, row_len, out);
}
void Backend::engram_gate(float* X, int64_t count, int64_t hc, int64_t dim, const float* kv, const float* qk,
                          float eps) const {
  reference::engram_gate(X, count, hc, dim, kv, qk, eps);
}
void Backend::stream_mean(const float* X, int64_t count, int64_t hc, int64_t dim, float* out,
                          int64_t out_stride) const {
  reference::stream_mean(X, count, hc, dim, out, out_stride);
}
void Backend::add(float* y, const float* x, int64_t n) const { reference::add(y, x, n); }
// The vision tower's elementwise ops: the references over ranges of rows or values, spread over the
// pool when there is enough work (each value is computed alone: the same bits at any split).
namespace {
constexpr int64_t kElementwiseParallelMin = int64_t{1} << 15;
}  // namespace

void Backend::add_bias_bf16(float* y, int64_t m, int64_t n, const float* bias) const {
  exec().run(m * n >= kElementwiseParallelMin, m, 8,
             [&](int64_t b, int64_t e, Scratch&) { reference::add_bias_bf16(y + b * n, e - b, n, bias); });
}
void Backend::add_bf16(float* y, const float* x, int64_t n) const {
  exec().run(n >= kElementwiseParallelMin, n, 4096,
             [&](int64_t b, int64_t e, Scratch&) { reference::add_bf16(y + b, x + b, e - b); });
}
void Backend::rope_rotate_half(const float* cos, const float* sin, int64_t rows, int64_t heads, int64_t head_dim,
                               float* x, int64_t row_stride) const {
  const int64_t half = head_dim / 2;
  exec().run(rows * heads * head_dim >= kElementwiseParallelMin, rows, 8, [&](int64_t b, int64_t e, Scratch&) {
    reference::rope_rotate_half(cos + b * half, sin + b * half, e - b, heads, head_dim, x + b * row_stride, row_stride);
  });
}
void Backend::dense_attention(const float* q, const float* k, const float* v, int64_t n, int64_t heads, int64_t d,
                              int64_t stride, float scale, float* out) const {
  // query rows are independent: the reference's per-query loop, spread over the pool (same bits)
  exec().run(n * n * heads * d >= (int64_t{1} << 18), n, 1, [&](int64_t b, int64_t e, Scratch&) {
    std::vector<float> scores(static_cast<size_t>(n));
    for (int64_t i = b; i < e; ++i) reference::dense_attention_query(q, k, v, n, heads, d, stride, scale, i, out, scores.data());
  });
}
void Backend::silu_mul_bf16(const float* gate_up, int64_t m, int64_t n, float* out) const {
  exec().run(m * n >= kElementwiseParallelMin, m, 8, [&](int64_t b, int64_t e, Scratch&) {
    reference::silu_mul_bf16(gate_up + b * 2 * n, e - b, n, out + b * n);
  });
}
void Backend::gelu_erf_bf16(float* x, int64_t n) const {
  exec().run(n >= kElementwiseParallelMin, n, 4096, [&](int64_t b, int64_t e, Scratch&) { reference::gelu_erf_bf16(x + b, e - b); });
}
void Backend::unfold_cells(const float* x, int64_t nh, int64_t nw, int64_t dim, int64_t r, float* out) const {
  reference::unfold_cells(x, nh, nw, dim, r, out);
}

// ---- composed ops -------------------------------------------------------------------------------

namespace {

template <class Matrix, class Linear>
void run_expert(const Backend& b, const ExpertMatrices<Matrix>& w, const float* x, int64_t m, const float* row_weights,
                float limit, float* y, Linear linear) {
  const int64_t inter = w.w1.n;
  std::vector<float> g(static_cast<size_t>(m * inter)), u(static_cast<size_t>(m * inter));
  linear(x, m, w.w1, g.data());
  linear(x, m, w.w3, u.data());
  b.swiglu(g.data(), u.data(), m, inter, limit, row_weights);
  linear(g.data(), m, w.w2, y);
}

}  // namespace

void Backend::expert_ffn(const ExpertMatrices<Fp4Matrix>& w, const float* x, int64_t m, const float* row_weights,
                         float limit, float* y) const {
  run_expert(*this, w, x, m, row_weights, limit, y,
             [this](const float* a, int64_t rows, const Fp4Matrix& mat, float* out) { linear_fp4(a, rows, mat, out); });
}
void Backend::expert_ffn(const ExpertMatrices<Fp8Matrix>& w, const float* x, int64_t m, const float* row_weights,
                         float limit, float* y) const {
  run_expert(*this, w, x, m, row_weights, limit, y,
             [this](const float* a, int64_t rows, const Fp8Matrix& mat, float* out) { linear_fp8(a, rows, mat, out); });
}

// ---- the levels ---------------------------------------------------------------------------------

namespace {

// The scalar level: the references, one thread.
class ScalarBackend final : public Backend {
 public:
  explicit ScalarBackend(const BackendOptions& o) : Backend(Isa::scalar, o, 0) {}
};

// What a SIMD level has kernels for (the rest falls back to the references).
struct SimdOps {
  int tile_rows;  // 2 vectors of fp32 lanes
  void (*linear_fp8)(const Exec&, const float*, int64_t, const Fp8Matrix&, float*);
  void (*linear_fp4)(const Exec&, const float*, int64_t, const Fp4Matrix&, float*);
  void (*linear_bf16)(const Exec&, const float*, int64_t, const Bf16Matrix&, float*);
  void (*linear_f32)(const Exec&, const float*, int64_t, const Bf16Matrix&, float*);
  void (*index_scores)(const Exec&, const float*, const float*, int64_t, int64_t, int64_t, const uint8_t* const*,
                       int64_t, const int64_t*, float*);
  void (*index_scores_in_pool)(const Exec&, const float*, const float*, int64_t, int64_t, int64_t,
                               const uint8_t* const*, int64_t, const int64_t*, const std::vector<int32_t>*, int64_t,
                               float*);
  void (*sparse_attention)(const Exec&, const float*, int64_t, int64_t, const KvRows&, const float*, float, float*);
  void (*dense_attention)(const Exec&, const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t,
                          float, float*);
  void (*mhc_mixes)(const Exec&, const HcShape&, const float*, int64_t, const HcMixWeights&, HcCoefficientsOut);
  void (*mhc_collapse)(const Exec&, const HcShape&, const float*, const float*, int64_t, float*);
  void (*mhc_expand)(const Exec&, const HcShape&, float*, const float*, const float*, const float*, int64_t);
  void (*mhc_step)(const Exec&, const HcShape&, float*, const float*, const HcCoefficients&, const HcMixWeights&,
                   int64_t, HcCoefficientsOut, float*);
  void (*engram_blocks)(const uint8_t*, const uint8_t*, int64_t, float*);
  void (*swiglu)(const Exec&, float*, const float*, int64_t, int64_t, float, const float*);
};

constexpr SimdOps kAvx2{16,
                        detail::linear_fp8_avx2,
                        detail::linear_fp4_avx2,
                        detail::linear_bf16_avx2,
                        detail::linear_f32_avx2,
                        detail::index_scores_avx2,
                        detail::index_scores_in_pool_avx2,
                        detail::sparse_attention_avx2,
                        detail::dense_attention_avx2,
                        detail::mhc_mixes_avx2,
                        detail::mhc_collapse_avx2,
                        detail::mhc_expand_avx2,
                        detail::mhc_step_avx2,
                        detail::dequantize_fp8_blocks_avx2,
                        detail::swiglu_avx2};

constexpr SimdOps kAvx512{32,
                          detail::linear_fp8_avx512,
                          detail::linear_fp4_avx512,
                          detail::linear_bf16_avx512,
                          detail::linear_f32_avx512,
                          detail::index_scores_avx512,
                          detail::index_scores_in_pool_avx512,
                          detail::sparse_attention_avx512,
                          detail::dense_attention_avx512,
                          detail::mhc_mixes_avx512,
                          detail::mhc_collapse_avx512,
                          detail::mhc_expand_avx512,
                          detail::mhc_step_avx512,
                          detail::dequantize_fp8_blocks_avx512,
                          detail::swiglu_avx512};

// The AVX-512 level with the FP8, FP4 and BF16 GEMMs and the attentions' q·k on vdpbf16ps.
constexpr SimdOps kAvx512Bf16 = [] {
  SimdOps ops = kAvx512;
  ops.linear_fp8 = detail::linear_fp8_avx512_bf16;
  ops.linear_fp4 = detail::linear_fp4_avx512_bf16;
  ops.linear_bf16 = detail::linear_bf16_avx512_bf16;
  ops.linear_f32 = detail::linear_f32_avx512_bf16;
  ops.dense_attention = detail::dense_attention_avx512_bf16;
  ops.sparse_attention = detail::sparse_attention_avx512_bf16;
  return ops;
}();

// The AVX-512-BF16 level with the FP8, FP4 and BF16 linear layers on the AMX tiles: not the
// reference's bits (simd_amx.cpp says what they are), so never the default.
constexpr SimdOps kAmxBf16 = [] {
  SimdOps ops = kAvx512Bf16;
  ops.linear_fp8 = detail::linear_fp8_amx;
  ops.linear_fp4 = detail::linear_fp4_amx;
  ops.linear_bf16 = detail::linear_bf16_amx;
  return ops;
}();

// The AVX-512 levels score the indexer in integers where the CPU has VNNI: the same bits, 2.4-3 times
// as fast at the released widths (index_score_vnni.cpp, docs/performance.md).
bool integer_indexer(Isa level) { return level >= Isa::avx512 && cpu_features().avx512_vnni; }
// The AVX-512-BF16 level runs its decode steps' GEMV on vdpbf16ps too, and decodes its GEMM's panels
// by byte permutes, where the CPU has VBMI: the same bits (simd_avx512_bf16.cpp).
bool pair_gemv(Isa level) { return level == Isa::avx512_bf16 && cpu_features().avx512_vbmi; }
// The level's ops with the units this CPU adds to it.
SimdOps for_this_cpu(Isa level, SimdOps ops) {
  if (integer_indexer(level)) {
    ops.index_scores = detail::index_scores_avx512_vnni;
    ops.index_scores_in_pool = detail::index_scores_in_pool_avx512_vnni;
  }
  if (pair_gemv(level)) {
    ops.linear_fp8 = detail::linear_fp8_avx512_bf16_vbmi;
    ops.linear_fp4 = detail::linear_fp4_avx512_bf16_vbmi;
  }
  return ops;
}

class SimdBackend final : public Backend {
 public:
  SimdBackend(Isa level, const SimdOps& ops, const BackendOptions& o)
      : Backend(level, o, ops.tile_rows),
        ops_(for_this_cpu(level, ops)),
        integer_indexer_(integer_indexer(level)) {}

  const char* index_score_unit() const override { return integer_indexer_ ? "avx512_vnni_int8" : "fp32"; }

  void linear_fp8(const float* x, int64_t m, const Fp8Matrix& w, float* y) const override {
    ops_.linear_fp8(exec(), x, m, w, y);
  }
  void linear_fp4(const float* x, int64_t m, const Fp4Matrix& w, float* y) const override {
    ops_.linear_fp4(exec(), x, m, w, y);
  }
  void linear_bf16(const float* x, int64_t m, const Bf16Matrix& w, float* y) const override {
    ops_.linear_bf16(exec(), x, m, w, y);
  }
  void linear_f32(const float* x, int64_t m, const Bf16Matrix& w, float* y) const override {
    ops_.linear_f32(exec(), x, m, w, y);
  }
  void swiglu(float* gate, const float* up, int64_t m, int64_t n, float limit, const float* row_weights) const override {
    ops_.swiglu(exec(), gate, up, m, n, limit, row_weights);
  }
  void index_scores(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K, const uint8_t* const* keys,
                    int64_t n_keys, const int64_t* visible, float* scores) const override {
    ops_.index_scores(exec(), q, weights, nq, nh, K, keys, n_keys, visible, scores);
  }
  void index_scores_in_pool(const float* q, const float* weights, int64_t nq, int64_t nh, int64_t K,
                            const uint8_t* const* keys, int64_t n_keys, const int64_t* visible,
                            const std::vector<int32_t>* pools, int64_t block_size, float* scores) const override {
    ops_.index_scores_in_pool(exec(), q, weights, nq, nh, K, keys, n_keys, visible, pools, block_size, scores);
  }
  void sparse_attention(const float* q, int64_t heads, int64_t d, const KvRows& rows, const float* sink, float scale,
                        float* out) const override {
    ops_.sparse_attention(exec(), q, heads, d, rows, sink, scale, out);
  }
  void dense_attention(const float* q, const float* k, const float* v, int64_t n, int64_t heads, int64_t d,
                       int64_t stride, float scale, float* out) const override {
    ops_.dense_attention(exec(), q, k, v, n, heads, d, stride, scale, out);
  }
  void mhc_mixes(const HcShape& s, const float* X, int64_t count, const HcMixWeights& w,
                 HcCoefficientsOut out) const override {
    ops_.mhc_mixes(exec(), s, X, count, w, out);
  }
  void mhc_collapse(const HcShape& s, const float* X, const float* pre, int64_t count, float* u) const override {
    ops_.mhc_collapse(exec(), s, X, pre, count, u);
  }
  void mhc_expand(const HcShape& s, float* X, const float* y, const float* post, const float* comb,
                  int64_t count) const override {
    ops_.mhc_expand(exec(), s, X, y, post, comb, count);
  }
  void mhc_step(const HcShape& s, float* X, const float* y, const HcCoefficients& prev, const HcMixWeights& next,
                int64_t count, HcCoefficientsOut out, float* u) const override {
    ops_.mhc_step(exec(), s, X, y, prev, next, count, out, u);
  }
  void engram_rows(const uint8_t* codes, const uint8_t* scales, int64_t rows, int64_t row_len,
                   float* out) const override {
    const int64_t blocks = rows * (row_len / 32);
    exec().run(
        blocks >= detail::kEngramParallelBlocks, blocks, detail::kEngramBlocksPerGrain,
        [&](int64_t b, int64_t e, Scratch&) { ops_.engram_blocks(codes + b * 32, scales + b, e - b, out + b * 32); });
  }

 private:
  const SimdOps ops_;
  const bool integer_indexer_;
};

// Every level this build knows, lowest first: a new backend is one more entry.
struct Level {
  Isa isa;
  std::unique_ptr<Backend> (*make)(const BackendOptions&);
};
const Level kLevels[] = {
    {Isa::scalar,
     [](const BackendOptions& o) -> std::unique_ptr<Backend> { return std::make_unique<ScalarBackend>(o); }},
    {Isa::avx2,
     [](const BackendOptions& o) -> std::unique_ptr<Backend> {
       return std::make_unique<SimdBackend>(Isa::avx2, kAvx2, o);
     }},
    {Isa::avx512,
     [](const BackendOptions& o) -> std::unique_ptr<Backend> {
       return std::make_unique<SimdBackend>(Isa::avx512, kAvx512, o);
     }},
    {Isa::avx512_bf16,
     [](const BackendOptions& o) -> std::unique_ptr<Backend> {
       return std::make_unique<SimdBackend>(Isa::avx512_bf16, kAvx512Bf16, o);
     }},
    {Isa::amx_bf16,
     [](const BackendOptions& o) -> std::unique_ptr<Backend> {
       return std::make_unique<SimdBackend>(Isa::amx_bf16, kAmxBf16, o);
     }},
};

}  // namespace

std::vector<Isa> backend_levels() {
  std::vector<Isa> out;
  for (const Level& l : kLevels) out.push_back(l.isa);
  return out;
}

std::vector<Isa> available_backend_levels() {
  std::vector<Isa> out;
  for (const Level& l : kLevels) {
    if (isa_supported(l.isa)) out.push_back(l.isa);
  }
  return out;
}

std::unique_ptr<Backend> make_backend(const BackendOptions& options, const std::string& what) {
  const Isa level = options.level.value_or(default_isa());
  if (!isa_supported(level)) {
    fail(what, std::string("kernel level ") + isa_name(level) + " does not run on this machine (it runs up to " +
                   isa_name(detected_isa()) + ")");
  }
  if (options.threads < 0 || options.threads > 1024) fail(what, "threads must be 0 (one per core) to 1024");
  for (const Level& l : kLevels) {
    if (l.isa == level) return l.make(options);
  }
  fail(what, std::string("no backend for kernel level ") + isa_name(level));
}

}  // namespace dsv41
