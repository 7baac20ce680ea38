// The per-format decoders behind decode_image (image_decode.h), which has already checked the byte
// limit and the header's size against the limits. Internal to the image layer.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "image/rgb_image.h"

namespace dsv41::image_detail {

RgbImage decode_png(std::span<const uint8_t> bytes, uint64_t max_pixels, const std::string& where);
RgbImage decode_jpeg(std::span<const uint8_t> bytes, uint64_t max_pixels, const std::string& where);

}  // namespace dsv41::image_detail
