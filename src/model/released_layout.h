// The released checkpoint's layout at full size without its data: every tensor of the release (the
// text model's, checkpoint_tensors, and what a text-only engine may skip: ffn.gate.bias_vl, the vision
// tower, the aligner and the image span vectors, vision-spec §2) written with real headers, in the
// release's 48 shards with its index, the data left as holes of a sparse file. `inspect`, `plan` and a
// budgeted load run over it at the real offsets and sizes, reading zeros.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "io/config.h"
#include "model/tensor_layout.h"

namespace dsv41 {

// The text model's tensors, then bias_vl per layer and the vision tensors (vision_tensors); Error when
// the config has no vision tower.
std::vector<TensorSpec> released_tensors(const ModelConfig& config);

// The largest shard data size for which the writer's next-fit split (io/safetensors_writer.h) of
// `tensors` in order makes exactly `shards` shards; Error when no size does.
uint64_t shard_bytes_for(const std::vector<TensorSpec>& tensors, int shards);

// Writes `hf_config` as config.json (and the flat inference/config.json), `tokenizer` as
// tokenizer.json unless it is null, and the tensors as `shards` sparse shards with their index.
void write_sparse_checkpoint(const std::string& dir, const nlohmann::json& hf_config, const nlohmann::json& tokenizer,
                             int shards);

}  // namespace dsv41
