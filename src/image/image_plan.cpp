#include "image/image_plan.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "util/error.h"

namespace dsv41 {

namespace {

// Every quantity below is a Python float or int in the reference. Sizes are small integers, exact in
// double, so carrying them as double and converting where Python's int() / math.floor / math.ceil do
// gives the same numbers; each expression keeps the reference's operand order (H * beta / p is
// (H * beta) / p, not H * (beta / p)), which decides the cases that land on whole numbers.

struct LlmGrid {
  int64_t h = 0, w = 0;
};

// llm_grid(bh, bw) = (ceil((bh // p) / r), ceil((bw // p) / r)).
LlmGrid llm_grid(int64_t bh, int64_t bw, const VisionPreprocessConfig& c) {
  const double r = static_cast<double>(c.downsample_ratio);
  return {static_cast<int64_t>(std::ceil(static_cast<double>(bh / c.patch_size) / r)),
          static_cast<int64_t>(std::ceil(static_cast<double>(bw / c.patch_size) / r))};
}

struct PixelSize {
  int64_t h = 0, w = 0;
};

// solve_resize_ratio(H, W): the largest same-aspect size whose grid fits max_image_tokens. mw is the
// real root of ratio * n * (n + 1) = M - 2 (n = LLM columns).
PixelSize solve_resize_ratio(double H, double W, const VisionPreprocessConfig& c) {
  const int64_t M = c.max_image_tokens;
  const int64_t cell = c.patch_size * c.downsample_ratio;
  const double p = static_cast<double>(c.patch_size);
  const double ratio = H / W;
  const double mw = std::sqrt(static_cast<double>(M - 2) / ratio + 0.25) - 0.5;
  const double mh = mw * ratio;
  if (mw < 1) return {(M - 2) / 2 * cell, cell};  // very tall: one column of cells
  if (mh < 1) return {cell, (M - 3) * cell};      // very wide: one row of cells
  // floor(mw) * cell is a Python int; dividing it by the float W is one rounding.
  const double beta = std::min(static_cast<double>(static_cast<int64_t>(std::floor(mw)) * cell) / W,
                               static_cast<double>(static_cast<int64_t>(std::floor(mh)) * cell) / H);
  const auto bh = static_cast<int64_t>(std::floor(H * beta / p)) * c.patch_size;
  const auto bw = static_cast<int64_t>(std::floor(W * beta / p)) * c.patch_size;
  return {bh, bw};
}

}  // namespace

ImagePlan plan_image_grid(int64_t width, int64_t height, const VisionPreprocessConfig& c) {
  const std::string where = "image " + std::to_string(width) + "x" + std::to_string(height);
  if (width <= 0 || height <= 0) fail(where, "an image needs a positive width and height");
  if (c.patch_size <= 0 || c.downsample_ratio <= 0 || c.max_image_tokens < 3 || c.min_pixels < 0)
    fail(where, "vision_config needs patch_size and downsample_ratio > 0, max_image_tokens >= 3");
  const double p = static_cast<double>(c.patch_size);
  double W = static_cast<double>(width), H = static_cast<double>(height);

  // 1. Only wide images are clamped (`if max_wh_ratio and ...`: 0 counts as unset, as in Python).
  if (c.max_wh_ratio && *c.max_wh_ratio != 0 && W > H * *c.max_wh_ratio) W = H * *c.max_wh_ratio;
  // 2. Small images are upscaled to about min_pixels; int() truncates, so the area may fall just short.
  const double area = W * H;
  if (0 < area && area < static_cast<double>(c.min_pixels)) {
    const double s = std::sqrt(static_cast<double>(c.min_pixels) / area);
    W = std::trunc(W * s);
    H = std::trunc(H * s);
  }
  // 3. Round up to whole patches.
  int64_t bw = static_cast<int64_t>(std::ceil(W / p)) * c.patch_size;
  int64_t bh = static_cast<int64_t>(std::ceil(H / p)) * c.patch_size;
  LlmGrid g = llm_grid(bh, bw, c);
  // 5. Too many tokens: shrink, keeping the aspect of the (possibly upscaled) size.
  if (num_image_tokens(g.h, g.w) > c.max_image_tokens) {
    const PixelSize s = solve_resize_ratio(H, W, c);
    bh = s.h;
    bw = s.w;
    g = llm_grid(bh, bw, c);
    if (num_image_tokens(g.h, g.w) > c.max_image_tokens)
      fail(where, "the shrunk grid still takes " + std::to_string(num_image_tokens(g.h, g.w)) +
                      " tokens, more than max_image_tokens " + std::to_string(c.max_image_tokens));
  }
  // The reference would go on to ask Pillow for an empty image and fail there.
  if (bw <= 0 || bh <= 0) fail(where, "the planned pixel size is empty (aspect ratio too extreme)");

  ImagePlan plan;
  plan.best_w = bw;
  plan.best_h = bh;
  plan.n_vit_h = bh / c.patch_size;
  plan.n_vit_w = bw / c.patch_size;
  plan.n_llm_h = g.h;
  plan.n_llm_w = g.w;
  plan.num_tokens = num_image_tokens(g.h, g.w);
  return plan;
}

}  // namespace dsv41
