// Small checkpoints in exactly the released layout (model-spec §2), with seeded random weights: the
// project's own stand-ins for the 510 GB release, used by tests, examples and benchmarks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "io/config.h"

namespace dsv41 {

// "tiny": every layer role at least once, small enough for the test suite.
// "small": the same layer plan at moderate widths.
// "bench": the released per-layer widths (hidden 5120, 64×512 heads, q-LoRA 1280, index 32×128,
//          experts of 2304) with fewer layers and experts, for measuring speed.
const std::vector<std::string>& synthetic_presets();

// The preset's configuration, complete and validated (Engram rows and the compressed vocabulary are
// derived from the preset's tokenizer and prime layout, as the released config's are).
ModelConfig synthetic_config(const std::string& preset);
// The same with another tokenizer.json (e.g. one `dsv41 tokenizer train` learned from a corpus): the
// vocabulary, DSpark's noise token, the Engram compressed vocabulary and table rows follow it.
ModelConfig synthetic_config(const std::string& preset, const nlohmann::json& tokenizer);

// Writes config.json, inference/config.json, tokenizer.json and the sharded safetensors into `dir`
// (created if needed). The same preset and seed give byte-identical files.
void write_synthetic_checkpoint(const std::string& dir, const std::string& preset, uint64_t seed);
void write_synthetic_checkpoint(const std::string& dir, const std::string& preset, uint64_t seed,
                                const nlohmann::json& tokenizer);

// The shard size a preset is written in.
uint64_t synthetic_shard_bytes(const std::string& preset);

// Another geometry (a preset's config with fewer layers or experts, say): the tokenizer-derived values
// filled in and validated as a preset's are, then its random weights written.
ModelConfig complete_synthetic_config(ModelConfig geometry, const nlohmann::json& tokenizer);
// The same model with a vision tower (make-tiny --vision): the released tower's geometry on a model of
// the released width (hidden 1024 or more), the golden tiny-vision tower's on smaller ones; the image
// placeholder is the tokenizer's <｜deepseek_image｜>. Its weights and every layer's bias_vl are then
// written with the rest.
ModelConfig with_synthetic_vision(ModelConfig config, const nlohmann::json& tokenizer);
void write_synthetic_checkpoint(const std::string& dir, const ModelConfig& config, uint64_t seed,
                                const nlohmann::json& tokenizer, uint64_t shard_bytes);

}  // namespace dsv41
