#include "model/vision_tower.h"

#include <cmath>

#include "numeric/formats.h"
#include "util/error.h"

namespace dsv41 {

void vision_rope_tables(int64_t nh, int64_t nw, int64_t head_dim, double theta, std::vector<float>& cos,
                        std::vector<float>& sin) {
  const int64_t half = head_dim / 2, quarter = head_dim / 4;
  // torch: 1.0 / (theta ** (arange(0, half, 2).float() / half)), all fp32
  std::vector<float> freq(static_cast<size_t>(quarter));
  for (int64_t j = 0; j < quarter; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(half);
    freq[static_cast<size_t>(j)] = 1.0f / std::pow(static_cast<float>(theta), exponent);
  }
  cos.resize(static_cast<size_t>(nh * nw * half));
  sin.resize(cos.size());
  for (int64_t row = 0; row < nh; ++row) {
    for (int64_t col = 0; col < nw; ++col) {
      const size_t base = static_cast<size_t>((row * nw + col) * half);
      for (int64_t j = 0; j < quarter; ++j) {
        const float a = static_cast<float>(row) * freq[static_cast<size_t>(j)];
        const float b = static_cast<float>(col) * freq[static_cast<size_t>(j)];
        cos[base + static_cast<size_t>(j)] = std::cos(a);
        sin[base + static_cast<size_t>(j)] = std::sin(a);
        cos[base + static_cast<size_t>(quarter + j)] = std::cos(b);
        sin[base + static_cast<size_t>(quarter + j)] = std::sin(b);
      }
    }
  }
}

VisionTower::VisionTower(const Backend& backend, const VisionWeights& weights, const VisionConfig& config,
                         int64_t lm_dim)
    : backend_(backend), w_(weights), c_(config), lm_dim_(lm_dim) {}

std::vector<float> VisionTower::encode(const float* patches, const ImageGrid& grid) const {
  const Backend& b = backend_;
  const int64_t n = grid.nh * grid.nw, d = c_.dim, heads = c_.n_heads, hd = c_.head_dim(), inter = c_.inter_dim;
  if (n <= 0) fail("image", "has no patches");
  const auto sz = [](int64_t v) { return static_cast<size_t>(v); };
  // 1. PatchEmbed: a linear over each patch's (c, y, x) values, with bias
  std::vector<float> x(sz(n * d));
  b.linear_f32(patches, n, w_.patch_proj.view(), x.data());
  b.add_bias_bf16(x.data(), n, d, w_.patch_bias.data());
  // 2. the RoPE tables of this grid
  std::vector<float> cos, sin;
  vision_rope_tables(grid.nh, grid.nw, hd, c_.rope_theta, cos, sin);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<float> h(sz(n * d)), qkv(sz(n * 3 * d)), attn(sz(n * d)), gate_up(sz(n * 2 * inter)), act(sz(n * inter));
  // 3. the blocks, pre-norm, bf16 residuals
  for (const VisionBlockWeights& blk : w_.blocks) {
    b.rms_norm(x.data(), n, d, blk.norm1.data(), VisionConfig::kNormEps, h.data(), true);
    b.linear_f32(h.data(), n, blk.wqkv.view(), qkv.data());
    b.add_bias_bf16(qkv.data(), n, 3 * d, blk.wqkv_bias.data());
    b.rope_rotate_half(cos.data(), sin.data(), n, heads, hd, qkv.data(), 3 * d);      // q
    b.rope_rotate_half(cos.data(), sin.data(), n, heads, hd, qkv.data() + d, 3 * d);  // k
    b.dense_attention(qkv.data(), qkv.data() + d, qkv.data() + 2 * d, n, heads, hd, 3 * d, scale, attn.data());
    b.linear_f32(attn.data(), n, blk.wo.view(), h.data());
    b.add_bias_bf16(h.data(), n, d, blk.wo_bias.data());
    b.add_bf16(x.data(), h.data(), n * d);
    b.rms_norm(x.data(), n, d, blk.norm2.data(), VisionConfig::kNormEps, h.data(), true);
    b.linear_bf16(h.data(), n, blk.w1.view(), gate_up.data());
    b.silu_mul_bf16(gate_up.data(), n, inter, act.data());
    b.linear_bf16(act.data(), n, blk.w2.view(), h.data());
    b.add_bf16(x.data(), h.data(), n * d);
  }
  // 4. the final norm
  b.rms_norm(x.data(), n, d, w_.norm.data(), VisionConfig::kNormEps, h.data(), true);
  return h;
}

std::vector<float> VisionTower::align(const float* vit, const ImageGrid& grid) const {
  const Backend& b = backend_;
  const int64_t r = c_.downsample_ratio, rows = grid.llm_h(r) * grid.llm_w(r), width = c_.dim * r * r;
  std::vector<float> cells(static_cast<size_t>(rows * width)), hidden(static_cast<size_t>(rows * lm_dim_)),
      out(hidden.size());
  b.unfold_cells(vit, grid.nh, grid.nw, c_.dim, r, cells.data());
  b.linear_f32(cells.data(), rows, w_.aligner_w1.view(), hidden.data());
  b.add_bias_bf16(hidden.data(), rows, lm_dim_, w_.aligner_b1.data());
  b.gelu_erf_bf16(hidden.data(), rows * lm_dim_);
  b.linear_f32(hidden.data(), rows, w_.aligner_w2.view(), out.data());
  b.add_bias_bf16(out.data(), rows, lm_dim_, w_.aligner_b2.data());
  return out;
}

std::vector<float> VisionTower::span_rows(const float* aligned, const ImageGrid& grid) const {
  const int64_t r = c_.downsample_ratio, lh = grid.llm_h(r), lw = grid.llm_w(r);
  std::vector<float> out;
  out.reserve(static_cast<size_t>(grid.span_length(r) * lm_dim_));
  const auto put = [&](const float* row) { out.insert(out.end(), row, row + lm_dim_); };
  const auto put_bf16 = [&](const Bf16Tensor& t) {
    for (int64_t i = 0; i < lm_dim_; ++i) out.push_back(bf16_to_f32(t.data()[i]));
  };
  put_bf16(w_.image_start);
  for (int64_t y = 0; y < lh; ++y) {
    for (int64_t x = 0; x < lw; ++x) put(aligned + (y * lw + x) * lm_dim_);
    put_bf16(w_.image_newline);
  }
  put_bf16(w_.image_end);
  return out;
}

std::vector<float> VisionTower::embed(const float* patches, const ImageGrid& grid) const {
  const std::vector<float> vit = encode(patches, grid);
  const std::vector<float> aligned = align(vit.data(), grid);
  return span_rows(aligned.data(), grid);
}

double VisionTower::flops(const ImageGrid& grid) const {
  const double n = static_cast<double>(grid.nh * grid.nw), d = static_cast<double>(c_.dim);
  const double inter = static_cast<double>(c_.inter_dim), r = static_cast<double>(c_.downsample_ratio);
  const double rows = static_cast<double>(grid.llm_h(c_.downsample_ratio) * grid.llm_w(c_.downsample_ratio));
  const double lm = static_cast<double>(lm_dim_);
  const double per_block = n * (3 * d * d + d * d + 2 * inter * d + inter * d)  // qkv, wo, w1, w2
                           + 2 * n * n * d;                                     // q·kᵀ and P·V
  const double macs = n * static_cast<double>(c_.patch_values()) * d + static_cast<double>(c_.n_layers) * per_block +
                      rows * (d * r * r * lm + lm * lm);
  return 2 * macs;
}

}  // namespace dsv41
