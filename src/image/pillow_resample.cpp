#include "image/pillow_resample.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "util/error.h"

// Facts taken from Pillow's libImaging/Resample.c (the code here is our own):
//  * separable: a horizontal pass over only the source rows the vertical pass will read, into an
//    8-bit intermediate (rounded and clipped), then a vertical pass; a pass whose size does not
//    change is skipped;
//  * per output index: scale = in / out, filterscale = max(scale, 1) (antialiasing when shrinking),
//    support = 2 * filterscale, centre = (i + 0.5) * scale, taps xmin = int(centre - support + 0.5)
//    .. int(centre + support + 0.5) clamped to the image, weight k((x + xmin - centre + 0.5) /
//    filterscale) with Keys' cubic (a = -0.5), normalised in double to sum 1;
//  * weights to fixed point with 22 fraction bits, rounding half away from zero; sums start at
//    1 << 21 (so the shift rounds), are shifted right by 22 and clipped to 0..255.
// Double arithmetic must be evaluated exactly in this order and without fused multiply-add (the
// build targets baseline x86-64, which has none); the golden tests would catch a difference.

namespace dsv41 {

namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;  // 22: 8 bits of result, 2 of headroom for negative lobes
constexpr double kSupport = 2.0;            // BICUBIC's support before scaling

double bicubic(double x) {
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

// One pass's taps: for output index i, `count[i]` source indices from `first[i]`, with fixed-point
// weights at weights[i * ksize ...].
struct Taps {
  int64_t ksize = 0;
  std::vector<int64_t> first, count;
  std::vector<int32_t> weights;
};

Taps precompute_taps(int64_t in_size, int64_t out_size) {
  // Pillow passes the box edges as C floats (0.f and float(in_size)); their difference is exact.
  const double scale = static_cast<double>(static_cast<float>(in_size)) / static_cast<double>(out_size);
  const double filterscale = std::max(scale, 1.0);
  const double support = kSupport * filterscale;
  Taps t;
  t.ksize = static_cast<int64_t>(std::ceil(support)) * 2 + 1;
  t.first.resize(static_cast<size_t>(out_size));
  t.count.resize(static_cast<size_t>(out_size));
  t.weights.assign(static_cast<size_t>(out_size * t.ksize), 0);
  std::vector<double> k(static_cast<size_t>(t.ksize));
  const double ss = 1.0 / filterscale;
  for (int64_t i = 0; i < out_size; ++i) {
    const double center = 0.0 + (static_cast<double>(i) + 0.5) * scale;
    const int64_t xmin = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5), 0);
    const int64_t xmax = std::min<int64_t>(static_cast<int64_t>(center + support + 0.5), in_size) - xmin;
    double ww = 0.0;
    for (int64_t x = 0; x < xmax; ++x) {
      const double w = bicubic((static_cast<double>(x + xmin) - center + 0.5) * ss);
      k[static_cast<size_t>(x)] = w;
      ww += w;
    }
    for (int64_t x = 0; x < xmax; ++x) {
      double w = k[static_cast<size_t>(x)];
      if (ww != 0.0) w /= ww;
      // normalize_coeffs_8bpc: round half away from zero, truncating toward zero after the +-0.5.
      const double scaled = w * (1 << kPrecisionBits);
      t.weights[static_cast<size_t>(i * t.ksize + x)] =
          static_cast<int32_t>(w < 0 ? -0.5 + scaled : 0.5 + scaled);
    }
    t.first[static_cast<size_t>(i)] = xmin;
    t.count[static_cast<size_t>(i)] = xmax;
  }
  return t;
}

// Pillow's clip8: an arithmetic shift (floor), then a clamp to 0..255.
uint8_t clip8(int32_t sum) {
  const int32_t v = sum >> kPrecisionBits;
  return static_cast<uint8_t>(std::clamp(v, 0, 255));
}

constexpr int32_t kRoundingStart = 1 << (kPrecisionBits - 1);

// Rows [row0, row0 + out.height) of `in`, resized horizontally to out.width.
void resample_horizontal(const RgbImage& in, int64_t row0, const Taps& t, RgbImage& out) {
  for (int64_t y = 0; y < out.height; ++y) {
    const uint8_t* src = in.row(y + row0);
    uint8_t* dst = out.row(y);
    for (int64_t x = 0; x < out.width; ++x) {
      const int32_t* k = &t.weights[static_cast<size_t>(x * t.ksize)];
      const uint8_t* s = src + t.first[static_cast<size_t>(x)] * 3;
      int32_t s0 = kRoundingStart, s1 = kRoundingStart, s2 = kRoundingStart;
      for (int64_t i = 0; i < t.count[static_cast<size_t>(x)]; ++i) {
        s0 += s[i * 3 + 0] * k[i];
        s1 += s[i * 3 + 1] * k[i];
        s2 += s[i * 3 + 2] * k[i];
      }
      dst[x * 3 + 0] = clip8(s0);
      dst[x * 3 + 1] = clip8(s1);
      dst[x * 3 + 2] = clip8(s2);
    }
  }
}

// `in` resized vertically to out.height; taps index rows of `in` after subtracting row0. Whole rows
// are accumulated tap by tap (integer sums, so the order does not change the result).
void resample_vertical(const RgbImage& in, int64_t row0, const Taps& t, RgbImage& out) {
  const auto n = static_cast<size_t>(out.width * 3);
  std::vector<int32_t> acc(n);
  for (int64_t y = 0; y < out.height; ++y) {
    const int32_t* k = &t.weights[static_cast<size_t>(y * t.ksize)];
    const int64_t first = t.first[static_cast<size_t>(y)] - row0;
    std::fill(acc.begin(), acc.end(), kRoundingStart);
    for (int64_t i = 0; i < t.count[static_cast<size_t>(y)]; ++i) {
      const uint8_t* src = in.row(first + i);
      const int32_t w = k[i];
      for (size_t j = 0; j < n; ++j) acc[j] += src[j] * w;
    }
    uint8_t* dst = out.row(y);
    for (size_t j = 0; j < n; ++j) dst[j] = clip8(acc[j]);
  }
}

}  // namespace

RgbImage resize_bicubic(const RgbImage& src, int64_t out_w, int64_t out_h) {
  if (out_w <= 0 || out_h <= 0 || src.width <= 0 || src.height <= 0)
    fail("image resize", "sizes must be positive (" + std::to_string(src.width) + "x" +
                             std::to_string(src.height) + " to " + std::to_string(out_w) + "x" +
                             std::to_string(out_h) + ")");
  if (out_w == src.width && out_h == src.height) return src;  // Image.resize returns a copy

  const bool need_horizontal = out_w != src.width;
  const bool need_vertical = out_h != src.height;
  const Taps vert = precompute_taps(src.height, out_h);
  // The source rows the vertical pass reads: from the first tap of the first output row to the last
  // tap of the last one.
  const int64_t row_first = vert.first.front();
  const int64_t row_last = vert.first.back() + vert.count.back();

  if (!need_horizontal) {
    RgbImage out(out_w, out_h);
    resample_vertical(src, 0, vert, out);
    return out;
  }
  const Taps horiz = precompute_taps(src.width, out_w);
  RgbImage temp(out_w, row_last - row_first);
  resample_horizontal(src, row_first, horiz, temp);
  if (!need_vertical) return temp;  // the rows used are then all of them
  RgbImage out(out_w, out_h);
  resample_vertical(temp, row_first, vert, out);
  return out;
}

}  // namespace dsv41
