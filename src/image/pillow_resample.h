// Pillow's BICUBIC resize of an 8-bit image (libImaging/Resample.c, as in Pillow 11.1), reproduced
// bit for bit: the preprocessing's pixels must equal the reference's exactly (vision-spec §3.3).
#pragma once

#include <cstdint>

#include "image/rgb_image.h"

namespace dsv41 {

// Image.resize((out_w, out_h), Image.BICUBIC) of an RGB image: returns a copy when the size is
// unchanged, as Pillow does. out_w and out_h must be positive.
RgbImage resize_bicubic(const RgbImage& src, int64_t out_w, int64_t out_h);

}  // namespace dsv41
