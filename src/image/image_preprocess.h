// From a decoded image to the ViT's input (vision-spec §3.3-3.4): the plan, Pillow's pad (or
// stretch), the bf16 normalisation and the patch layout, as the reference's image_processor.py.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "image/image_plan.h"
#include "image/rgb_image.h"

namespace dsv41 {

struct PreprocessedImage {
  ImagePlan plan;
  // ImageOps.pad's resize target and where it sits on the (best_w, best_h) canvas; on the stretch
  // path the fitted size is the whole canvas and the offset is 0.
  int64_t fitted_w = 0, fitted_h = 0;
  int64_t pad_x = 0, pad_y = 0;
  RgbImage resized;  // best_w x best_h, the pixels the patches are cut from
  // [num_patches, 3, patch, patch] in row-major grid order, each value a bf16 number held in fp32.
  std::vector<float> patches;
  // XXH3-64 of the decoded pixels, their size and every config value preprocessing reads: two images
  // with the same key give the same patches (the prefix cache keys image spans on it).
  uint64_t content_hash = 0;
};

// The normalised value of a channel level v, as the reference computes it: x = float32(v) / 255,
// (x - 0.5) / 0.5 in fp32, rounded to bf16 (round to nearest even). 0 -> -1, 255 -> 1.
const std::array<float, 256>& pixel_lut();

// The ImageOps.contain size for fitting a w x h image into box_w x box_h (Python round(): half to
// even), and ImageOps.pad's paste offset for it (centering 0.5, half to even).
struct FitResult {
  int64_t w = 0, h = 0, x = 0, y = 0;
};
FitResult pad_fit(int64_t w, int64_t h, int64_t box_w, int64_t box_h);

// The grey canvas ImageOps.pad draws the fitted image on.
inline constexpr uint8_t kPadGrey = 127;

// The whole preprocessing of one image. Fails (dsv41::Error) on an empty image or a plan Pillow
// could not carry out.
PreprocessedImage preprocess_image(const RgbImage& image, const VisionPreprocessConfig& config);

// The content hash alone (what preprocess_image stores in content_hash).
uint64_t image_content_hash(const RgbImage& image, const VisionPreprocessConfig& config);

}  // namespace dsv41
