// Grid planning for one image (vision-spec §3.2): how many pixels the ViT sees, in how many patches,
// and how many LLM positions the image's span takes. Pure arithmetic on the image's size.
#pragma once

#include <cstdint>
#include <optional>

namespace dsv41 {

// The preprocessing half of the model's vision_config.
struct VisionPreprocessConfig {
  int64_t patch_size = 14;          // p: pixels per patch side
  int64_t downsample_ratio = 3;     // r: ViT patches per LLM position, per side
  int64_t max_image_tokens = 1024;  // M: the longest span one image may take
  int64_t min_pixels = 295936;      // Pmin: smaller images are upscaled to about this area
  std::optional<double> max_wh_ratio;  // null in the released config: wide images are not stretched
};

struct ImagePlan {
  int64_t best_w = 0, best_h = 0;    // the pixel size the ViT sees: multiples of patch_size
  int64_t n_vit_h = 0, n_vit_w = 0;  // ViT patch grid: best / patch_size
  int64_t n_llm_h = 0, n_llm_w = 0;  // LLM grid: ceil(n_vit / downsample_ratio)
  int64_t num_tokens = 0;            // span length: n_llm_h * (n_llm_w + 1) + 2

  int64_t num_patches() const { return n_vit_h * n_vit_w; }
  bool operator==(const ImagePlan&) const = default;
};

// The reference's plan_image_grid(width, height), evaluated in IEEE double in the reference's own
// order so that sizes landing on whole numbers (300 * 0.7 / 14 = 15) land the same way. Fails
// (dsv41::Error) on an empty image or a config for which the shrunk plan still does not fit.
ImagePlan plan_image_grid(int64_t width, int64_t height, const VisionPreprocessConfig& config);

// The span length for an LLM grid of nh rows of nw positions: one start, a newline after every row
// (the last one too), one end.
inline int64_t num_image_tokens(int64_t n_llm_h, int64_t n_llm_w) { return n_llm_h * (n_llm_w + 1) + 2; }

}  // namespace dsv41
