#include "runtime/image_prepare.h"

#include "image/image_preprocess.h"
#include "util/error.h"

namespace dsv41 {

VisionPreprocessConfig preprocess_config(const VisionConfig& v) {
  VisionPreprocessConfig c;
  c.patch_size = v.patch_size;
  c.downsample_ratio = v.downsample_ratio;
  c.max_image_tokens = v.max_image_tokens;
  c.min_pixels = v.min_pixels;
  if (v.max_wh_ratio > 0) c.max_wh_ratio = v.max_wh_ratio;
  return c;
}

ImageInput prepare_image(std::span<const uint8_t> bytes, const VisionConfig& vision, const ImageDecodeLimits& limits,
                         const std::string& where) {
  if (!vision.enabled()) fail(where, "this model has no vision tower");
  const RgbImage rgb = decode_image(bytes, limits, where);
  PreprocessedImage p = preprocess_image(rgb, preprocess_config(vision));
  ImageInput out;
  out.grid_h = p.plan.n_vit_h;
  out.grid_w = p.plan.n_vit_w;
  out.patches = std::move(p.patches);
  out.key = p.content_hash;
  return out;
}

}  // namespace dsv41
