// The vision tower's weights (vision-spec §2): all BF16 in the checkpoint, bound like the text
// model's BF16 tensors (views into the mapping, packed for the backend's linears). Biases and the
// norms' weights are read as they are; the span delimiters are rows of the language model's width.
#pragma once

#include <vector>

#include "model/weights.h"

namespace dsv41 {

struct VisionBlockWeights {
  Bf16Tensor norm1, norm2;
  Bf16Tensor wqkv, wo;  // [3·dim, dim] (q, k, v rows in that order), [dim, dim]
  std::vector<float> wqkv_bias, wo_bias;
  Bf16Tensor w1, w2;  // [2·inter, dim] (gate rows, then up rows), [dim, inter]; no biases
};

struct VisionWeights {
  Bf16Tensor patch_proj;  // [dim, 3·patch²]
  std::vector<float> patch_bias;
  std::vector<VisionBlockWeights> blocks;
  Bf16Tensor norm;
  Bf16Tensor aligner_w1, aligner_w2;  // [lm_dim, dim·r²], [lm_dim, lm_dim]
  std::vector<float> aligner_b1, aligner_b2;
  Bf16Tensor image_start, image_end, image_newline;  // [lm_dim] each
};

}  // namespace dsv41
