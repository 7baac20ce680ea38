#include "image/image_decode.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "image/codec_decoders.h"
#include "util/error.h"

namespace dsv41 {

namespace {

constexpr uint8_t kPngMagic[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};

bool is_png(std::span<const uint8_t> b) {
  if (b.size() < sizeof(kPngMagic)) return false;
  for (size_t i = 0; i < sizeof(kPngMagic); ++i)
    if (b[i] != kPngMagic[i]) return false;
  return true;
}

// SOI followed by the start of a marker; Pillow's JpegImagePlugin accepts the same three bytes.
bool is_jpeg(std::span<const uint8_t> b) { return b.size() >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF; }

uint32_t be32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) << 24 | static_cast<uint32_t>(p[1]) << 16 | static_cast<uint32_t>(p[2]) << 8 | p[3];
}
uint32_t be16(const uint8_t* p) { return static_cast<uint32_t>(p[0]) << 8 | p[1]; }

ImageHeader probe_png(std::span<const uint8_t> b, const std::string& where) {
  // The signature, then IHDR: length 13, "IHDR", width, height (big-endian).
  if (b.size() < 24) fail(where, "PNG is truncated (the data ends inside its header)");
  if (be32(&b[8]) != 13 || b[12] != 'I' || b[13] != 'H' || b[14] != 'D' || b[15] != 'R')
    fail(where, "corrupt PNG: the first chunk is not IHDR");
  return {ImageFormat::Png, be32(&b[16]), be32(&b[20])};
}

// Walks the marker segments to the first start-of-frame (SOF0..SOF15 but DHT, JPG and DAC, which
// share the range) and reads its height and width.
ImageHeader probe_jpeg(std::span<const uint8_t> b, const std::string& where) {
  size_t pos = 2;
  while (true) {
    while (pos < b.size() && b[pos] != 0xFF) ++pos;  // garbage between segments: libjpeg skips it too
    while (pos < b.size() && b[pos] == 0xFF) ++pos;  // fill bytes
    if (pos >= b.size()) fail(where, "JPEG is truncated (no frame header before the data ends)");
    const uint8_t m = b[pos++];
    if (m == 0x01 || (m >= 0xD0 && m <= 0xD8)) continue;  // markers without a length
    if (m == 0xD9 || m == 0xDA) fail(where, "corrupt JPEG: no frame header before the image data");
    if (pos + 2 > b.size()) fail(where, "JPEG is truncated (the data ends inside a segment header)");
    const size_t length = be16(&b[pos]);
    if (length < 2) fail(where, "corrupt JPEG: a segment length below 2");
    const bool sof = m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC;
    if (sof) {
      if (pos + 7 > b.size()) fail(where, "JPEG is truncated (the data ends inside its frame header)");
      return {ImageFormat::Jpeg, be16(&b[pos + 5]), be16(&b[pos + 3])};
    }
    pos += length;
  }
}

std::string hex_prefix(std::span<const uint8_t> b) {
  std::string s;
  char buf[4];
  for (size_t i = 0; i < b.size() && i < 8; ++i) {
    std::snprintf(buf, sizeof(buf), "%02x", b[i]);
    s += buf;
  }
  return s;
}

}  // namespace

ImageHeader probe_image(std::span<const uint8_t> bytes, const std::string& where) {
  if (bytes.empty()) fail(where, "empty image data (0 bytes)");
  if (is_png(bytes)) return probe_png(bytes, where);
  if (is_jpeg(bytes)) return probe_jpeg(bytes, where);
  // A cut inside the magic bytes themselves: say so rather than "unknown format".
  if (bytes.size() < sizeof(kPngMagic) && std::equal(bytes.begin(), bytes.end(), kPngMagic))
    fail(where, "PNG is truncated (the data ends inside its signature)");
  if (bytes.size() < 3 && bytes[0] == 0xFF && (bytes.size() == 1 || bytes[1] == 0xD8))
    fail(where, "JPEG is truncated (the data ends inside its signature)");
  fail(where, "unsupported image format: not PNG or JPEG (the data starts with " + hex_prefix(bytes) + ")");
}

ImageHeader check_image_header(std::span<const uint8_t> bytes, const ImageDecodeLimits& limits, const std::string& where) {
  if (bytes.size() > limits.max_encoded_bytes)
    fail(where, "image data of " + std::to_string(bytes.size()) + " bytes is over the limit of " +
                    std::to_string(limits.max_encoded_bytes) + " bytes");
  // The size from the header, before the decoder allocates anything image-sized: a small file that
  // claims a huge image (a decompression bomb) costs nothing.
  const ImageHeader h = probe_image(bytes, where);
  if (h.width <= 0 || h.height <= 0)
    fail(where, "corrupt image: header gives a size of " + std::to_string(h.width) + "x" + std::to_string(h.height));
  if (static_cast<uint64_t>(h.width) * static_cast<uint64_t>(h.height) > limits.max_pixels)
    fail(where, "image of " + std::to_string(h.width) + "x" + std::to_string(h.height) +
                    " pixels is over the limit of " + std::to_string(limits.max_pixels) + " pixels");
  return h;
}

RgbImage decode_image(std::span<const uint8_t> bytes, const ImageDecodeLimits& limits, const std::string& where) {
  const ImageHeader h = check_image_header(bytes, limits, where);
  return h.format == ImageFormat::Png ? image_detail::decode_png(bytes, limits.max_pixels, where)
                                      : image_detail::decode_jpeg(bytes, limits.max_pixels, where);
}

}  // namespace dsv41
