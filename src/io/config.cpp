#include "io/config.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>
#include <cstdio>
#include <set>

#include <nlohmann/json.hpp>

#include "io/config_keys.h"
#include "io/engram_layout.h"
#include "util/error.h"
#include "util/regular_file.h"

namespace dsv41 {

using nlohmann::json;

int ModelConfig::routed_experts(int layer) const {
  return layer < n_layers || dspark_n_routed_experts == 0 ? n_routed_experts : dspark_n_routed_experts;
}
int ModelConfig::activated_experts(int layer) const {
  return layer < n_layers || dspark_n_activated_experts == 0 ? n_activated_experts
                                                              : dspark_n_activated_experts;
}

namespace {

// Reads keys from the HF form (text_config nested, HF names) or the flat inference form.
class KeyReader {
 public:
  // Every key name looked up is added to `asked` (what classify_config_keys leaves out).
  KeyReader(const json& root, std::string where, std::set<std::string>& asked)
      : root_(root), where_(std::move(where)), asked_(asked) {
    if (!root.is_object()) fail(where_, "a config must be a JSON object");
    text_ = &root;
    if (root.contains("text_config")) {
      if (!root["text_config"].is_object()) fail(where_, "\"text_config\" must be an object");
      text_ = &root["text_config"];
    }
  }

  // The value under the first of `names` present in text_config (or the flat object), then the top.
  const json* find(std::initializer_list<const char*> names) const {
    for (const char* name : names) asked_.insert(name);
    for (const json* obj : {text_, &root_}) {
      for (const char* name : names) {
        auto it = obj->find(name);
        if (it != obj->end() && !it->is_null()) return &*it;
      }
    }
    return nullptr;
  }

  std::string key_label(std::initializer_list<const char*> names) const {
    std::string label;
    for (const char* name : names) label += (label.empty() ? "" : " / ") + std::string(name);
    return where_ + ": key \"" + label + "\"";
  }

  template <typename T>
  T integer(std::initializer_list<const char*> names, std::optional<T> fallback = std::nullopt) const {
    const json* v = find(names);
    if (!v) {
      if (fallback) return *fallback;
      throw Error(key_label(names) + " is missing");
    }
    if (v->is_number_float()) {
      double d = v->get<double>();
      if (d != std::floor(d)) throw Error(key_label(names) + " must be an integer, got " + v->dump());
      return checked<T>(d, names, *v);
    }
    if (!v->is_number_integer()) throw Error(key_label(names) + " must be an integer, got " + v->dump());
    if (v->is_number_unsigned()) return checked<T>(static_cast<double>(v->get<uint64_t>()), names, *v);
    return checked<T>(static_cast<double>(v->get<int64_t>()), names, *v);
  }

  double number(std::initializer_list<const char*> names, std::optional<double> fallback = std::nullopt) const {
    const json* v = find(names);
    if (!v) {
      if (fallback) return *fallback;
      throw Error(key_label(names) + " is missing");
    }
    if (!v->is_number()) throw Error(key_label(names) + " must be a number, got " + v->dump());
    return v->get<double>();
  }

  bool boolean(std::initializer_list<const char*> names, bool fallback) const {
    const json* v = find(names);
    if (!v) return fallback;
    if (!v->is_boolean()) throw Error(key_label(names) + " must be true or false, got " + v->dump());
    return v->get<bool>();
  }

  std::string string(std::initializer_list<const char*> names, const std::string& fallback) const {
    const json* v = find(names);
    if (!v) return fallback;
    if (!v->is_string()) throw Error(key_label(names) + " must be a string, got " + v->dump());
    return v->get<std::string>();
  }

  template <typename T>
  std::vector<T> integer_list(std::initializer_list<const char*> names, bool required) const {
    const json* v = find(names);
    if (!v) {
      if (required) throw Error(key_label(names) + " is missing");
      return {};
    }
    if (!v->is_array()) throw Error(key_label(names) + " must be a list of integers, got " + v->dump());
    std::vector<T> out;
    for (const json& e : *v) {
      if (!e.is_number_integer()) {
        throw Error(key_label(names) + " must be a list of integers, found " + e.dump());
      }
      out.push_back(checked<T>(static_cast<double>(e.get<int64_t>()), names, e));
    }
    return out;
  }

  const json& root() const { return root_; }
  const std::string& where() const { return where_; }

 private:
  template <typename T>
  T checked(double d, std::initializer_list<const char*> names, const json& v) const {
    if (d < static_cast<double>(std::numeric_limits<T>::min()) ||
        d > static_cast<double>(std::numeric_limits<T>::max())) {
      throw Error(key_label(names) + " is out of range: " + v.dump());
    }
    return static_cast<T>(d);
  }

