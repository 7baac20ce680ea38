// Writes a checkpoint in exactly the released layout (model-spec §2) from full-precision values:
// config.json, inference/config.json, tokenizer.json and sharded safetensors with their index, FP8
// weights with 32×32 UE8M0 scales, MXFP4 experts, FP8 Engram tables with per-32 row scales, the rest
// BF16 or F32 as the layout says. make-tiny feeds it random values, `dsv41 pack` trained ones.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "io/config.h"
#include "model/tensor_layout.h"

namespace dsv41 {

// The values of one tensor, row-major over its logical shape ([rows, logical_in] for the quantized
// kinds, the stored shape otherwise); `count` is their number. Called once per tensor, in order.
using TensorValues = std::function<std::vector<float>(const TensorSpec& spec, int64_t count)>;

// Throws Error naming the folder or tensor when a file cannot be written or `values` returns the
// wrong number of values. Files are written atomically; shards hold at most about `shard_bytes`.
void write_checkpoint(const std::string& dir, const ModelConfig& config, const nlohmann::json& tokenizer,
                      uint64_t shard_bytes, const TensorValues& values);

// The number of values write_checkpoint asks for: rows × logical_in for quantized kinds.
int64_t logical_numel(const TensorSpec& spec);

}  // namespace dsv41
