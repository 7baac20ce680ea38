// From an image file's bytes to what a request carries (runtime/image_input.h): decoded as Pillow
// would, planned, resized, padded, normalised and cut into patches (image/, vision-spec §3) for the
// model's vision config. Shared by every front end (generate --image, the server's image parts).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "image/image_decode.h"
#include "image/image_plan.h"
#include "io/vision_config.h"
#include "runtime/image_input.h"

namespace dsv41 {

// The preprocessing half of a model's vision config.
VisionPreprocessConfig preprocess_config(const VisionConfig& vision);

// Error naming `where` when the image is not a PNG or JPEG within `limits`, its size (read from the
// header, before anything is decoded) has no grid plan, or the model has no tower.
ImageInput prepare_image(std::span<const uint8_t> bytes, const VisionConfig& vision, const ImageDecodeLimits& limits,
                         const std::string& where);

}  // namespace dsv41
