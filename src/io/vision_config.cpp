#include "io/vision_config.h"

#include <cmath>

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace dsv41 {

using nlohmann::json;

namespace {

// One key under its HF name inside `vision_config`, or its flat name at the top level.
class VisionKeys {
 public:
  VisionKeys(const json& root, std::string where) : root_(root), where_(std::move(where)) {
    const auto it = root.find("vision_config");
    if (it != root.end() && !it->is_null()) {
      if (!it->is_object()) fail(where_ + ": key \"vision_config\"", "must be an object");
      nested_ = &*it;
    }
  }
  bool present() const {
    if (nested_) return true;
    for (const auto& [key, value] : root_.items()) {
      if (key.rfind("vision_", 0) == 0 && !value.is_null()) return true;
    }
    return false;
  }
  const json* find(const char* hf, const char* flat, std::string& label) const {
    label = nested_ ? std::string("vision_config.") + hf : std::string(flat);
    const json& obj = nested_ ? *nested_ : root_;
    const auto it = obj.find(nested_ ? hf : flat);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }
  int64_t integer(const char* hf, const char* flat, int64_t fallback) const {
    std::string label;
    const json* v = find(hf, flat, label);
    if (!v) return fallback;
    if (!v->is_number() || v->get<double>() != std::floor(v->get<double>()) || std::fabs(v->get<double>()) > 1e15) {
      fail(where_ + ": key \"" + label + "\"", "must be an integer, got " + v->dump());
    }
    return static_cast<int64_t>(v->get<double>());
  }
  double number(const char* hf, const char* flat, double fallback) const {
    std::string label;
    const json* v = find(hf, flat, label);
    if (!v) return fallback;
    if (!v->is_number()) fail(where_ + ": key \"" + label + "\"", "must be a number, got " + v->dump());
    return v->get<double>();
  }

 private:
  const json& root_;
  std::string where_;
  const json* nested_ = nullptr;
};

}  // namespace

VisionConfig parse_vision_config(const json& root, const std::string& where) {
  VisionConfig v;
  if (!root.is_object()) return v;
  if (const auto it = root.find("image_token_id"); it != root.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0) {
      fail(where + ": key \"image_token_id\"", "must be a non-negative integer, got " + it->dump());
    }
    v.image_token_id = it->get<int64_t>();
  }
  const VisionKeys k(root, where);
  if (!k.present()) return v;
  // Defaults are the reference's ModelArgs defaults (vision-spec §1.1).
  v.n_layers = static_cast<int>(k.integer("num_hidden_layers", "vision_n_layers", 0));
  v.dim = k.integer("hidden_size", "vision_dim", 1024);
  v.n_heads = static_cast<int>(k.integer("num_attention_heads", "vision_n_heads", 16));
  v.inter_dim = k.integer("intermediate_size", "vision_inter_dim", 2816);
  v.patch_size = k.integer("patch_size", "vision_patch_size", 14);
  v.rope_theta = k.number("rope_theta", "vision_rope_theta", 10000.0);
  v.downsample_ratio = k.integer("downsample_ratio", "vision_downsample_ratio", 3);
  v.max_image_tokens = k.integer("max_image_tokens", "vision_max_n_token", 1024);
  v.min_pixels = k.integer("min_pixels", "vision_min_pixels", 544 * 544);
  v.max_wh_ratio = k.number("max_wh_ratio", "vision_max_wh_ratio", 0.0);
  if (v.n_layers < 0) fail(where, "the vision tower's layer count must be 0 or more");
  if (!v.enabled()) return v;
  const auto positive = [&](const char* what, int64_t x) {
    if (x <= 0) fail(where, std::string("vision ") + what + " must be positive, got " + std::to_string(x));
  };
  positive("hidden size", v.dim);
  positive("head count", v.n_heads);
  positive("intermediate size", v.inter_dim);
  positive("patch size", v.patch_size);
  positive("downsample ratio", v.downsample_ratio);
  positive("min_pixels", v.min_pixels);
  if (v.dim % v.n_heads != 0 || v.head_dim() % 4 != 0) {
    fail(where, "the vision head size (hidden / heads) must be a multiple of 4: its 2-D RoPE gives a quarter "
                "of the lanes to each of rows and columns, in rotate-half pairs");
  }
  if (v.max_image_tokens < 5) fail(where, "max_image_tokens must be at least 5 (the smallest span)");
  // The plan shrinks no image below this span, and the tower's attention is quadratic in it: 16 times
  // the released 1024 bounds what one image may cost.
  constexpr int64_t kMaxImageTokens = 16384;
  if (v.max_image_tokens > kMaxImageTokens) {
    fail(where, "max_image_tokens = " + std::to_string(v.max_image_tokens) + " is above the bound of " +
                    std::to_string(kMaxImageTokens) + " this engine accepts");
  }
  if (!(v.rope_theta > 1) || !std::isfinite(v.rope_theta)) fail(where, "the vision rope_theta must exceed 1");
  if (v.max_wh_ratio < 0 || !std::isfinite(v.max_wh_ratio)) fail(where, "max_wh_ratio must be positive or null");
  if (v.image_token_id < 0) fail(where, "a vision tower needs \"image_token_id\" (the image placeholder)");
  return v;
}

json vision_config_hf_json(const VisionConfig& v) {
  if (!v.enabled()) return json::object();
  return {{"model_type", "deepseek_v41_vision"}, {"num_hidden_layers", v.n_layers}, {"hidden_size", v.dim},
          {"num_attention_heads", v.n_heads}, {"intermediate_size", v.inter_dim}, {"patch_size", v.patch_size},
          {"rope_theta", v.rope_theta}, {"downsample_ratio", v.downsample_ratio},
          {"max_image_tokens", v.max_image_tokens}, {"min_pixels", v.min_pixels},
          {"max_wh_ratio", v.max_wh_ratio > 0 ? json(v.max_wh_ratio) : json(nullptr)}};
}

json vision_config_inference_json(const VisionConfig& v) {
  if (!v.enabled()) return json::object();
  return {{"vision_n_layers", v.n_layers}, {"vision_dim", v.dim}, {"vision_n_heads", v.n_heads},
          {"vision_inter_dim", v.inter_dim}, {"vision_patch_size", v.patch_size},
          {"vision_rope_theta", v.rope_theta}, {"vision_downsample_ratio", v.downsample_ratio},
          {"vision_max_n_token", v.max_image_tokens}, {"vision_min_pixels", v.min_pixels},
          {"vision_max_wh_ratio", v.max_wh_ratio > 0 ? json(v.max_wh_ratio) : json(nullptr)},
          {"image_token_id", v.image_token_id}};
}

}  // namespace dsv41
