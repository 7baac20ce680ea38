#include "io/config_keys.h"

#include <string_view>

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace dsv41 {

using nlohmann::json;

namespace {

// Keys the parser checks by value (check_unimplemented_keys, the HF wrapper's checks) rather than
// reads into the config, and the containers it descends into.
const std::set<std::string>& checked_keys() {
  static const std::set<std::string> keys = {
      "model_type", "text_config", "quantization_config", "rope_scaling", "attention_bias", "topk_method",
      "n_group", "topk_group", "first_k_dense_replace", "moe_layer_freq",
      // quantization_config
      "quant_method", "activation_scheme", "weight_block_size", "scale_fmt", "expert_dtype",
      // rope_scaling
      "mscale", "mscale_all_dim"};
  return keys;
}

// Known keys that change nothing this engine computes: HF's bookkeeping.
bool known_unused(const std::string& key) {
  static const std::set<std::string> keys = {"architectures", "transformers_version", "torch_dtype"};
  return keys.count(key) > 0;
}

// The vision tower's keys, read by parse_vision_config (io/vision_config.h): its own object in the HF
// file, vision_* in the flat one, and the image placeholder.
bool vision_key(const std::string& key) {
  static const std::set<std::string> keys = {
      "vision_config",       "image_token_id",     "vision_n_layers",         "vision_dim",
      "vision_n_heads",      "vision_inter_dim",   "vision_patch_size",       "vision_rope_theta",
      "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels", "vision_max_wh_ratio"};
  return keys.count(key) > 0;
}

const json* member(const json& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  const auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

}  // namespace

void check_unimplemented_keys(const json& root, const std::string& where) {
  std::vector<std::string> problems;
  const auto add = [&](const std::string& path, const json& value, const std::string& why) {
    problems.push_back(path + " = " + value.dump() + " (" + why + ")");
  };
  std::vector<std::pair<std::string, const json*>> scopes = {{"", &root}};
  if (const json* text = member(root, "text_config")) scopes.push_back({"text_config.", text});
  for (const auto& [prefix, obj] : scopes) {
    if (const json* v = member(*obj, "attention_bias"); v && *v != false) {
      add(prefix + "attention_bias", *v, "the attention projections have no biases here");
    }
    if (const json* v = member(*obj, "topk_method"); v && *v != "noaux_tc") {
      add(prefix + "topk_method", *v, "routing is noaux_tc: the bias chooses, the raw scores weigh");
    }
    if (const json* v = member(*obj, "n_group"); v && *v != 1) {
      add(prefix + "n_group", *v, "grouped expert routing is not implemented");
    }
    if (const json* v = member(*obj, "first_k_dense_replace"); v && *v != 0) {
      add(prefix + "first_k_dense_replace", *v, "every layer here is a MoE layer");
    }
    if (const json* v = member(*obj, "moe_layer_freq"); v && *v != 1) {
      add(prefix + "moe_layer_freq", *v, "every layer here is a MoE layer");
    }
    if (const json* rs = member(*obj, "rope_scaling")) {
      // The reference applies no attention temperature (model-spec §3: softmax_scale = head_dim^-0.5);
      // HF's YaRN scales the logits by a function of these two whenever either is non-zero.
      for (const char* key : {"mscale", "mscale_all_dim"}) {
        if (const json* v = member(*rs, key); v && *v != 0) {
          add(prefix + "rope_scaling." + key, *v, "no YaRN attention temperature is applied");
        }
      }
    }
    if (const json* q = member(*obj, "quantization_config")) {
      if (const json* v = member(*q, "activation_scheme"); v && *v != "dynamic") {
        add(prefix + "quantization_config.activation_scheme", *v, "activations are quantized per 32 at run time");
      }
      if (const json* v = member(*q, "quant_method"); v && *v != "fp8") {
        add(prefix + "quantization_config.quant_method", *v, "the weights are read as FP8/FP4 blocks");
      }
    }
  }
  if (problems.empty()) return;
  std::string text = "keys that change the math and are not implemented: ";
  for (size_t i = 0; i < problems.size(); ++i) text += (i ? "; " : "") + problems[i];
  fail(where, text);
}

ConfigKeyReport classify_config_keys(const json& root, const std::set<std::string>& read) {
  ConfigKeyReport report;
  const auto sort_keys = [&](const json& obj, const std::string& prefix) {
    if (!obj.is_object()) return;
    for (const auto& [key, value] : obj.items()) {
      if (read.count(key) || checked_keys().count(key) || (prefix.empty() && vision_key(key))) continue;
      (known_unused(key) ? report.unused : report.unknown).push_back(prefix + key);
    }
  };
  sort_keys(root, "");
  if (const json* text = member(root, "text_config")) sort_keys(*text, "text_config.");
  for (const auto& [prefix, obj] : {std::pair{std::string(), &root}, std::pair{std::string("text_config."),
                                                                                 member(root, "text_config")}}) {
    if (obj == nullptr) continue;
    if (const json* rs = member(*obj, "rope_scaling")) sort_keys(*rs, prefix + "rope_scaling.");
    if (const json* q = member(*obj, "quantization_config")) sort_keys(*q, prefix + "quantization_config.");
  }
  return report;
}

}  // namespace dsv41
