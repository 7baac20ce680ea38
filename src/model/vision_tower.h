// The vision tower (vision-spec §4–6.1): one image's patches through the ViT (vision.py), the
// aligner's 3×3 downsample and MLP, and the span's embedding rows as merge_image_embeddings writes
// them. Every step is an op of the model's backend; images are encoded one at a time and see no text.
#pragma once

#include <cstdint>
#include <vector>

#include "io/vision_config.h"
#include "kernels/backend.h"
#include "model/vision_weights.h"

namespace dsv41 {

// An image's place in the language model: an nh × nw grid of ViT patches, ceil(nh/r) × ceil(nw/r)
// aligner rows, and the span [START] ([IMAGE]·llm_w [NEW_LINE])·llm_h [END].
struct ImageGrid {
  int64_t nh = 0, nw = 0;  // ViT patches, rows × columns
  int64_t llm_h(int64_t r) const { return (nh + r - 1) / r; }
  int64_t llm_w(int64_t r) const { return (nw + r - 1) / r; }
  int64_t span_length(int64_t r) const { return llm_h(r) * (llm_w(r) + 1) + 2; }
};

// The 2-D RoPE tables of an nh × nw grid (vision-spec §4 step 2), [nh·nw, head_dim/2] each: patch
// (row, col) gets row·f_j on the first quarter of the head's lanes and col·f_j on the second, with
// f_j = 1/θ^(2j/(head_dim/2)) in fp32 as the reference computes it.
void vision_rope_tables(int64_t nh, int64_t nw, int64_t head_dim, double theta, std::vector<float>& cos,
                        std::vector<float>& sin);

class VisionTower {
 public:
  // `lm_dim`: the language model's width (the aligner's output and the span rows).
  VisionTower(const Backend& backend, const VisionWeights& weights, const VisionConfig& config, int64_t lm_dim);

  // patches [nh·nw, 3·patch²] (bf16 values, each flattened (c, y, x)) → [nh·nw, dim] after vision.norm.
  std::vector<float> encode(const float* patches, const ImageGrid& grid) const;
  // The ViT's rows → [llm_h·llm_w, lm_dim]: zero pad to multiples of r, the channel-major r×r
  // gather, w1 + bias, exact GELU, w2 + bias.
  std::vector<float> align(const float* vit, const ImageGrid& grid) const;
  // The aligner's rows → the span's [span_length, lm_dim] rows: image_start, each grid row's aligner
  // rows then image_newline, image_end.
  std::vector<float> span_rows(const float* aligned, const ImageGrid& grid) const;
  // All three: the span rows of one image.
  std::vector<float> embed(const float* patches, const ImageGrid& grid) const;

  // Multiply-adds of encode + align for one image (bench's FLOP count: 2 per multiply-add).
  double flops(const ImageGrid& grid) const;

 private:
  const Backend& backend_;
  const VisionWeights& w_;
  VisionConfig c_;
  int64_t lm_dim_;
};

}  // namespace dsv41
