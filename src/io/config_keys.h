// What a config file says that the engine does not read. A key whose value changes the math in a way
// the engine does not implement (attention biases, static activation scales, an attention
// temperature, grouped routing) is an error naming it; a key the engine does not know is reported
// back so that the tools can warn about it; keys it knows but has no use for (the vision tower's,
// the architecture name) are listed apart. `inspect` prints all of them.
#pragma once

#include <set>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace dsv41 {

struct ConfigKeyReport {
  std::vector<std::string> unknown;  // "text_config.foo": not a key of this model's config
  std::vector<std::string> unused;   // known, and the engine needs nothing from them
};

// Throws one Error naming `where` and every key whose value the engine does not implement, with the
// value it has and what it would change.
void check_unimplemented_keys(const nlohmann::json& root, const std::string& where);

// Sorts every key of `root` (its text_config, quantization_config and rope_scaling too) that is not
// in `read` (the key names the parser looked up, in either the HF or the flat spelling) into unknown
// and unused.
ConfigKeyReport classify_config_keys(const nlohmann::json& root, const std::set<std::string>& read);

}  // namespace dsv41
