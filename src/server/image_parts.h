// The images of a chat request (the chat encoder's image records, vision-spec §3.1) as the engine
// takes them: base64 data only — a data: URL, an Anthropic-style base64 source, or base64 `data` —
// decoded and preprocessed for the model. The server fetches nothing: a remote URL or a file path
// is refused. Every problem is a 400 naming the part. The pixel limit holds for the request's images
// together: every header is read, and the sum checked, before the first image is decoded.
#pragma once

#include <cstddef>
#include <vector>

#include <nlohmann/json.hpp>

#include "image/image_decode.h"
#include "io/vision_config.h"
#include "runtime/image_input.h"

namespace dsv41::server {

struct ImageLimits {
  size_t max_images = 8;  // per request
  // Encoded bytes of one image, and pixels (W·H) of all the request's images together, each read from
  // its header before any image is decoded.
  ImageDecodeLimits decode = {uint64_t{20} << 20, uint64_t{40} << 20};
};

// `vision` null or disabled: any image is refused (this model cannot see).
std::vector<ImageInput> load_image_parts(const std::vector<nlohmann::ordered_json>& records, const VisionConfig* vision,
                                         const ImageLimits& limits);

}  // namespace dsv41::server