  const json& root_;
  const json* text_;
  std::string where_;
  std::set<std::string>& asked_;
};

void check_hf_wrapper(const KeyReader& r) {
  const json& root = r.root();
  for (const json* obj : {&root, root.contains("text_config") ? &root["text_config"] : &root}) {
    auto it = obj->find("model_type");
    if (it == obj->end()) continue;
    if (!it->is_string() || (*it != "deepseek_v41" && *it != "deepseek_v41_text")) {
      fail(r.where(), "model_type " + it->dump() + " is not deepseek_v41");
    }
  }
  if (root.contains("quantization_config")) {
    const json& q = root["quantization_config"];
    if (!q.is_object()) fail(r.where(), "\"quantization_config\" must be an object");
    if (q.contains("weight_block_size") && q["weight_block_size"] != json::array({32, 32})) {
      fail(r.where(), "quantization_config.weight_block_size must be [32, 32], got " +
                          q["weight_block_size"].dump());
    }
    if (q.contains("scale_fmt") && q["scale_fmt"] != "ue8m0") {
      fail(r.where(), "quantization_config.scale_fmt must be \"ue8m0\", got " + q["scale_fmt"].dump());
    }
    if (q.contains("expert_dtype") && q["expert_dtype"] != "fp4") {
      fail(r.where(), "quantization_config.expert_dtype must be \"fp4\", got " + q["expert_dtype"].dump());
    }
  }
  if (r.integer<int>({"num_key_value_heads"}, 1) != 1) {
    fail(r.where(), "num_key_value_heads must be 1 (one shared latent KV head)");
  }
  if (r.string({"hidden_act"}, "silu") != "silu") fail(r.where(), "hidden_act must be \"silu\"");
  if (r.boolean({"tie_word_embeddings"}, false)) fail(r.where(), "tie_word_embeddings must be false");
  std::string dtype = r.string({"dtype"}, "");
  if (!dtype.empty() && dtype != "fp8" && dtype != "bfloat16") {
    fail(r.where(), "dtype \"" + dtype + "\" is not supported (expected fp8 weights)");
  }
  std::string expert_dtype = r.string({"expert_dtype"}, "fp4");
  if (expert_dtype != "fp4") fail(r.where(), "expert_dtype must be \"fp4\", got \"" + expert_dtype + "\"");
}

}  // namespace

ModelConfig parse_config(const json& root, const std::string& where) {
  std::set<std::string> asked;
  KeyReader r(root, where, asked);
  check_hf_wrapper(r);
  check_unimplemented_keys(root, where);
  ModelConfig c;
  c.source = where;
  // The wrapper's model_type names the model; text_config's names only its text half.
  c.model_type = root.contains("model_type") && root["model_type"].is_string() ? root["model_type"].get<std::string>()
                                                                               : std::string("deepseek_v41");

  c.vocab_size = r.integer<int64_t>({"vocab_size"});
  c.dim = r.integer<int64_t>({"hidden_size", "dim"});
  c.moe_inter_dim = r.integer<int64_t>({"moe_intermediate_size", "moe_inter_dim"});
  c.n_layers = r.integer<int>({"num_hidden_layers", "n_layers"});
  c.n_mtp_layers = r.integer<int>({"num_nextn_predict_layers", "n_mtp_layers"}, 0);
  c.n_heads = r.integer<int>({"num_attention_heads", "n_heads"});
  c.head_dim = r.integer<int64_t>({"head_dim"});
  c.rope_head_dim = r.integer<int64_t>({"qk_rope_head_dim", "rope_head_dim"});
  c.q_lora_rank = r.integer<int64_t>({"q_lora_rank"});
  c.o_lora_rank = r.integer<int64_t>({"o_lora_rank"});
  c.o_groups = r.integer<int>({"o_groups"});
  c.norm_eps = r.number({"rms_norm_eps", "norm_eps"}, 1e-20);
  c.swiglu_limit = r.number({"swiglu_limit"}, 0.0);

  // RoPE: HF nests YaRN under rope_scaling; the flat file spells it out.
  c.rope_theta = r.number({"rope_theta"}, 10000.0);
  c.compress_rope_theta = r.number({"compress_rope_theta"}, c.rope_theta);
  if (const json* rs = r.find({"rope_scaling"})) {
    KeyReader s(*rs, where + ": rope_scaling", asked);
    std::string type = s.string({"rope_type", "type"}, "yarn");
    if (type != "yarn") fail(where, "rope_scaling.rope_type \"" + type + "\" is not supported (yarn only)");
    c.rope_factor = s.number({"factor"});
    c.beta_fast = s.number({"beta_fast"}, 32.0);
    c.beta_slow = s.number({"beta_slow"}, 1.0);
    c.original_seq_len = s.integer<int64_t>({"original_max_position_embeddings"});
  } else {
    c.rope_factor = r.number({"rope_factor"}, 1.0);
    c.beta_fast = r.number({"beta_fast"}, 32.0);
    c.beta_slow = r.number({"beta_slow"}, 1.0);
    c.original_seq_len = r.integer<int64_t>({"original_seq_len"}, 0);
  }
  // The flat file may omit the context limit (the reference then uses a 4096 runtime default); the
  // model's own limit is the YaRN-extended length, which is what HF's max_position_embeddings says.
  // (Left 0 when the product is out of range, which validate_config then reports as too long a
  // context or a rope_factor that is not finite, rather than converting it into an int64_t.)
  const double yarn = static_cast<double>(c.original_seq_len) * std::max(1.0, c.rope_factor);
  const int64_t yarn_len = c.original_seq_len > 0 && yarn < 0x1p62 ? static_cast<int64_t>(yarn) : 0;
  c.max_seq_len = r.integer<int64_t>({"max_position_embeddings", "max_seq_len"},
                                     yarn_len > 0 ? yarn_len : int64_t{4096});

  c.n_routed_experts = r.integer<int>({"n_routed_experts"});
  c.n_shared_experts = r.integer<int>({"n_shared_experts"}, 1);
  c.n_activated_experts = r.integer<int>({"num_experts_per_tok", "n_activated_experts"});
  c.score_func = r.string({"scoring_func", "score_func"}, "sqrtsoftplus");
  c.route_scale = r.number({"routed_scaling_factor", "route_scale"}, 1.0);
  c.gate_temp = r.number({"gate_temp"}, 1.0);
  c.norm_topk_prob = r.boolean({"norm_topk_prob"}, true);

  c.window_size = r.integer<int>({"sliding_window", "window_size"});
  c.compress_ratios = r.integer_list<int>({"compress_ratios"}, true);
  c.kv_source_layers = r.integer_list<int>({"kv_source_layer_ids", "kv_source_layers"}, false);
  c.index_source_layers = r.integer_list<int>({"index_source_layer_ids", "index_source_layers"}, false);
  c.index_n_heads = r.integer<int>({"index_n_heads"}, 0);
  c.index_head_dim = r.integer<int64_t>({"index_head_dim"}, 0);
  c.index_topk = r.integer<int>({"index_topk"}, 0);
  c.candidate_source_layer = r.integer<int>({"candidate_source_layer_id", "candidate_source_layer"}, -1);
  c.candidate_topk_blocks = r.integer<int>({"candidate_topk_blocks"}, 0);
  c.candidate_block_size = r.integer<int>({"candidate_block_size"}, 0);

  c.hc_mult = r.integer<int>({"hc_mult"}, 4);
  c.hc_sinkhorn_iters = r.integer<int>({"hc_sinkhorn_iters"}, 20);
  c.hc_eps = r.number({"hc_eps"}, 1e-6);

  c.engram_layer_ids = r.integer_list<int>({"engram_layer_ids"}, false);
  c.engram_num_embeddings = r.integer_list<int64_t>({"engram_num_embeddings"}, false);
  c.engram_max_ngram_size = r.integer<int>({"engram_max_ngram_size"}, 1);
  c.engram_vocab_size = r.integer<int64_t>({"engram_vocab_size"}, 0);
  c.engram_n_heads = r.integer<int>({"engram_n_heads"}, 0);
  c.engram_head_dim = r.integer<int64_t>({"engram_head_dim"}, 0);
  c.engram_pad_id = r.integer<int64_t>({"engram_pad_token_id", "engram_pad_id"}, 2);
  c.engram_compressed_vocab_size = r.integer<int64_t>({"engram_compressed_vocab_size"}, 0);

  c.dspark_block_size = r.integer<int>({"dspark_block_size"}, 0);
  c.dspark_noise_token_id = r.integer<int64_t>({"dspark_noise_token_id"}, 0);
  c.dspark_target_layer_ids = r.integer_list<int>({"dspark_target_layer_ids"}, false);
  c.dspark_markov_rank = r.integer<int64_t>({"dspark_markov_rank"}, 256);
  c.dspark_n_routed_experts = r.integer<int>({"dspark_n_routed_experts"}, 0);
  c.dspark_n_activated_experts = r.integer<int>({"dspark_num_experts_per_tok", "dspark_n_activated_experts"}, 0);

  c.bos_token_id = r.integer<int64_t>({"bos_token_id"}, 0);
  c.eos_token_id = r.integer<int64_t>({"eos_token_id"}, 1);
  c.pad_token_id = r.integer<int64_t>({"pad_token_id"}, 2);
  c.vision = parse_vision_config(root, where);
  if (c.vision.image_token_id >= c.vocab_size) {
    fail(where + ": key \"image_token_id\"", "must be a token id below vocab_size " + std::to_string(c.vocab_size));
  }

  validate_config(c);
  const ConfigKeyReport keys = classify_config_keys(root, asked);
  c.unknown_keys = keys.unknown;
  c.unused_keys = keys.unused;
  return c;
}

namespace {

bool strictly_increasing(const std::vector<int>& v) {
  return std::adjacent_find(v.begin(), v.end(), [](int a, int b) { return a >= b; }) == v.end();
}
bool contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }
std::string list_str(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// Bounds on the integers that size loops and per-sequence buffers which no tensor's shape checks: a
// generous multiple of the released value (model-spec §1.1, in the comments), so that a typo or a
// hostile file is refused at load instead of running for hours or allocating without end.
struct IntegerBound {
  const char* key;
  int64_t max;
};
constexpr IntegerBound kSinkhornIters{"hc_sinkhorn_iters", 1000};  // 20: Sinkhorn steps per mHC mix, per token and layer
constexpr IntegerBound kHcMult{"hc_mult", 16};                     // 4: residual streams; mixes are hc x hc
constexpr IntegerBound kWindow{"window_size", 8192};              // 128: every sequence's window ring, per layer
constexpr IntegerBound kContext{"max_seq_len", int64_t{1} << 24};  // 1,048,576: positions (and original_seq_len)
constexpr IntegerBound kIndexTopk{"index_topk", 65536};           // 512: selected positions per query
constexpr IntegerBound kCandidatePool{"candidate pool (candidate_topk_blocks × candidate_block_size)",
                                      int64_t{1} << 20};          // 2048 × 8 = 16,384 candidates per query
constexpr IntegerBound kEngramNgram{"engram_max_ngram_size", 16};  // 4: n-gram orders hashed per token
constexpr IntegerBound kEngramHeads{"engram_n_heads", 64};         // 8: primes searched per order and layer
constexpr IntegerBound kEngramVocab{"engram_vocab_size", int64_t{1} << 32};  // 16,000,000: where the prime search starts

void check_bound(const std::string& where, const IntegerBound& b, int64_t v) {
  if (v > b.max) {
    fail(where, std::string(b.key) + " = " + std::to_string(v) + " is above the bound of " + std::to_string(b.max) +
                    " this engine accepts");
  }
}

}  // namespace

void validate_config(const ModelConfig& c) {
  const std::string& w = c.source;
  // The bounds first: the checks below loop over some of these values (the Engram prime search).
  check_bound(w, kSinkhornIters, c.hc_sinkhorn_iters);
  check_bound(w, kHcMult, c.hc_mult);
  check_bound(w, kWindow, c.window_size);
  check_bound(w, kContext, c.max_seq_len);
  check_bound(w, {"original_seq_len", kContext.max}, c.original_seq_len);
  check_bound(w, kIndexTopk, c.index_topk);
  check_bound(w, kCandidatePool, int64_t{c.candidate_topk_blocks} * c.candidate_block_size);
  check_bound(w, kEngramNgram, c.engram_max_ngram_size);
  check_bound(w, kEngramHeads, c.engram_n_heads);
  check_bound(w, kEngramVocab, c.engram_vocab_size);
  if (!std::isfinite(c.rope_factor)) fail(w, "rope_factor must be a finite number");
  auto positive = [&](const char* key, int64_t v) {
    if (v <= 0) fail(w, std::string(key) + " must be positive, got " + std::to_string(v));
  };
  // Activations are FP8-quantized in groups of 32 before every FP8/FP4 GEMM, so every GEMM's K must
  // be a multiple of 32; weight tiles are 32×32.
  auto multiple = [&](const char* what, int64_t v, int64_t m) {
    if (v % m != 0) {
      fail(w, std::string(what) + " = " + std::to_string(v) + " must be a multiple of " + std::to_string(m));
    }
  };
  positive("vocab_size", c.vocab_size);
  positive("dim", c.dim);
  positive("moe_inter_dim", c.moe_inter_dim);
  positive("n_layers", c.n_layers);
  if (c.n_mtp_layers < 0) fail(w, "n_mtp_layers must not be negative");
  positive("n_heads", c.n_heads);
  positive("head_dim", c.head_dim);
  positive("rope_head_dim", c.rope_head_dim);
  positive("q_lora_rank", c.q_lora_rank);
  positive("o_lora_rank", c.o_lora_rank);
  positive("o_groups", c.o_groups);
  positive("window_size", c.window_size);
  positive("max_seq_len", c.max_seq_len);
  positive("n_routed_experts", c.n_routed_experts);
  positive("n_activated_experts", c.n_activated_experts);
  positive("hc_mult", c.hc_mult);
  positive("hc_sinkhorn_iters", c.hc_sinkhorn_iters);
  if (!(c.norm_eps > 0) || !(c.hc_eps >= 0)) fail(w, "norm_eps must be positive and hc_eps not negative");
  if (c.rope_theta <= 1 || c.compress_rope_theta <= 1) fail(w, "rope_theta values must be greater than 1");
  if (c.original_seq_len < 0) fail(w, "original_seq_len must not be negative");
  if (c.original_seq_len > 0 && !(c.rope_factor >= 1)) fail(w, "rope_factor must be at least 1 with YaRN");
  multiple("dim", c.dim, 32);
  multiple("q_lora_rank", c.q_lora_rank, 32);
  multiple("moe_inter_dim", c.moe_inter_dim, 32);
  multiple("head_dim", c.head_dim, 32);
  if (c.rope_head_dim % 2 != 0 || c.rope_head_dim > c.head_dim) {
    fail(w, "rope_head_dim must be even and at most head_dim");
  }
  if (c.n_heads % c.o_groups != 0) fail(w, "n_heads must be a multiple of o_groups");
  multiple("n_heads*head_dim/o_groups (wo_a input)", c.n_heads * c.head_dim / c.o_groups, 32);
  multiple("o_groups*o_lora_rank (wo_b input)", c.o_groups * c.o_lora_rank, 32);
  if (c.n_shared_experts != 1) fail(w, "n_shared_experts must be 1 (as the reference asserts)");
  if (c.n_activated_experts > c.n_routed_experts) fail(w, "n_activated_experts exceeds n_routed_experts");
  if (c.score_func != "sqrtsoftplus" && c.score_func != "sigmoid" && c.score_func != "softmax") {
    fail(w, "score_func \"" + c.score_func + "\" is not one of sqrtsoftplus, sigmoid, softmax");
  }
  for (auto [key, id] : {std::pair{"bos_token_id", c.bos_token_id}, std::pair{"eos_token_id", c.eos_token_id},
                         std::pair{"pad_token_id", c.pad_token_id}}) {
    if (id < 0 || id >= c.vocab_size) fail(w, std::string(key) + " is outside the vocabulary");
  }

  // compress_ratios covers the backbone and the DSpark blocks; DSpark attends over its window only.
  const size_t want = static_cast<size_t>(c.total_layers());
  if (c.compress_ratios.size() != want) {
    fail(w, "compress_ratios has " + std::to_string(c.compress_ratios.size()) + " entries, expected " +
                std::to_string(want) + " (n_layers + n_mtp_layers)");
  }
  bool any_compressed = false;
  for (int l = 0; l < c.total_layers(); ++l) {
    int r = c.compress_ratios[l];
    if (r < 0) fail(w, "compress_ratios[" + std::to_string(l) + "] is negative");
    if (l >= c.n_layers && r != 0) {
      fail(w, "compress_ratios[" + std::to_string(l) + "] belongs to a DSpark block and must be 0");
    }
    if (r > c.window_size) fail(w, "compress_ratios[" + std::to_string(l) + "] exceeds the window");
    any_compressed = any_compressed || r > 0;
  }

  // Source lists: ascending backbone layers that compress.
  for (auto [key, list] : {std::pair{"kv_source_layers", &c.kv_source_layers},
                           std::pair{"index_source_layers", &c.index_source_layers}}) {
    if (!strictly_increasing(*list)) fail(w, std::string(key) + " must be strictly increasing: " + list_str(*list));
    for (int l : *list) {
      if (l < 0 || l >= c.n_layers) fail(w, std::string(key) + " names layer " + std::to_string(l) + ", outside the backbone");
      if (c.compress_ratios[l] <= 0) {
        fail(w, std::string(key) + " names layer " + std::to_string(l) + ", whose compress ratio is 0");
      }
    }
  }
  // Index keys are derived inside a KV source's own indexer, so every KV source is an index source.
  for (int l : c.kv_source_layers) {
    if (!contains(c.index_source_layers, l)) {
      fail(w, "KV source layer " + std::to_string(l) + " is not in index_source_layers (it must publish index keys)");
    }
  }
  // Every compressing layer reads the compressed KV, index keys and top-k of the nearest sources at
  // or before it, and the pooled rows only make sense at the ratio they were pooled with.
  for (int l = 0; l < c.n_layers; ++l) {
    int r = c.compress_ratios[l];
    if (r == 0) continue;
    int kv_src = -1;
    for (int s : c.kv_source_layers) if (s <= l) kv_src = s;
    if (kv_src < 0) fail(w, "layer " + std::to_string(l) + " compresses but no KV source precedes it");
    if (c.compress_ratios[kv_src] != r) {
      fail(w, "layer " + std::to_string(l) + " has ratio " + std::to_string(r) + " but reads KV source " +
                  std::to_string(kv_src) + " with ratio " + std::to_string(c.compress_ratios[kv_src]));
    }
  }
  if (any_compressed) {
    positive("index_n_heads", c.index_n_heads);
    positive("index_head_dim", c.index_head_dim);
    positive("index_topk", c.index_topk);
    multiple("index_head_dim", c.index_head_dim, 32);  // FP4 with E8M0 scales per 32
    if (c.rope_head_dim > c.index_head_dim) fail(w, "rope_head_dim exceeds index_head_dim");
  }
  if (c.candidate_source_layer >= 0) {
    if (!contains(c.index_source_layers, c.candidate_source_layer)) {
      fail(w, "candidate_source_layer " + std::to_string(c.candidate_source_layer) + " is not an index source");
    }
    positive("candidate_topk_blocks", c.candidate_topk_blocks);
    positive("candidate_block_size", c.candidate_block_size);
    int64_t pool = int64_t{c.candidate_topk_blocks} * c.candidate_block_size;
    if (pool < c.index_topk) {
      fail(w, "the candidate pool (" + std::to_string(c.candidate_topk_blocks) + " blocks × " +
                  std::to_string(c.candidate_block_size) + ") cannot hold index_topk = " +
                  std::to_string(c.index_topk));
    }
  }

  // Engram.
  if (!c.engram_layer_ids.empty()) {
    if (!strictly_increasing(c.engram_layer_ids)) fail(w, "engram_layer_ids must be strictly increasing");
    for (int l : c.engram_layer_ids) {
      if (l < 0 || l >= c.n_layers) fail(w, "engram_layer_ids names layer " + std::to_string(l) + ", outside the backbone");
    }
    if (c.engram_num_embeddings.size() != c.engram_layer_ids.size()) {
      fail(w, "engram_num_embeddings has " + std::to_string(c.engram_num_embeddings.size()) +
                  " entries for " + std::to_string(c.engram_layer_ids.size()) + " Engram layers");
    }
    if (c.engram_max_ngram_size < 2) fail(w, "engram_max_ngram_size must be at least 2");
    positive("engram_n_heads", c.engram_n_heads);
    positive("engram_head_dim", c.engram_head_dim);
    multiple("engram_head_dim", c.engram_head_dim, 32);  // FP8 rows with one scale per 32
    if (c.engram_vocab_size < 2) fail(w, "engram_vocab_size must be at least 2");
    positive("engram_compressed_vocab_size", c.engram_compressed_vocab_size);
    if (c.engram_compressed_vocab_size > c.vocab_size) fail(w, "engram_compressed_vocab_size exceeds vocab_size");
    if (c.engram_pad_id < 0 || c.engram_pad_id >= c.vocab_size) fail(w, "engram_pad_id is outside the vocabulary");
    auto layout = engram_layout(c.engram_layer_ids, c.engram_max_ngram_size, c.engram_vocab_size,
                                c.engram_n_heads, c.engram_compressed_vocab_size);
    for (size_t i = 0; i < layout.size(); ++i) {
      if (layout[i].rows != c.engram_num_embeddings[i]) {
        fail(w, "engram_num_embeddings[" + std::to_string(i) + "] = " + std::to_string(c.engram_num_embeddings[i]) +
                    " but layer " + std::to_string(layout[i].layer) + "'s primes sum to " +
                    std::to_string(layout[i].rows));
      }
    }
  } else if (!c.engram_num_embeddings.empty()) {
    fail(w, "engram_num_embeddings is given without engram_layer_ids");
  }

  // DSpark.
  if (c.n_mtp_layers > 0 && c.dspark_block_size > 0) {
    if (c.dspark_target_layer_ids.empty()) fail(w, "dspark_target_layer_ids is empty");
    std::set<int> seen;
    for (int l : c.dspark_target_layer_ids) {
      if (l < 0 || l >= c.n_layers) fail(w, "dspark_target_layer_ids names layer " + std::to_string(l) + ", outside the backbone");
      if (!seen.insert(l).second) fail(w, "dspark_target_layer_ids repeats layer " + std::to_string(l));
    }
    if (c.dspark_noise_token_id < 0 || c.dspark_noise_token_id >= c.vocab_size) {
      fail(w, "dspark_noise_token_id is outside the vocabulary");
    }
    positive("dspark_markov_rank", c.dspark_markov_rank);
    if (c.dspark_block_size > c.window_size) fail(w, "dspark_block_size exceeds the window");
    int routed = c.routed_experts(c.n_layers), active = c.activated_experts(c.n_layers);
    if (active > routed) fail(w, "dspark_n_activated_experts exceeds dspark_n_routed_experts");
  }
}

ModelConfig load_config(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::string file = path;
  if (fs::is_directory(path, ec)) {
    file = (fs::path(path) / "config.json").string();
    if (!fs::exists(file, ec)) {
      std::string flat = (fs::path(path) / "inference" / "config.json").string();
      if (!fs::exists(flat, ec)) fail(path, "no config.json (nor inference/config.json) in this folder");
      file = flat;
    }
  } else if (!fs::exists(path, ec)) {
    fail(path, "no such file or folder");
  }
  const std::string text = read_regular_file(file);  // a FIFO or a folder in its place is refused, not waited on
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    fail(file, std::string("is not valid JSON: ") + e.what());
  }
  return parse_config(j, file);
}

