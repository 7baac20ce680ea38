// The AMX tile configuration that ldtilecfg reads: palette 1 (Intel SDM vol. 1 §18.2), a 64-byte
// block with, per tile, its bytes per row and its rows. Shared by the AMX kernels and bench's
// register-only peak loop.
#pragma once

#include <cstdint>

namespace dsv41 {

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(AmxTileConfig) == 64, "ldtilecfg reads 64 bytes");

}  // namespace dsv41
