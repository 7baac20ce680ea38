// Every tensor the released checkpoint layout holds for a config (model-spec §2): names without a
// "model." prefix, dtypes, shapes, and which tensors are FP8 weights with 32×32 scales, MXFP4 experts
// or Engram tables. make-tiny writes exactly this list and the loader checks a checkpoint against it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/config.h"
#include "io/safetensors_header.h"

namespace dsv41 {

enum class TensorKind {
  Fp8Weight,    // F8_E4M3 [N, K]; its ".scale" sibling is F8_E8M0 [ceil(N/32), ceil(K/32)]
  Fp4Weight,    // I8 [N, K/2] packed E2M1 pairs; ".scale" is F8_E8M0 [N, K/32]
  EngramTable,  // F8_E4M3 [rows, head_dim]; ".scale" is F8_E8M0 [rows, head_dim/32]
  Scale,        // the F8_E8M0 scale of one of the three above
  Bf16,         // a BF16 weight (norms, embeddings, router, compressor, ...)
  F32,          // F32 (hc_*, router bias, attention sink)
};

struct TensorSpec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;  // as stored
  TensorKind kind;
  int64_t logical_in = 0;      // K of a quantized weight (FP4 stores K/2 bytes per row)
  int layer = -1;              // owning layer (-1 for top-level tensors)
};

// In checkpoint order: top-level first, then layers.0.., then mtp.0..
std::vector<TensorSpec> checkpoint_tensors(const ModelConfig& config);

// The vision tower's tensors (vision-spec §2), all BF16: the ViT, the aligner, the span vectors;
// none when the config has no tower.
std::vector<TensorSpec> vision_tensors(const ModelConfig& config);
// Every layer's `ffn.gate.bias_vl` (vision-spec §2: F32, one per routed expert, DSpark blocks
// included), the selection bias of image-span tokens; none when the config has no tower.
std::vector<TensorSpec> image_routing_biases(const ModelConfig& config);

// Number of model parameters a tensor holds (scales are not parameters; an FP4 byte holds two).
int64_t tensor_params(const TensorSpec& spec);

// Tensors the released checkpoint may carry that this engine does not need (vision tower, VL routing
// bias, image delimiters). The loader tolerates them.
bool is_optional_tensor(const std::string& name);

}  // namespace dsv41