json config_to_inference_json(const ModelConfig& c) {
  json j = {
      {"vocab_size", c.vocab_size}, {"dim", c.dim}, {"moe_inter_dim", c.moe_inter_dim},
      {"n_layers", c.n_layers}, {"n_mtp_layers", c.n_mtp_layers},
      {"dspark_block_size", c.dspark_block_size}, {"dspark_noise_token_id", c.dspark_noise_token_id},
      {"dspark_markov_rank", c.dspark_markov_rank}, {"dspark_n_routed_experts", c.dspark_n_routed_experts},
      {"dspark_n_activated_experts", c.dspark_n_activated_experts}, {"n_heads", c.n_heads},
      {"n_routed_experts", c.n_routed_experts}, {"n_shared_experts", c.n_shared_experts},
      {"n_activated_experts", c.n_activated_experts}, {"score_func", c.score_func},
      {"route_scale", c.route_scale}, {"swiglu_limit", c.swiglu_limit}, {"q_lora_rank", c.q_lora_rank},
      {"head_dim", c.head_dim}, {"rope_head_dim", c.rope_head_dim}, {"norm_eps", c.norm_eps},
      {"o_groups", c.o_groups}, {"o_lora_rank", c.o_lora_rank}, {"window_size", c.window_size},
      {"original_seq_len", c.original_seq_len}, {"rope_theta", c.rope_theta}, {"rope_factor", c.rope_factor},
      {"beta_fast", c.beta_fast}, {"beta_slow", c.beta_slow}, {"index_n_heads", c.index_n_heads},
      {"index_head_dim", c.index_head_dim}, {"index_topk", c.index_topk},
      {"candidate_source_layer", c.candidate_source_layer}, {"candidate_topk_blocks", c.candidate_topk_blocks},
      {"candidate_block_size", c.candidate_block_size}, {"hc_mult", c.hc_mult},
      {"hc_sinkhorn_iters", c.hc_sinkhorn_iters}, {"hc_eps", c.hc_eps},
      {"engram_vocab_size", c.engram_vocab_size}, {"engram_max_ngram_size", c.engram_max_ngram_size},
      {"engram_pad_id", c.engram_pad_id}, {"engram_compressed_vocab_size", c.engram_compressed_vocab_size},
      {"engram_n_heads", c.engram_n_heads}, {"engram_head_dim", c.engram_head_dim},
      {"compress_rope_theta", c.compress_rope_theta}, {"dspark_target_layer_ids", c.dspark_target_layer_ids},
      {"kv_source_layers", c.kv_source_layers}, {"index_source_layers", c.index_source_layers},
      {"engram_layer_ids", c.engram_layer_ids}, {"engram_num_embeddings", c.engram_num_embeddings},
      {"compress_ratios", c.compress_ratios}, {"dtype", "fp8"}, {"expert_dtype", "fp4"},
      {"max_seq_len", c.max_seq_len}, {"gate_temp", c.gate_temp}, {"norm_topk_prob", c.norm_topk_prob},
      {"bos_token_id", c.bos_token_id}, {"eos_token_id", c.eos_token_id}, {"pad_token_id", c.pad_token_id},
  };
  j.update(vision_config_inference_json(c.vision));  // nothing for a text-only model: its fingerprint holds
  return j;
}

