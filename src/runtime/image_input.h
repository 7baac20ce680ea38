// An image as a request carries it to the engine: its preprocessed patches (image/, vision-spec §3)
// and a key for the prompt cache. Names and values only, so the narrow engine API can carry it.
#pragma once

#include <cstdint>
#include <vector>

namespace dsv41 {

struct ImageInput {
  int64_t grid_h = 0, grid_w = 0;  // ViT patches, rows × columns
  std::vector<float> patches;      // [grid_h·grid_w, 3·patch²]: bf16 values, each patch (c, y, x)
  uint64_t key = 0;                // a hash of the image's pixels and its preprocessing
};

}  // namespace dsv41
