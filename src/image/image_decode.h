// Decoding an image file (PNG or JPEG) from memory into 8-bit RGB exactly as the reference's
// Image.open(...).convert("RGB") (Pillow 11.1) gives it (vision-spec §3.1). Input is untrusted: the
// size limits are checked from the header before anything image-sized is allocated, and every
// malformed, truncated or unsupported input is a dsv41::Error naming the problem.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "image/rgb_image.h"

namespace dsv41 {

enum class ImageFormat { Png, Jpeg };

struct ImageDecodeLimits {
  uint64_t max_encoded_bytes = 32ull << 20;  // the file itself
  // Pillow's own MAX_IMAGE_PIXELS (it warns above it, refuses above twice it): ~ 9459 x 9459.
  uint64_t max_pixels = 89'478'485;
};

struct ImageHeader {
  ImageFormat format = ImageFormat::Png;
  int64_t width = 0, height = 0;
};

// The format (by its magic bytes) and the size (from PNG's IHDR or JPEG's SOF segment), without
// decoding. Fails on anything that is not a readable PNG or JPEG header.
ImageHeader probe_image(std::span<const uint8_t> bytes, const std::string& where = "image");

// The header of an image a caller is about to decode, with `limits` checked on it: the encoded size,
// a readable PNG or JPEG header, a positive size and at most limits.max_pixels. Nothing is decoded, so
// a caller can plan from the size (and refuse it) before any pixel exists.
ImageHeader check_image_header(std::span<const uint8_t> bytes, const ImageDecodeLimits& limits,
                               const std::string& where = "image");

// The image as Pillow's convert("RGB") gives it: alpha dropped (not composited), grey replicated,
// palettes looked up, 16-bit samples reduced as Pillow does; EXIF orientation not applied. `where`
// names the input in error messages (a request field, a file).
RgbImage decode_image(std::span<const uint8_t> bytes, const ImageDecodeLimits& limits,
                      const std::string& where = "image");

}  // namespace dsv41
