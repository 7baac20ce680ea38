#include "image/image_preprocess.h"

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <xxhash.h>

#include "image/pillow_resample.h"
#include "numeric/formats.h"
#include "util/error.h"

namespace dsv41 {

namespace {

// Python's round() on a double: to nearest, ties to even (nearbyint in the default rounding mode
// does the same, but this does not depend on the thread's floating-point environment).
int64_t round_half_even(double v) {
  const double f = std::floor(v);
  const double d = v - f;
  auto r = static_cast<int64_t>(f);
  if (d > 0.5 || (d == 0.5 && r % 2 != 0)) ++r;
  return r;
}

std::array<float, 256> make_pixel_lut() {
  std::array<float, 256> lut{};
  for (int v = 0; v < 256; ++v) {
    // Each step is one fp32 operation in the reference (uint8 -> float, / 255, - 0.5, / 0.5).
    const float x = static_cast<float>(v) / 255.0f;
    const float y = (x - 0.5f) / 0.5f;
    lut[static_cast<size_t>(v)] = round_bf16(y);
  }
  return lut;
}

// Copies `src` onto `canvas` with its top-left corner at (x, y); src must fit.
void paste(const RgbImage& src, int64_t x, int64_t y, RgbImage& canvas) {
  for (int64_t r = 0; r < src.height; ++r)
    std::memcpy(canvas.row(y + r) + x * 3, src.row(r), static_cast<size_t>(src.width * 3));
}

// x [3, bh, bw] -> reshape(3, nh, p, nw, p).permute(1, 3, 0, 2, 4): patch (gy, gx) at gy * nw + gx,
// each patch (channel, y, x).
std::vector<float> cut_patches(const RgbImage& img, int64_t p) {
  const std::array<float, 256>& lut = pixel_lut();
  const int64_t nh = img.height / p, nw = img.width / p;
  std::vector<float> out(static_cast<size_t>(nh * nw * 3 * p * p));
  float* o = out.data();
  for (int64_t gy = 0; gy < nh; ++gy)
    for (int64_t gx = 0; gx < nw; ++gx)
      for (int64_t c = 0; c < 3; ++c)
        for (int64_t y = 0; y < p; ++y) {
          const uint8_t* row = img.row(gy * p + y) + gx * p * 3 + c;
          for (int64_t x = 0; x < p; ++x) *o++ = lut[row[x * 3]];
        }
  return out;
}

}  // namespace

const std::array<float, 256>& pixel_lut() {
  static const std::array<float, 256> lut = make_pixel_lut();  // immutable once built
  return lut;
}

FitResult pad_fit(int64_t w, int64_t h, int64_t box_w, int64_t box_h) {
  // ImageOps.contain (Pillow 11.1): compare the aspect ratios as doubles; the side that does not fill
  // the box is rounded from the other. The image is resized to this size even when it is the original.
  FitResult f{box_w, box_h, 0, 0};
  const double im_ratio = static_cast<double>(w) / static_cast<double>(h);
  const double dest_ratio = static_cast<double>(box_w) / static_cast<double>(box_h);
  if (im_ratio != dest_ratio) {
    if (im_ratio > dest_ratio)
      f.h = round_half_even(static_cast<double>(h) / static_cast<double>(w) * static_cast<double>(box_w));
    else
      f.w = round_half_even(static_cast<double>(w) / static_cast<double>(h) * static_cast<double>(box_h));
  }
  // ImageOps.pad: only one side can be short; it is centred with round(gap * 0.5).
  if (f.w != box_w) f.x = round_half_even(static_cast<double>(box_w - f.w) * 0.5);
  else if (f.h != box_h) f.y = round_half_even(static_cast<double>(box_h - f.h) * 0.5);
  return f;
}

uint64_t image_content_hash(const RgbImage& image, const VisionPreprocessConfig& config) {
  // The parameters seed the hash of the pixels. A format tag first, so a change to what is hashed
  // (or to the preprocessing itself) can bump it and retire old keys.
  struct Params {
    uint64_t tag, width, height, patch, downsample, max_tokens, min_pixels, has_ratio;
    double ratio;
  } params{0x64737634316d6731ULL,  // "dsv41mg1"
           static_cast<uint64_t>(image.width),
           static_cast<uint64_t>(image.height),
           static_cast<uint64_t>(config.patch_size),
           static_cast<uint64_t>(config.downsample_ratio),
           static_cast<uint64_t>(config.max_image_tokens),
           static_cast<uint64_t>(config.min_pixels),
           config.max_wh_ratio.has_value() ? 1u : 0u,
           config.max_wh_ratio.value_or(0.0)};
  const XXH64_hash_t seed = XXH3_64bits(&params, sizeof(params));
  return XXH3_64bits_withSeed(image.pixels.data(), image.pixels.size(), seed);
}

PreprocessedImage preprocess_image(const RgbImage& image, const VisionPreprocessConfig& config) {
  if (image.width <= 0 || image.height <= 0 ||
      image.pixels.size() != static_cast<size_t>(image.width * image.height * 3))
    fail("image", "the decoded image is empty or its pixel buffer does not match its size");
  PreprocessedImage out;
  out.plan = plan_image_grid(image.width, image.height, config);
  const int64_t bw = out.plan.best_w, bh = out.plan.best_h;

  const double ratio = config.max_wh_ratio.value_or(0.0);
  const bool stretch = ratio != 0 && static_cast<double>(image.width) >= ratio * static_cast<double>(image.height);
  if (stretch) {
    // image.resize((bw, bh)): the aspect is not kept.
    out.fitted_w = bw;
    out.fitted_h = bh;
    out.resized = resize_bicubic(image, bw, bh);
  } else {
    const FitResult f = pad_fit(image.width, image.height, bw, bh);
    if (f.w <= 0 || f.h <= 0)
      fail("image " + std::to_string(image.width) + "x" + std::to_string(image.height),
           "too thin to fit into " + std::to_string(bw) + "x" + std::to_string(bh) + " pixels");
    out.fitted_w = f.w;
    out.fitted_h = f.h;
    out.pad_x = f.x;
    out.pad_y = f.y;
    RgbImage fitted = resize_bicubic(image, f.w, f.h);
    if (f.w == bw && f.h == bh) {
      out.resized = std::move(fitted);
    } else {
      out.resized = RgbImage(bw, bh);
      std::memset(out.resized.pixels.data(), kPadGrey, out.resized.pixels.size());
      paste(fitted, f.x, f.y, out.resized);
    }
  }
  out.patches = cut_patches(out.resized, config.patch_size);
  out.content_hash = image_content_hash(image, config);
  return out;
}

}  // namespace dsv41
