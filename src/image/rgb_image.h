// A decoded image as the preprocessing sees it: 8-bit RGB, row-major, 3 bytes a pixel (Pillow's
// "RGB" mode after convert("RGB"); Pillow keeps a fourth padding byte in memory, which no result
// depends on).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dsv41 {

struct RgbImage {
  int64_t width = 0;
  int64_t height = 0;
  std::vector<uint8_t> pixels;  // [height, width, 3]

  RgbImage() = default;
  RgbImage(int64_t w, int64_t h) : width(w), height(h), pixels(static_cast<size_t>(w * h * 3)) {}
  uint8_t* row(int64_t y) { return pixels.data() + y * width * 3; }
  const uint8_t* row(int64_t y) const { return pixels.data() + y * width * 3; }
};

}  // namespace dsv41
