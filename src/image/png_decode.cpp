// PNG through libpng, converted to RGB by Pillow 11.1's rules (PngImagePlugin's mode table, then
// Unpack.c and Convert.c). libpng is asked for the raw samples only (no transforms but
// de-interlacing), so every conversion below is ours and follows Pillow:
//   grey 1/2/4/8-bit  Pillow "1" / "L;2" / "L;4" / "L": levels scaled by bit replication
//                     (1 -> 255, 2-bit x 0x55, 4-bit x 0x11), then (g, g, g);
//   grey 16-bit       Pillow "I;16", whose convert("RGB") CLIPS: min(value, 255), not the high byte;
//   RGB 16-bit        Pillow unpacks "RGB;16B" to 8 bits by taking the HIGH byte of each sample;
//   grey+alpha        8-bit "LA" -> (g, g, g); 16-bit opens as RGBA from "LA;16B": high byte of g;
//   RGBA 8/16-bit     alpha dropped, not composited (16-bit: high bytes);
//   palette 1-8 bit   looked up in PLTE; indices past its end give black (Pillow's palette is
//                     zero-filled); tRNS only affects alpha, so it changes nothing here.
// gAMA, cHRM, sRGB and iCCP are ignored, as Pillow ignores them.
// Errors: libpng reports through longjmp. The only setjmp is in read_guarded(), which holds no C++
// objects of its own (its state lives in a PngReader the caller owns) and runs no C++ code that
// libpng could jump across; the libpng structs are freed by PngReader's destructor on every path.
#include <png.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "image/codec_decoders.h"
#include "util/error.h"

namespace dsv41::image_detail {

namespace {

struct PngReader {
  std::span<const uint8_t> bytes;
  size_t pos = 0;
  uint64_t max_pixels = 0;
  png_structp png = nullptr;
  png_infop info = nullptr;
  char message[256] = {};
  bool too_large = false;
  // Results of read_guarded().
  png_uint_32 width = 0, height = 0;
  int bit_depth = 0, color_type = 0, interlace = 0;
  size_t rowbytes = 0;
  std::vector<uint8_t> raw;
  std::vector<png_bytep> rows;
  std::array<uint8_t, 256 * 3> palette{};  // zero-filled past PLTE's entries, as Pillow's

