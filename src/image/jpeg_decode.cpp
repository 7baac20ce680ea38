// JPEG through libjpeg-turbo with its default decoding (accurate integer IDCT, fancy upsampling), as
// Pillow's JpegDecode.c uses it when no draft mode is asked for:
//   1 component   Pillow "L": (g, g, g);
//   3 components  Pillow "RGB": libjpeg converts YCbCr (or Adobe RGB) to RGB itself;
//   4 components  Pillow "CMYK", always read with Adobe's inverted polarity ("CMYK;I": every byte
//                 inverted), then Convert.c's cmyk2rgb: n = 255 - k, out = clip(n - c * n / 255)
//                 with Pillow's MULDIV255 rounding. YCCK files come out of libjpeg as CMYK first.
// Only 8-bit samples (Pillow refuses other precisions too). Data ending before the last scanline
// is an error ("image file is truncated" in Pillow); what follows the last scanline is not read.
// Errors: libjpeg's error_exit longjmps back to read_guarded(), the only setjmp, which holds no C++
// objects of its own; warnings (corrupt-data notes Pillow also lets pass) are silent, except the
// premature end of data, which becomes an error.
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

// jpeglib.h needs FILE and size_t declared first.
#include <jpeglib.h>
#include <jerror.h>

#include "image/codec_decoders.h"
#include "util/error.h"

namespace dsv41::image_detail {

namespace {

// A progressive file may repeat scans without end, each costing a pass over the whole image
// (libjpeg-turbo's advice for untrusted input); real encoders write about ten.
constexpr int kMaxScans = 1000;

struct JpegReader {
  jpeg_error_mgr err{};
  jpeg_progress_mgr progress{};
  jpeg_decompress_struct cinfo{};
  std::jmp_buf jump{};
  char message[JMSG_LENGTH_MAX] = {};
  bool created = false;
  bool too_large = false;
  uint64_t max_pixels = 0;
  std::vector<uint8_t> samples;  // output_height x output_width x output_components

  ~JpegReader() {
    if (created) jpeg_destroy_decompress(&cinfo);
  }
};

// The reader travels in libjpeg's own client_data field.
JpegReader* reader_of(j_common_ptr cinfo) { return static_cast<JpegReader*>(cinfo->client_data); }

[[noreturn]] void on_error_exit(j_common_ptr cinfo) {
  JpegReader* r = reader_of(cinfo);
  (*cinfo->err->format_message)(cinfo, r->message);
  std::longjmp(r->jump, 1);
}

void on_emit_message(j_common_ptr cinfo, int level) {
  // level -1 is a warning; the only one that is fatal for Pillow is running out of data.
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) (*cinfo->err->error_exit)(cinfo);
}

void on_output_message(j_common_ptr) {}

void on_progress(j_common_ptr cinfo) {
  if (cinfo->is_decompressor && reinterpret_cast<j_decompress_ptr>(cinfo)->input_scan_number > kMaxScans) {
    JpegReader* r = reader_of(cinfo);
    std::snprintf(r->message, sizeof(r->message), "more than %d progressive scans", kMaxScans);
    std::longjmp(r->jump, 1);
  }
}

// Everything libjpeg can longjmp out of. Returns false with r->message (or r->too_large) set.
bool read_guarded(JpegReader* r, const uint8_t* data, size_t size) {
  if (setjmp(r->jump)) return false;
  jpeg_create_decompress(&r->cinfo);  // keeps err and client_data, zeroes the rest
  r->created = true;
  r->cinfo.progress = &r->progress;
  jpeg_mem_src(&r->cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&r->cinfo, TRUE);
  if (static_cast<uint64_t>(r->cinfo.image_width) * r->cinfo.image_height > r->max_pixels) {
    r->too_large = true;
    return false;
  }
  switch (r->cinfo.num_components) {
    case 1: r->cinfo.out_color_space = JCS_GRAYSCALE; break;
    case 3: r->cinfo.out_color_space = JCS_RGB; break;
    case 4: r->cinfo.out_color_space = JCS_CMYK; break;
    default:
      std::snprintf(r->message, sizeof(r->message), "cannot handle %d-component images",
                    r->cinfo.num_components);
      return false;
  }
  jpeg_start_decompress(&r->cinfo);
  const size_t stride = static_cast<size_t>(r->cinfo.output_width) * static_cast<size_t>(r->cinfo.output_components);
  r->samples.resize(stride * r->cinfo.output_height);
  while (r->cinfo.output_scanline < r->cinfo.output_height) {
    JSAMPROW row = r->samples.data() + stride * r->cinfo.output_scanline;
    jpeg_read_scanlines(&r->cinfo, &row, 1);
  }
  return true;
}

// Pillow's MULDIV255: a * b / 255 with its own rounding.
inline int muldiv255(int a, int b) {
  const int t = a * b + 128;
  return ((t >> 8) + t) >> 8;
}

inline uint8_t clip8(int v) { return static_cast<uint8_t>(v <= 0 ? 0 : v < 256 ? v : 255); }

}  // namespace

RgbImage decode_jpeg(std::span<const uint8_t> bytes, uint64_t max_pixels, const std::string& where) {
  JpegReader r;
  r.max_pixels = max_pixels;
  r.cinfo.err = jpeg_std_error(&r.err);
  r.cinfo.client_data = &r;
  r.err.error_exit = on_error_exit;
  r.err.emit_message = on_emit_message;
  r.err.output_message = on_output_message;
  r.progress.progress_monitor = on_progress;

  if (!read_guarded(&r, bytes.data(), bytes.size())) {
    if (r.too_large)
      fail(where, "JPEG of " + std::to_string(r.cinfo.image_width) + "x" +
                      std::to_string(r.cinfo.image_height) + " pixels is over the limit of " +
                      std::to_string(max_pixels) + " pixels");
    fail(where, std::string("corrupt or unsupported JPEG: ") + r.message);
  }

  RgbImage img(r.cinfo.output_width, r.cinfo.output_height);
  const int comps = r.cinfo.output_components;
  const size_t n = static_cast<size_t>(img.width * img.height);
  const uint8_t* s = r.samples.data();
  uint8_t* o = img.pixels.data();
  if (comps == 3) {
    std::memcpy(o, s, n * 3);
  } else if (comps == 1) {
    for (size_t i = 0; i < n; ++i) o[i * 3] = o[i * 3 + 1] = o[i * 3 + 2] = s[i];
  } else {
    for (size_t i = 0; i < n; ++i) {
      const uint8_t* p = s + i * 4;
      const int nk = 255 - (255 - p[3]);  // k inverted by "CMYK;I", then 255 - k
      for (size_t c = 0; c < 3; ++c) o[i * 3 + c] = clip8(nk - muldiv255(255 - p[c], nk));
    }
  }
  return img;
}

}  // namespace dsv41::image_detail
