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
  const VisionPreprocessConfig config = preprocess_config(vision);
  // The grid is planned from the header's size before any pixel is decoded: a size no plan can carry
  // (an aspect too extreme) is refused without the decoder's time and memory.
  const ImageHeader header = check_image_header(bytes, limits, where);
  try {
    plan_image_grid(header.width, header.height, config);
  } catch (const Error& e) {
    fail(where, e.what());
  }
  const RgbImage rgb = decode_image(bytes, limits, where);
  PreprocessedImage p = preprocess_image(rgb, config);
  ImageInput out;
  out.grid_h = p.plan.n_vit_h;
  out.grid_w = p.plan.n_vit_w;
  out.patches = std::move(p.patches);
  out.key = p.content_hash;
  return out;
}

}  // namespace dsv41
