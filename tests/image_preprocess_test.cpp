// Image preprocessing (src/image, vision-spec §3): the plans, pixels and patches of the tiny-vision
// goldens bit for bit, the released-config plan table, Pillow's decoding rules for each PNG mode,
// JPEG decoding, and every way a hostile or broken file is refused.
#include <gtest/gtest.h>

#include <png.h>
// jpeglib.h needs FILE and size_t first.
#include <csetjmp>
#include <cstdio>
#include <jpeglib.h>

#include <array>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "golden_util.h"
#include "image/image_decode.h"
#include "image/image_plan.h"
#include "image/image_preprocess.h"
#include "image/pillow_resample.h"
#include "io/vision_config.h"
#include "runtime/image_prepare.h"
#include "test_util.h"
#include "util/error.h"

namespace dsv41 {
namespace {

using nlohmann::json;

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

VisionPreprocessConfig config_from(const json& vc) {
  VisionPreprocessConfig c;
  c.patch_size = vc.at("patch_size").get<int64_t>();
  c.downsample_ratio = vc.at("downsample_ratio").get<int64_t>();
  c.max_image_tokens = vc.at("max_image_tokens").get<int64_t>();
  c.min_pixels = vc.at("min_pixels").get<int64_t>();
  if (!vc.at("max_wh_ratio").is_null()) c.max_wh_ratio = vc.at("max_wh_ratio").get<double>();
  return c;
}

VisionPreprocessConfig config_of(const std::string& config_json) {
  std::ifstream in(config_json);
  return config_from(json::parse(in).at("vision_config"));
}

VisionPreprocessConfig tiny_config() { return config_of(test::golden_dir("tiny-vision") + "/config.json"); }

// The message of the dsv41::Error `f` throws; fails the test when it throws nothing or another type.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a dsv41::Error: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no error";
  return "";
}

// ---- the tiny-vision goldens ---------------------------------------------------------------------

class GoldenImage : public ::testing::TestWithParam<const char*> {};

TEST_P(GoldenImage, PlanPixelsAndPatchesAreBitExact) {
  const std::string name = GetParam();
  const std::string dir = test::golden_dir("tiny-vision");
  std::ifstream meta_in(dir + "/golden.json");
  const json g = json::parse(meta_in).at("images").at(name);

  const RgbImage img = decode_image(read_file(dir + "/" + g.at("png").get<std::string>()), {});
  ASSERT_EQ(img.width, g.at("size_wh")[0].get<int64_t>());
  ASSERT_EQ(img.height, g.at("size_wh")[1].get<int64_t>());

  const PreprocessedImage p = preprocess_image(img, tiny_config());
  EXPECT_EQ(p.plan.best_w, g.at("best_wh")[0].get<int64_t>());
  EXPECT_EQ(p.plan.best_h, g.at("best_wh")[1].get<int64_t>());
  EXPECT_EQ(p.plan.n_vit_h, g.at("n_vit_hw")[0].get<int64_t>());
  EXPECT_EQ(p.plan.n_vit_w, g.at("n_vit_hw")[1].get<int64_t>());
  EXPECT_EQ(p.plan.n_llm_h, g.at("n_llm_hw")[0].get<int64_t>());
  EXPECT_EQ(p.plan.n_llm_w, g.at("n_llm_hw")[1].get<int64_t>());
  EXPECT_EQ(p.plan.num_tokens, g.at("num_tokens").get<int64_t>());
  EXPECT_EQ(p.fitted_w, g.at("fitted_wh")[0].get<int64_t>());
  EXPECT_EQ(p.fitted_h, g.at("fitted_wh")[1].get<int64_t>());
  EXPECT_EQ(p.pad_x, g.at("pad_offset_xy")[0].get<int64_t>());
  EXPECT_EQ(p.pad_y, g.at("pad_offset_xy")[1].get<int64_t>());

  const auto resized = test::read_array<uint8_t>(dir + "/" + g.at("resized_u8").at("file").get<std::string>());
  ASSERT_EQ(p.resized.pixels.size(), resized.size());
  size_t differing = 0;
  for (size_t i = 0; i < resized.size(); ++i) differing += p.resized.pixels[i] != resized[i];
  EXPECT_EQ(differing, 0u) << "of " << resized.size() << " resized bytes";

  const auto patches = test::read_array<float>(dir + "/" + g.at("patches").at("file").get<std::string>());
  ASSERT_EQ(p.patches.size(), patches.size());
  ASSERT_EQ(static_cast<int64_t>(p.patches.size()), p.plan.num_patches() * 3 * 14 * 14);
  differing = 0;
  for (size_t i = 0; i < patches.size(); ++i) differing += std::memcmp(&p.patches[i], &patches[i], sizeof(float)) != 0;
  EXPECT_EQ(differing, 0u) << "of " << patches.size() << " patch values";
}

INSTANTIATE_TEST_SUITE_P(TinyVision, GoldenImage, ::testing::Values("a", "b", "c"));

TEST(ImagePreprocess, PixelLutMatchesTheReference) {
  const auto lut = test::read_array<float>(test::golden_dir("tiny-vision") + "/golden_pixel_lut.f32");
  ASSERT_EQ(lut.size(), 256u);
  EXPECT_EQ(std::memcmp(lut.data(), pixel_lut().data(), sizeof(float) * 256), 0);
  EXPECT_EQ(pixel_lut()[0], -1.0f);
  EXPECT_EQ(pixel_lut()[127], -0.003936767578125f);  // bf16 of -0.0039215...
  EXPECT_EQ(pixel_lut()[128], 0.003936767578125f);
  EXPECT_EQ(pixel_lut()[255], 1.0f);
}

// ---- plan_image_grid -----------------------------------------------------------------------------

struct PlanRow {
  int64_t w, h, bw, bh, vit_h, vit_w, llm_h, llm_w, tokens;
};

// vision-spec §3.2's table, computed there with the reference's functions.
TEST(ImagePlan, ReleasedConfigTable) {
  const VisionPreprocessConfig c = config_of(test::released_config());
  ASSERT_EQ(c.max_image_tokens, 1024);
  ASSERT_EQ(c.min_pixels, 295936);
  const PlanRow rows[] = {
      {224, 224, 546, 546, 39, 39, 13, 13, 184},       {640, 480, 644, 490, 35, 46, 12, 16, 206},
      {1024, 768, 1036, 770, 55, 74, 19, 25, 496},     {1280, 720, 1288, 728, 52, 92, 18, 31, 578},
      {1920, 1080, 1708, 966, 69, 122, 23, 41, 968},   {1344, 1344, 1302, 1302, 93, 93, 31, 31, 994},
      {4000, 3000, 1512, 1134, 81, 108, 27, 36, 1001}, {50, 3000, 70, 4214, 301, 5, 101, 2, 305},
      {10000, 100, 10010, 112, 8, 715, 3, 239, 722},   {1, 1, 546, 546, 39, 39, 13, 13, 184},
  };
  for (const PlanRow& r : rows) {
    SCOPED_TRACE(std::to_string(r.w) + "x" + std::to_string(r.h));
    const ImagePlan p = plan_image_grid(r.w, r.h, c);
    EXPECT_EQ(p.best_w, r.bw);
    EXPECT_EQ(p.best_h, r.bh);
    EXPECT_EQ(p.n_vit_h, r.vit_h);
    EXPECT_EQ(p.n_vit_w, r.vit_w);
    EXPECT_EQ(p.n_llm_h, r.llm_h);
    EXPECT_EQ(p.n_llm_w, r.llm_w);
    EXPECT_EQ(p.num_tokens, r.tokens);
    EXPECT_EQ(p.num_tokens, num_image_tokens(p.n_llm_h, p.n_llm_w));
  }
}

// The tiny config's extremes (values from the reference's formulas evaluated in Python): the single
// column (mw < 1) and single row (mh < 1) shapes, the upscale landing exactly on min_pixels, and the
// max_wh_ratio clamp.
TEST(ImagePlan, TinyConfigExtremes) {
  const VisionPreprocessConfig c = tiny_config();
  const PlanRow rows[] = {
      {10, 3000, 42, 966, 69, 3, 23, 1, 48},   {5, 20000, 42, 966, 69, 3, 23, 1, 48},
      {3000, 10, 1890, 42, 3, 135, 1, 45, 48}, {1, 1, 126, 126, 9, 9, 3, 3, 14},
      {126, 126, 126, 126, 9, 9, 3, 3, 14},    {127, 125, 140, 126, 9, 10, 3, 4, 17},
      {1000, 999, 252, 238, 17, 18, 6, 6, 44},
  };
  for (const PlanRow& r : rows) {
    SCOPED_TRACE(std::to_string(r.w) + "x" + std::to_string(r.h));
    const ImagePlan p = plan_image_grid(r.w, r.h, c);
    EXPECT_EQ(p, (ImagePlan{r.bw, r.bh, r.vit_h, r.vit_w, r.llm_h, r.llm_w, r.tokens}));
  }
  VisionPreprocessConfig ratio = c;
  ratio.max_wh_ratio = 2.0;
  EXPECT_EQ(plan_image_grid(300, 100, ratio), (ImagePlan{210, 112, 8, 15, 3, 5, 20}));  // W clamped to 200
  EXPECT_EQ(plan_image_grid(150, 100, ratio), (ImagePlan{154, 112, 8, 11, 3, 4, 17}));
  EXPECT_NE(error_of([&] { plan_image_grid(0, 10, c); }).find("positive"), std::string::npos);
}

// ---- pad, stretch, resample, hash ----------------------------------------------------------------

TEST(ImagePreprocess, PadOffsetsRoundHalfToEven) {
  const FitResult a = pad_fit(100, 60, 168, 98);  // image a: 163 wide, a gap of 5 -> 2 left, 3 right
  EXPECT_EQ(a.w, 163);
  EXPECT_EQ(a.h, 98);
  EXPECT_EQ(a.x, 2);
  EXPECT_EQ(a.y, 0);
  const FitResult b = pad_fit(150, 100, 154, 112);  // round(102.67) = 103 high, gap 9 -> round(4.5) = 4
  EXPECT_EQ(b.w, 154);
  EXPECT_EQ(b.h, 103);
  EXPECT_EQ(b.x, 0);
  EXPECT_EQ(b.y, 4);
  const FitResult c = pad_fit(100, 100, 107, 100);  // gap 7 -> round(3.5) = 4
  EXPECT_EQ(c.w, 100);
  EXPECT_EQ(c.x, 4);
  const FitResult same = pad_fit(400, 300, 280, 210);  // same aspect: fills the box
  EXPECT_EQ(same.w, 280);
  EXPECT_EQ(same.h, 210);
  EXPECT_EQ(same.x + same.y, 0);
}

RgbImage solid(int64_t w, int64_t h, uint8_t r, uint8_t g, uint8_t b) {
  RgbImage img(w, h);
  for (int64_t i = 0; i < w * h; ++i) {
    img.pixels[static_cast<size_t>(i * 3)] = r;
    img.pixels[static_cast<size_t>(i * 3 + 1)] = g;
    img.pixels[static_cast<size_t>(i * 3 + 2)] = b;
  }
  return img;
}

TEST(ImagePreprocess, PadPathDrawsGreyBandsStretchPathDoesNot) {
  VisionPreprocessConfig c = tiny_config();
  c.max_wh_ratio = 2.0;
  // 150 x 100 is not wide enough to stretch: padded into 154 x 112, rows 0-3 and 107-111 grey.
  const PreprocessedImage padded = preprocess_image(solid(150, 100, 200, 10, 90), c);
  EXPECT_EQ(padded.fitted_h, 103);
  EXPECT_EQ(padded.pad_y, 4);
  for (int64_t y : {0, 3, 107, 111}) EXPECT_EQ(padded.resized.row(y)[5 * 3], kPadGrey) << "row " << y;
  for (int64_t y : {4, 55, 106}) EXPECT_EQ(padded.resized.row(y)[5 * 3], 200) << "row " << y;
  // 300 x 100 >= 2 x 100: stretched to the whole 210 x 112 canvas, no grey anywhere.
  const PreprocessedImage stretched = preprocess_image(solid(300, 100, 200, 10, 90), c);
  EXPECT_EQ(stretched.plan.best_w, 210);
  EXPECT_EQ(stretched.fitted_w, 210);
  EXPECT_EQ(stretched.fitted_h, 112);
  for (size_t i = 0; i < stretched.resized.pixels.size(); i += 3) {
    ASSERT_EQ(stretched.resized.pixels[i], 200);
    ASSERT_EQ(stretched.resized.pixels[i + 1], 10);
    ASSERT_EQ(stretched.resized.pixels[i + 2], 90);
  }
  // A patch of the stretched image: every value is the LUT entry of its channel.
  EXPECT_EQ(stretched.patches[0], pixel_lut()[200]);
  EXPECT_EQ(stretched.patches[14 * 14], pixel_lut()[10]);
  EXPECT_EQ(stretched.patches[2 * 14 * 14 + 195], pixel_lut()[90]);
}

TEST(PillowResample, HandComputedValues) {
  // 2 -> 1 columns: two taps of weight exactly 0.5 (2^21 in fixed point); sums start at 2^21, so
  // halves round up: (10 + 21) / 2 = 15.5 -> 16.
  RgbImage two(2, 1);
  two.pixels = {10, 20, 30, 21, 41, 61};
  const RgbImage one = resize_bicubic(two, 1, 1);
  EXPECT_EQ(one.pixels, (std::vector<uint8_t>{16, 31, 46}));
  // Cubic overshoot is clipped: a step 0 | 255 upscaled rings below 0 and above 255.
  RgbImage step(4, 1);
  step.pixels = {0, 0, 0, 0, 0, 0, 255, 255, 255, 255, 255, 255};
  const RgbImage up = resize_bicubic(step, 16, 1);
  EXPECT_EQ(up.pixels.front(), 0);
  EXPECT_EQ(up.pixels.back(), 255);
  // A constant image stays constant, up or down, in either direction.
  for (auto [w, h] : {std::pair<int64_t, int64_t>{100, 61}, {11, 7}, {37, 5}, {3, 23}}) {
    const RgbImage r = resize_bicubic(solid(37, 23, 255, 1, 128), w, h);
    ASSERT_EQ(r.width, w);
    ASSERT_EQ(r.height, h);
    for (size_t i = 0; i < r.pixels.size(); i += 3)
      ASSERT_TRUE(r.pixels[i] == 255 && r.pixels[i + 1] == 1 && r.pixels[i + 2] == 128) << w << "x" << h;
  }
  // The same size is a copy.
  const RgbImage same = resize_bicubic(two, 2, 1);
  EXPECT_EQ(same.pixels, two.pixels);
}

TEST(ImagePreprocess, ContentHashCoversPixelsSizeAndConfig) {
  const VisionPreprocessConfig c = tiny_config();
  RgbImage img = solid(30, 20, 1, 2, 3);
  const uint64_t h = image_content_hash(img, c);
  EXPECT_EQ(h, preprocess_image(img, c).content_hash);
  EXPECT_EQ(h, image_content_hash(solid(30, 20, 1, 2, 3), c));
  img.pixels[100] ^= 1;
  EXPECT_NE(h, image_content_hash(img, c));
  EXPECT_NE(h, image_content_hash(solid(20, 30, 1, 2, 3), c));  // same bytes, other shape
  VisionPreprocessConfig other = c;
  other.max_image_tokens = 47;
  EXPECT_NE(h, image_content_hash(solid(30, 20, 1, 2, 3), other));
  other = c;
  other.max_wh_ratio = 2.0;
  EXPECT_NE(h, image_content_hash(solid(30, 20, 1, 2, 3), other));
}

// ---- PNG decoding: each mode as Pillow 11.1 converts it ------------------------------------------

struct PngSpec {
  uint32_t width = 0, height = 0;
  int color_type = PNG_COLOR_TYPE_GRAY, bit_depth = 8;
  bool interlaced = false;
  std::vector<uint8_t> rows;  // packed rows as PNG stores them (16-bit big-endian)
  std::vector<png_color> palette;
  std::vector<uint8_t> trns;  // palette alpha
};

void png_sink(png_structp png, png_bytep data, size_t n) {
  auto* out = static_cast<std::vector<uint8_t>*>(png_get_io_ptr(png));
  out->insert(out->end(), data, data + n);
}
void png_flush(png_structp) {}

// Writes a PNG with libpng itself; empty on a libpng error (then the test fails on the decode).
std::vector<uint8_t> encode_png(const PngSpec& s) {
  auto out = std::make_unique<std::vector<uint8_t>>();
  auto rows = std::make_unique<std::vector<png_bytep>>();
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    return {};
  }
  png_set_write_fn(png, out.get(), png_sink, png_flush);
  png_set_check_for_invalid_index(png, 0);  // let a test write indices past PLTE
  png_set_IHDR(png, info, s.width, s.height, s.bit_depth, s.color_type,
               s.interlaced ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  if (!s.palette.empty()) png_set_PLTE(png, info, s.palette.data(), static_cast<int>(s.palette.size()));
  if (!s.trns.empty()) png_set_tRNS(png, info, s.trns.data(), static_cast<int>(s.trns.size()), nullptr);
  png_write_info(png, info);
  const size_t stride = s.rows.size() / s.height;
  for (uint32_t y = 0; y < s.height; ++y) rows->push_back(const_cast<png_bytep>(s.rows.data() + y * stride));
  png_write_image(png, rows->data());
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return std::move(*out);
}

// The decoded pixels as a flat list.
std::vector<uint8_t> decode_png_spec(const PngSpec& s) {
  const std::vector<uint8_t> bytes = encode_png(s);
  EXPECT_FALSE(bytes.empty());
  const RgbImage img = decode_image(bytes, {});
  EXPECT_EQ(img.width, s.width);
  EXPECT_EQ(img.height, s.height);
  return img.pixels;
}

std::vector<uint8_t> grey3(std::initializer_list<int> levels) {
  std::vector<uint8_t> v;
  for (int g : levels) v.insert(v.end(), 3, static_cast<uint8_t>(g));
  return v;
}

TEST(ImageDecodePng, GreyAtEveryBitDepth) {
  // 8-bit grey g -> (g, g, g).
  EXPECT_EQ(decode_png_spec({4, 1, PNG_COLOR_TYPE_GRAY, 8, false, {0, 1, 128, 255}, {}, {}}),
            grey3({0, 1, 128, 255}));
  // 1-bit: Pillow's mode "1", 1 -> 255. Pixels 1 0 1 1 0 0 0 1 1 0 (10 wide, padded to 2 bytes).
  EXPECT_EQ(decode_png_spec({10, 1, PNG_COLOR_TYPE_GRAY, 1, false, {0b10110001, 0b10000000}, {}, {}}),
            grey3({255, 0, 255, 255, 0, 0, 0, 255, 255, 0}));
  // 2-bit "L;2": level x 0x55. Pixels 0 1 2 3 | 3.
  EXPECT_EQ(decode_png_spec({5, 1, PNG_COLOR_TYPE_GRAY, 2, false, {0b00011011, 0b11000000}, {}, {}}),
            grey3({0, 85, 170, 255, 255}));
  // 4-bit "L;4": level x 0x11. Pixels 0 7 | 15.
  EXPECT_EQ(decode_png_spec({3, 1, PNG_COLOR_TYPE_GRAY, 4, false, {0x07, 0xF0}, {}, {}}), grey3({0, 119, 255}));
  // 16-bit opens as "I;16", and I;16 -> RGB clips at 255 (it does not take the high byte).
  EXPECT_EQ(decode_png_spec({5, 1, PNG_COLOR_TYPE_GRAY, 16, false, {0x00, 0x00, 0x00, 0xFE, 0x01, 0x00, 0xAB, 0xCD, 0x00, 0x80}, {}, {}}),
            grey3({0, 254, 255, 255, 128}));
}

TEST(ImageDecodePng, AlphaIsDroppedNotComposited) {
  // Grey + alpha, 8-bit: the grey under alpha 0 is kept.
  EXPECT_EQ(decode_png_spec({3, 1, PNG_COLOR_TYPE_GRAY_ALPHA, 8, false, {10, 0, 20, 128, 30, 255}, {}, {}}),
            grey3({10, 20, 30}));
  // Grey + alpha, 16-bit: opens as RGBA from "LA;16B", the high byte of the grey.
  EXPECT_EQ(decode_png_spec({2, 1, PNG_COLOR_TYPE_GRAY_ALPHA, 16, false, {0x12, 0xFF, 0x00, 0x00, 0xAB, 0x01, 0xFF, 0xFF}, {}, {}}),
            grey3({0x12, 0xAB}));
  // RGBA 8-bit.
  EXPECT_EQ(decode_png_spec({2, 1, PNG_COLOR_TYPE_RGB_ALPHA, 8, false, {1, 2, 3, 0, 250, 251, 252, 7}, {}, {}}),
            (std::vector<uint8_t>{1, 2, 3, 250, 251, 252}));
  // RGBA 16-bit "RGBA;16B": high bytes.
  EXPECT_EQ(decode_png_spec({1, 1, PNG_COLOR_TYPE_RGB_ALPHA, 16, false, {0x11, 0xFF, 0x22, 0x00, 0x33, 0x80, 0x00, 0x00}, {}, {}}),
            (std::vector<uint8_t>{0x11, 0x22, 0x33}));
}

TEST(ImageDecodePng, Rgb16TakesTheHighByte) {
  // "RGB;16B" unpacks each sample to its high byte (no rounding: 0x12FF -> 0x12).
  EXPECT_EQ(decode_png_spec({2, 1, PNG_COLOR_TYPE_RGB, 16, false,
                             {0x12, 0xFF, 0x00, 0x80, 0xFF, 0x00, 0x01, 0x00, 0x7F, 0xFF, 0x80, 0x00}, {}, {}}),
            (std::vector<uint8_t>{0x12, 0x00, 0xFF, 0x01, 0x7F, 0x80}));
}

TEST(ImageDecodePng, PaletteWithTransparencyAndShortPalettes) {
  const std::vector<png_color> pal = {{255, 0, 0}, {0, 255, 0}, {0, 0, 255}, {9, 8, 7}};
  // 8-bit indices, tRNS making entry 0 transparent: the colours are the palette's all the same; an
  // index past the 4 entries is black (Pillow's palette is zero-filled beyond PLTE).
  EXPECT_EQ(decode_png_spec({5, 1, PNG_COLOR_TYPE_PALETTE, 8, false, {0, 1, 2, 3, 200}, pal, {0, 128}}),
            (std::vector<uint8_t>{255, 0, 0, 0, 255, 0, 0, 0, 255, 9, 8, 7, 0, 0, 0}));
  // 2-bit indices 3 2 1 0 | 1.
  EXPECT_EQ(decode_png_spec({5, 1, PNG_COLOR_TYPE_PALETTE, 2, false, {0b11100100, 0b01000000}, pal, {}}),
            (std::vector<uint8_t>{9, 8, 7, 0, 0, 255, 0, 255, 0, 255, 0, 0, 0, 255, 0}));
  // 1-bit and 4-bit indices.
  const std::vector<png_color> pal2(pal.begin(), pal.begin() + 2);  // 1-bit: at most 2 entries
  EXPECT_EQ(decode_png_spec({3, 1, PNG_COLOR_TYPE_PALETTE, 1, false, {0b01000000}, pal2, {}}),
            (std::vector<uint8_t>{255, 0, 0, 0, 255, 0, 255, 0, 0}));
  EXPECT_EQ(decode_png_spec({2, 1, PNG_COLOR_TYPE_PALETTE, 4, false, {0x31}, pal, {}}),
            (std::vector<uint8_t>{9, 8, 7, 0, 255, 0}));
}

TEST(ImageDecodePng, InterlacedEqualsTheSamePixels) {
  // Adam7 at odd sizes (passes with partial blocks), 8-bit RGB and 1-bit grey.
  std::mt19937 rng(7);
  PngSpec rgb{13, 11, PNG_COLOR_TYPE_RGB, 8, true, {}, {}, {}};
  for (int i = 0; i < 13 * 11 * 3; ++i) rgb.rows.push_back(static_cast<uint8_t>(rng()));
  EXPECT_EQ(decode_png_spec(rgb), rgb.rows);
  rgb.interlaced = false;
  EXPECT_EQ(decode_png_spec(rgb), rgb.rows);

  PngSpec bits{9, 5, PNG_COLOR_TYPE_GRAY, 1, true, {}, {}, {}};
  std::vector<uint8_t> expect;
  for (int y = 0; y < 5; ++y) {
    const auto b0 = static_cast<uint8_t>(rng()), b1 = static_cast<uint8_t>(rng() & 0x80);
    bits.rows.push_back(b0);
    bits.rows.push_back(b1);
    for (int x = 0; x < 9; ++x) {
      const int bit = x < 8 ? (b0 >> (7 - x)) & 1 : b1 >> 7;
      expect.insert(expect.end(), 3, static_cast<uint8_t>(bit ? 255 : 0));
    }
  }
  EXPECT_EQ(decode_png_spec(bits), expect);
}

TEST(ImageDecodePng, ProbeReadsTheHeaderOnly) {
  const std::vector<uint8_t> bytes = encode_png({7, 3, PNG_COLOR_TYPE_GRAY, 8, false, std::vector<uint8_t>(21, 5), {}, {}});
  const ImageHeader h = probe_image(bytes);
  EXPECT_EQ(h.format, ImageFormat::Png);
  EXPECT_EQ(h.width, 7);
  EXPECT_EQ(h.height, 3);
}

// ---- JPEG decoding -------------------------------------------------------------------------------

struct JpegSink {
  jpeg_error_mgr err{};
  std::jmp_buf jump{};
  unsigned char* data = nullptr;
  unsigned long size = 0;
  ~JpegSink() { std::free(data); }
};

[[noreturn]] void jpeg_test_error(j_common_ptr cinfo) {
  std::longjmp(static_cast<JpegSink*>(cinfo->client_data)->jump, 1);
}

// Encodes `samples` (components per pixel: 1 grey, 3 RGB, 4 CMYK) with libjpeg; empty on error.
std::vector<uint8_t> encode_jpeg(const std::vector<uint8_t>& samples, int w, int h, int components, int quality) {
  auto sink = std::make_unique<JpegSink>();
  auto cinfo = std::make_unique<jpeg_compress_struct>();
  cinfo->err = jpeg_std_error(&sink->err);
  sink->err.error_exit = jpeg_test_error;
  cinfo->client_data = sink.get();
  if (setjmp(sink->jump)) {
    jpeg_destroy_compress(cinfo.get());
    return {};
  }
  jpeg_create_compress(cinfo.get());
  jpeg_mem_dest(cinfo.get(), &sink->data, &sink->size);
  cinfo->image_width = static_cast<JDIMENSION>(w);
  cinfo->image_height = static_cast<JDIMENSION>(h);
  cinfo->input_components = components;
  cinfo->in_color_space = components == 1 ? JCS_GRAYSCALE : components == 3 ? JCS_RGB : JCS_CMYK;
  jpeg_set_defaults(cinfo.get());
  jpeg_set_quality(cinfo.get(), quality, TRUE);
  jpeg_start_compress(cinfo.get(), TRUE);
  while (cinfo->next_scanline < cinfo->image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(samples.data() + static_cast<size_t>(cinfo->next_scanline) * static_cast<size_t>(w * components));
    jpeg_write_scanlines(cinfo.get(), &row, 1);
  }
  jpeg_finish_compress(cinfo.get());
  jpeg_destroy_compress(cinfo.get());
  return std::vector<uint8_t>(sink->data, sink->data + sink->size);
}

int max_abs_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  int m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(int(a[i]) - int(b[i])));
  return m;
}

