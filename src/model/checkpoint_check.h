// Checks that a checkpoint holds exactly the tensors its config implies, with the right dtypes and
// shapes, before any of them is used.
#pragma once

#include "io/config.h"
#include "io/safetensors.h"

namespace dsv41 {

// Throws Error naming the first missing, misshapen or unexpected tensor.
void check_checkpoint(const Checkpoint& checkpoint, const ModelConfig& config);

}  // namespace dsv41