json config_to_hf_json(const ModelConfig& c) {
  json text = {
      {"model_type", "deepseek_v41_text"}, {"vocab_size", c.vocab_size}, {"hidden_size", c.dim},
      {"moe_intermediate_size", c.moe_inter_dim}, {"num_hidden_layers", c.n_layers},
      {"num_attention_heads", c.n_heads}, {"num_key_value_heads", 1}, {"head_dim", c.head_dim},
      {"qk_rope_head_dim", c.rope_head_dim}, {"q_lora_rank", c.q_lora_rank}, {"o_lora_rank", c.o_lora_rank},
      {"o_groups", c.o_groups}, {"hidden_act", "silu"}, {"swiglu_limit", c.swiglu_limit},
      {"rms_norm_eps", c.norm_eps}, {"attention_bias", false}, {"tie_word_embeddings", false},
      {"max_position_embeddings", c.max_seq_len}, {"rope_theta", c.rope_theta},
      {"rope_scaling",
       {{"rope_type", "yarn"}, {"factor", c.rope_factor}, {"beta_fast", c.beta_fast},
        {"beta_slow", c.beta_slow}, {"original_max_position_embeddings", c.original_seq_len}}},
      {"compress_rope_theta", c.compress_rope_theta}, {"n_routed_experts", c.n_routed_experts},
      {"n_shared_experts", c.n_shared_experts}, {"num_experts_per_tok", c.n_activated_experts},
      {"scoring_func", c.score_func}, {"topk_method", "noaux_tc"}, {"norm_topk_prob", c.norm_topk_prob},
      {"routed_scaling_factor", c.route_scale}, {"sliding_window", c.window_size},
      {"compress_ratios", c.compress_ratios}, {"kv_source_layer_ids", c.kv_source_layers},
      {"index_source_layer_ids", c.index_source_layers}, {"index_n_heads", c.index_n_heads},
      {"index_head_dim", c.index_head_dim}, {"index_topk", c.index_topk},
      {"candidate_source_layer_id", c.candidate_source_layer}, {"candidate_topk_blocks", c.candidate_topk_blocks},
      {"candidate_block_size", c.candidate_block_size}, {"hc_mult", c.hc_mult},
      {"hc_sinkhorn_iters", c.hc_sinkhorn_iters}, {"hc_eps", c.hc_eps},
      {"engram_layer_ids", c.engram_layer_ids}, {"engram_num_embeddings", c.engram_num_embeddings},
      {"engram_max_ngram_size", c.engram_max_ngram_size}, {"engram_vocab_size", c.engram_vocab_size},
      {"engram_n_heads", c.engram_n_heads}, {"engram_head_dim", c.engram_head_dim},
      {"engram_pad_token_id", c.engram_pad_id}, {"engram_compressed_vocab_size", c.engram_compressed_vocab_size},
      {"num_nextn_predict_layers", c.n_mtp_layers}, {"dspark_block_size", c.dspark_block_size},
      {"dspark_noise_token_id", c.dspark_noise_token_id}, {"dspark_target_layer_ids", c.dspark_target_layer_ids},
      {"dspark_markov_rank", c.dspark_markov_rank}, {"dspark_n_routed_experts", c.dspark_n_routed_experts},
      {"dspark_num_experts_per_tok", c.dspark_n_activated_experts}, {"bos_token_id", c.bos_token_id},
      {"eos_token_id", c.eos_token_id}, {"pad_token_id", c.pad_token_id},
  };
  if (c.gate_temp != 1.0) text["gate_temp"] = c.gate_temp;
  json j = {
      {"architectures", {"DeepseekV41ForCausalLM"}}, {"model_type", "deepseek_v41"}, {"dtype", "bfloat16"},
      {"bos_token_id", c.bos_token_id}, {"eos_token_id", c.eos_token_id}, {"pad_token_id", c.pad_token_id},
      {"quantization_config",
       {{"quant_method", "fp8"}, {"activation_scheme", "dynamic"}, {"weight_block_size", {32, 32}},
        {"scale_fmt", "ue8m0"}, {"expert_dtype", "fp4"}}},
      {"text_config", text},
  };
  if (c.vision.enabled()) {
    j["vision_config"] = vision_config_hf_json(c.vision);
    j["image_token_id"] = c.vision.image_token_id;
  }
  return j;
}

std::string config_fingerprint(const ModelConfig& c) {
  // nlohmann's dump() sorts object keys, so the text (and hash) is canonical for equal configs.
  std::string text = config_to_inference_json(c).dump();
  XXH64_hash_t h = XXH3_64bits(text.data(), text.size());
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

std::string model_fingerprint(const ModelConfig& c, const std::string& checkpoint_fingerprint) {
  const std::string text = config_fingerprint(c) + "/" + checkpoint_fingerprint;
  XXH64_hash_t h = XXH3_64bits(text.data(), text.size());
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

}  // namespace dsv41