  ~PngReader() {
    if (png) png_destroy_read_struct(&png, info ? &info : nullptr, nullptr);
  }
};

[[noreturn]] void on_error(png_structp png, png_const_charp msg) {
  auto* r = static_cast<PngReader*>(png_get_error_ptr(png));
  std::snprintf(r->message, sizeof(r->message), "%s", msg ? msg : "libpng error");
  png_longjmp(png, 1);
}

void on_warning(png_structp, png_const_charp) {}  // benign: Pillow would not mention them either

// libpng's callbacks may longjmp across their own frames (png_error): they hold nothing with a
// destructor.
void on_read(png_structp png, png_bytep out, size_t length) {
  auto* r = static_cast<PngReader*>(png_get_io_ptr(png));
  if (r->bytes.size() - r->pos < length) png_error(png, "truncated (the data ends early)");
  std::memcpy(out, r->bytes.data() + r->pos, length);
  r->pos += length;
}

// Everything libpng can longjmp out of. Returns false with r->message (or r->too_large) set.
bool read_guarded(PngReader* r) {
  if (setjmp(png_jmpbuf(r->png))) return false;
  png_read_info(r->png, r->info);
  png_get_IHDR(r->png, r->info, &r->width, &r->height, &r->bit_depth, &r->color_type, &r->interlace,
               nullptr, nullptr);
  if (static_cast<uint64_t>(r->width) * r->height > r->max_pixels) {
    r->too_large = true;
    return false;
  }
  if (r->color_type == PNG_COLOR_TYPE_PALETTE) {
    png_colorp plte = nullptr;
    int n = 0;
    if (png_get_PLTE(r->png, r->info, &plte, &n) & PNG_INFO_PLTE)
      for (int i = 0; i < n && i < 256; ++i) {
        r->palette[static_cast<size_t>(i) * 3 + 0] = plte[i].red;
        r->palette[static_cast<size_t>(i) * 3 + 1] = plte[i].green;
        r->palette[static_cast<size_t>(i) * 3 + 2] = plte[i].blue;
      }
  }
  png_set_interlace_handling(r->png);  // Adam7 rows come back whole
  png_read_update_info(r->png, r->info);
  r->rowbytes = png_get_rowbytes(r->png, r->info);
  r->raw.resize(r->rowbytes * r->height);
  r->rows.resize(r->height);
  for (png_uint_32 y = 0; y < r->height; ++y) r->rows[y] = r->raw.data() + r->rowbytes * y;
  png_read_image(r->png, r->rows.data());
  // No png_read_end: like Pillow, whatever follows the image data (even a missing IEND) is ignored.
  return true;
}

// Sample i of a row packed at `depth` bits (1, 2, 4 or 8), most significant bits first.
inline unsigned packed_sample(const uint8_t* row, int64_t i, int depth) {
  if (depth == 8) return row[i];
  const int64_t bit = i * depth;
  const int shift = 8 - depth - static_cast<int>(bit % 8);
  return (row[bit / 8] >> shift) & ((1u << depth) - 1);
}

void convert_row(const PngReader& r, const uint8_t* in, uint8_t* out) {
  const auto w = static_cast<int64_t>(r.width);
  const int d = r.bit_depth;
  switch (r.color_type) {
    case PNG_COLOR_TYPE_GRAY:
      for (int64_t x = 0; x < w; ++x) {
        uint8_t g;
        if (d == 16) {
          g = in[x * 2] == 0 ? in[x * 2 + 1] : 255;  // Pillow's I16_RGB clips
        } else {
          const unsigned v = packed_sample(in, x, d);
          g = static_cast<uint8_t>(d == 1 ? v * 255u : d == 2 ? v * 0x55u : d == 4 ? v * 0x11u : v);
        }
        out[x * 3] = out[x * 3 + 1] = out[x * 3 + 2] = g;
      }
      break;
    case PNG_COLOR_TYPE_GRAY_ALPHA: {
      const int64_t step = d == 16 ? 4 : 2;  // high byte first (big-endian)
      for (int64_t x = 0; x < w; ++x) out[x * 3] = out[x * 3 + 1] = out[x * 3 + 2] = in[x * step];
      break;
    }
    case PNG_COLOR_TYPE_RGB:
    case PNG_COLOR_TYPE_RGB_ALPHA: {
      const int64_t channels = r.color_type == PNG_COLOR_TYPE_RGB ? 3 : 4;
      const int64_t bytes = d == 16 ? 2 : 1;
      for (int64_t x = 0; x < w; ++x)
        for (int64_t c = 0; c < 3; ++c) out[x * 3 + c] = in[(x * channels + c) * bytes];
      break;
    }
    case PNG_COLOR_TYPE_PALETTE:
      for (int64_t x = 0; x < w; ++x) {
        const size_t i = packed_sample(in, x, d);
        std::memcpy(out + x * 3, &r.palette[i * 3], 3);
      }
      break;
    default:
      break;  // libpng rejects other colour types in IHDR
  }
}

}  // namespace

RgbImage decode_png(std::span<const uint8_t> bytes, uint64_t max_pixels, const std::string& where) {
  PngReader r;
  r.bytes = bytes;
  r.max_pixels = max_pixels;
  r.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &r, on_error, on_warning);
  if (!r.png) fail(where, "PNG: cannot start the decoder (out of memory)");
  r.info = png_create_info_struct(r.png);
  if (!r.info) fail(where, "PNG: cannot start the decoder (out of memory)");
  png_set_read_fn(r.png, &r, on_read);
  // Pillow checks every header chunk's CRC; a damaged file is refused rather than half-trusted.
  png_set_crc_action(r.png, PNG_CRC_ERROR_QUIT, PNG_CRC_ERROR_QUIT);
  // Our own pixel limit is the one that matters; libpng's default 1e6 per side would refuse a long
  // strip Pillow opens.
  png_set_user_limits(r.png, PNG_UINT_31_MAX, PNG_UINT_31_MAX);

  if (!read_guarded(&r)) {
    if (r.too_large)
      fail(where, "PNG of " + std::to_string(r.width) + "x" + std::to_string(r.height) +
                      " pixels is over the limit of " + std::to_string(max_pixels) + " pixels");
    fail(where, std::string("corrupt or unsupported PNG: ") + r.message);
  }

  RgbImage img(static_cast<int64_t>(r.width), static_cast<int64_t>(r.height));
  for (int64_t y = 0; y < img.height; ++y) convert_row(r, r.rows[static_cast<size_t>(y)], img.row(y));
  return img;
}

}  // namespace dsv41::image_detail