TEST(ImageDecodeJpeg, RgbAndGreyDecodeCloseAndDeterministic) {
  const int w = 40, h = 24;
  std::vector<uint8_t> rgb;
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      rgb.push_back(static_cast<uint8_t>(x * 6));
      rgb.push_back(static_cast<uint8_t>(y * 10));
      rgb.push_back(static_cast<uint8_t>(128 + x - y));
    }
  const std::vector<uint8_t> jpg = encode_jpeg(rgb, w, h, 3, 95);
  ASSERT_FALSE(jpg.empty());
  EXPECT_EQ(probe_image(jpg).format, ImageFormat::Jpeg);
  EXPECT_EQ(probe_image(jpg).width, w);
  EXPECT_EQ(probe_image(jpg).height, h);
  const RgbImage a = decode_image(jpg, {});
  ASSERT_EQ(a.width, w);
  ASSERT_EQ(a.height, h);
  EXPECT_LE(max_abs_diff(a.pixels, rgb), 12);  // JPEG's own loss at quality 95 (YCbCr, 4:2:0)
  EXPECT_EQ(decode_image(jpg, {}).pixels, a.pixels);

  std::vector<uint8_t> grey;
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) grey.push_back(static_cast<uint8_t>(x * 3 + y * 4));
  const RgbImage g = decode_image(encode_jpeg(grey, w, h, 1, 95), {});
  ASSERT_EQ(g.pixels.size(), grey.size() * 3);
  std::vector<uint8_t> red;
  for (size_t i = 0; i < grey.size(); ++i) {
    EXPECT_TRUE(g.pixels[i * 3] == g.pixels[i * 3 + 1] && g.pixels[i * 3] == g.pixels[i * 3 + 2]);
    red.push_back(g.pixels[i * 3]);
  }
  EXPECT_LE(max_abs_diff(red, grey), 6);
}

