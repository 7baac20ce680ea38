// The vision tower's configuration (vision-spec §1): the HF file's `vision_config` object or the flat
// inference file's vision_* keys, and the image placeholder id. A checkpoint without a tower (no
// vision keys, or 0 layers) reads as disabled, and images are refused for it.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace dsv41 {

struct VisionConfig {
  int n_layers = 0;  // 0: no vision tower
  int64_t dim = 0;
  int n_heads = 0;
  int64_t inter_dim = 0;
  int64_t patch_size = 14;
  double rope_theta = 10000;
  int64_t downsample_ratio = 3;
  int64_t max_image_tokens = 1024;  // a cap on the LLM span, delimiters included
  int64_t min_pixels = 544 * 544;
  double max_wh_ratio = 0;  // 0: none (the release)
  int64_t image_token_id = -1;
  // Not configurable in the reference (vision-spec §1.1): RMSNorm eps, and the SDPA scale head_dim^-0.5.
  static constexpr float kNormEps = 1e-6f;

  bool enabled() const { return n_layers > 0; }
  int64_t head_dim() const { return n_heads > 0 ? dim / n_heads : 0; }
  int64_t patch_values() const { return 3 * patch_size * patch_size; }  // one patch flattened (c, y, x)
};

// Reads the vision keys of a parsed config (either form); `where` names the file in errors. Checks
// what the tower's shapes rely on when it is enabled. Throws Error naming the key.
VisionConfig parse_vision_config(const nlohmann::json& root, const std::string& where);
// The keys as each form writes them (empty when the tower is disabled).
nlohmann::json vision_config_hf_json(const VisionConfig& v);
nlohmann::json vision_config_inference_json(const VisionConfig& v);

}  // namespace dsv41