TEST(ImageDecodeJpeg, CmykUsesPillowsInvertedConversion) {
  // Stored CMYK bytes (s_c, s_k) are read as Adobe-inverted (c = 255 - s_c, k = 255 - s_k), then
  // R = (255 - k) - c * (255 - k) / 255: for s_k = 255 that is s_c itself, for s_k = 128 about half.
  const int w = 16, h = 16;
  std::vector<uint8_t> full, half;
  for (int i = 0; i < w * h; ++i) {
    full.insert(full.end(), {200, 100, 50, 255});
    half.insert(half.end(), {200, 100, 50, 128});
  }
  const RgbImage a = decode_image(encode_jpeg(full, w, h, 4, 100), {});
  const RgbImage b = decode_image(encode_jpeg(half, w, h, 4, 100), {});
  for (size_t i = 0; i < a.pixels.size(); i += 3) {
    ASSERT_NEAR(a.pixels[i], 200, 2);
    ASSERT_NEAR(a.pixels[i + 1], 100, 2);
    ASSERT_NEAR(a.pixels[i + 2], 50, 2);
    ASSERT_NEAR(b.pixels[i], 100, 2);  // 200 * 128 / 255
    ASSERT_NEAR(b.pixels[i + 1], 50, 2);
    ASSERT_NEAR(b.pixels[i + 2], 25, 2);
  }
}

// ---- refusals ------------------------------------------------------------------------------------

uint32_t crc32(const uint8_t* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}

void put_be32(std::vector<uint8_t>& v, uint32_t x) {
  for (int s = 24; s >= 0; s -= 8) v.push_back(static_cast<uint8_t>(x >> s));
}

// A PNG signature and a well-formed IHDR claiming w x h RGB, then a small bogus IDAT.
std::vector<uint8_t> png_claiming(uint32_t w, uint32_t h) {
  std::vector<uint8_t> v = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<uint8_t> chunk = {'I', 'H', 'D', 'R'};
  put_be32(chunk, w);
  put_be32(chunk, h);
  chunk.insert(chunk.end(), {8, 2, 0, 0, 0});
  put_be32(v, 13);
  v.insert(v.end(), chunk.begin(), chunk.end());
  put_be32(v, crc32(chunk.data(), chunk.size()));
  v.insert(v.end(), {0, 0, 0, 4, 'I', 'D', 'A', 'T', 0x78, 0x9C, 0, 0, 0, 0, 0, 0});
  return v;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(ImageDecodeErrors, EmptyRandomAndUnknownFormats) {
  EXPECT_TRUE(contains(error_of([] { decode_image({}, {}, "messages[0].content[1]"); }), "messages[0].content[1]: empty"));
  std::mt19937 rng(3);
  std::vector<uint8_t> noise(1000);
  for (auto& b : noise) b = static_cast<uint8_t>(rng());
  noise[0] = 0x42;  // not 0x89 or 0xFF
  EXPECT_TRUE(contains(error_of([&] { decode_image(noise, {}); }), "unsupported image format"));
  const std::vector<uint8_t> gif = {'G', 'I', 'F', '8', '9', 'a', 1, 0, 1, 0};
  EXPECT_TRUE(contains(error_of([&] { decode_image(gif, {}); }), "not PNG or JPEG"));
  // Random bytes after a PNG signature, and after a JPEG SOI.
  std::vector<uint8_t> png_noise = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  png_noise.insert(png_noise.end(), noise.begin(), noise.end());
  EXPECT_TRUE(contains(error_of([&] { decode_image(png_noise, {}); }), "PNG"));
  std::vector<uint8_t> jpeg_noise = {0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x10};
  jpeg_noise.insert(jpeg_noise.end(), noise.begin(), noise.end());
  EXPECT_TRUE(contains(error_of([&] { decode_image(jpeg_noise, {}); }), "JPEG"));
}

TEST(ImageDecodeErrors, TruncatedPngAtEveryStage) {
  std::mt19937 rng(5);
  PngSpec spec{64, 48, PNG_COLOR_TYPE_RGB, 8, false, {}, {}, {}};
  for (int i = 0; i < 64 * 48 * 3; ++i) spec.rows.push_back(static_cast<uint8_t>(rng()));  // incompressible
  const std::vector<uint8_t> png = encode_png(spec);
  ASSERT_GT(png.size(), 9000u);
  EXPECT_EQ(decode_image(png, {}).pixels, spec.rows);
  // Inside the signature, inside IHDR, just after IHDR, inside the image data (whose last rows
  // would be missing: Pillow refuses those too).
  for (size_t cut : {size_t{5}, size_t{20}, size_t{33}, size_t{40}, png.size() / 2, png.size() - 40}) {
    const std::vector<uint8_t> part(png.begin(), png.begin() + static_cast<std::ptrdiff_t>(cut));
    EXPECT_TRUE(contains(error_of([&] { decode_image(part, {}); }), "truncated")) << "cut at " << cut;
  }
}

TEST(ImageDecodeErrors, CorruptPngChecksumsAreRefused) {
  std::vector<uint8_t> png = encode_png({4, 4, PNG_COLOR_TYPE_GRAY, 8, false, std::vector<uint8_t>(16, 9), {}, {}});
  png[29] ^= 0xFF;  // IHDR's CRC
  EXPECT_TRUE(contains(error_of([&] { decode_image(png, {}); }), "corrupt or unsupported PNG"));
}

TEST(ImageDecodeErrors, TruncatedJpeg) {
  std::vector<uint8_t> rgb(32 * 32 * 3);
  for (size_t i = 0; i < rgb.size(); ++i) rgb[i] = static_cast<uint8_t>(i * 7);
  const std::vector<uint8_t> jpg = encode_jpeg(rgb, 32, 32, 3, 90);
  ASSERT_FALSE(jpg.empty());
  for (size_t cut : {size_t{4}, size_t{100}, jpg.size() / 2, jpg.size() - 40}) {
    const std::vector<uint8_t> part(jpg.begin(), jpg.begin() + static_cast<std::ptrdiff_t>(cut));
    const std::string e = error_of([&] { decode_image(part, {}); });
    EXPECT_TRUE(contains(e, "truncated") || contains(e, "Premature end")) << "cut at " << cut << ": " << e;
  }
}

TEST(ImageDecodeErrors, DecompressionBombsAreRefusedFromTheHeader) {
  const std::vector<uint8_t> bomb = png_claiming(100000, 100000);
  const auto start = std::chrono::steady_clock::now();
  const std::string e = error_of([&] { decode_image(bomb, {}); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(contains(e, "100000x100000")) << e;
  EXPECT_TRUE(contains(e, "over the limit of 89478485 pixels")) << e;
  EXPECT_LT(seconds, 0.5);
  // The header check is the caller's limit, not a fixed one.
  ImageDecodeLimits small;
  small.max_pixels = 399;
  const std::vector<uint8_t> png = encode_png({20, 20, PNG_COLOR_TYPE_GRAY, 8, false, std::vector<uint8_t>(400, 1), {}, {}});
  EXPECT_TRUE(contains(error_of([&] { decode_image(png, small); }), "over the limit of 399 pixels"));
  small.max_pixels = 400;
  EXPECT_EQ(decode_image(png, small).width, 20);
  // A JPEG frame header claiming 60000 x 60000, and nothing after it.
  const std::vector<uint8_t> jbomb = {0xFF, 0xD8, 0xFF, 0xC0, 0x00, 0x11, 8, 0xEA, 0x60, 0xEA, 0x60, 3,
                                      1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1};
  EXPECT_TRUE(contains(error_of([&] { decode_image(jbomb, {}); }), "60000x60000 pixels is over the limit"));
  // A zero size in the header.
  EXPECT_TRUE(contains(error_of([&] { decode_image(png_claiming(0, 10), {}); }), "0x10"));
}

// The grid is planned from the header's size before any pixel is decoded: an image whose aspect no
// plan can carry (here under a config with one patch per LLM position) is refused from its header,
// though nothing but the header follows it.
TEST(ImagePrepare, TheGridIsPlannedFromTheHeaderBeforeAnyPixelIsDecoded) {
  VisionConfig v;
  v.n_layers = 1;
  v.image_token_id = 5;
  v.downsample_ratio = 1;
  v.max_image_tokens = 48;
  v.min_pixels = 1;
  const std::string e = error_of([&] { prepare_image(png_claiming(15, 331), v, {}, "part 2"); });
  EXPECT_TRUE(contains(e, "part 2: image 15x331: the planned pixel size is empty (aspect ratio too extreme)")) << e;
  // a size the plan takes goes on to the decoder, which finds the pixels missing
  EXPECT_TRUE(contains(error_of([&] { prepare_image(png_claiming(16, 300), v, {}, "part 2"); }), "PNG")) << e;
}

TEST(ImageDecodeErrors, EncodedSizeLimit) {
  const std::vector<uint8_t> png = encode_png({20, 20, PNG_COLOR_TYPE_GRAY, 8, false, std::vector<uint8_t>(400, 1), {}, {}});
  ImageDecodeLimits limits;
  limits.max_encoded_bytes = png.size() - 1;
  EXPECT_TRUE(contains(error_of([&] { decode_image(png, limits); }),
                       std::to_string(png.size()) + " bytes is over the limit of " + std::to_string(png.size() - 1) + " bytes"));
  limits.max_encoded_bytes = png.size();
  EXPECT_EQ(decode_image(png, limits).height, 20);
}

}  // namespace
}  // namespace dsv41
