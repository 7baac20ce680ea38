#include "model/weights.h"

#include <algorithm>
#include <cstring>
#include <map>

#include <sys/mman.h>
#include <unistd.h>

#include "model/checkpoint_check.h"
#include "model/tensor_layout.h"
#include "model/vision_weights.h"
#include "io/layer_roles.h"
#include "numeric/formats.h"
#include "util/error.h"

namespace dsv41 {

namespace {

// Drops this process's pages of a mapped range that only the packed copy is read from now (they
// come back from the file if a scalar path touches them): without it the weights would count twice
// in the resident set.
void release_mapped(const uint8_t* p, int64_t bytes) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes)) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}


class Binder {
 public:
  // `anon` counts the bytes of every copy or conversion made (ModelWeights::anon_bytes).
  Binder(const Checkpoint& c, uint64_t& anon) : ckpt_(c), anon_(anon) {}

  Fp8Matrix fp8(const std::string& name) const {
    const TensorView& w = ckpt_.get(name + ".weight");
    const TensorView& s = ckpt_.get(name + ".scale");
    return {w.data, s.data, w.shape()[0], w.shape()[1]};
  }
  Fp4Matrix fp4(const std::string& name) const {
    const TensorView& w = ckpt_.get(name + ".weight");
    const TensorView& s = ckpt_.get(name + ".scale");
    return {w.data, s.data, w.shape()[0], w.shape()[1] * 2};
  }
  // A view into the mapping; a copy where the tensor starts at an odd address (a crafted file: the
  // format promises no alignment), since the kernels read aligned uint16 values.
  Bf16Tensor bf16(const std::string& name) const {
    const TensorView& t = ckpt_.get(name);
    Bf16Tensor out;
    out.n = t.shape()[0];
    out.k = t.shape().size() > 1 ? t.shape()[1] : 1;
    if (reinterpret_cast<uintptr_t>(t.data) % alignof(uint16_t) == 0) {
      out.values = reinterpret_cast<const uint16_t*>(t.data);
      return out;
    }
    out.owned.resize(static_cast<size_t>(t.numel()));
    std::memcpy(out.owned.data(), t.data, t.nbytes());
    out.values = out.owned.data();
    anon_ += t.nbytes();
    return out;
  }
  bool has(const std::string& name) const { return ckpt_.find(name) != nullptr; }
  // An optional tensor: checked against the dtype and length the config implies before it is read.
  std::vector<float> f32(const std::string& name, int64_t n) const {
    ckpt_.expect(name, DType::F32, {n});
    return f32(name);
  }
  std::vector<float> f32(const std::string& name) const {
    const TensorView& t = ckpt_.get(name);
    std::vector<float> out(static_cast<size_t>(t.numel()));
    std::memcpy(out.data(), t.data, t.nbytes());
    anon_ += t.nbytes();
    return out;
  }
  // Values read for a conversion at load (not kept: the caller counts what it keeps).
  std::vector<float> bf16_as_f32(const std::string& name) const {
    const TensorView& t = ckpt_.get(name);
    std::vector<float> out(static_cast<size_t>(t.numel()));
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t v;
      std::memcpy(&v, t.data + 2 * i, 2);
      out[i] = bf16_to_f32(v);
    }
    return out;
  }
  // An FP8 matrix dequantized to bf16 (exact: an e4m3 value times a power of two fits bf16), through
  // a table of the 256 codes per scale so loading the release's 40 of them stays quick.
  Bf16Tensor fp8_dequant(const std::string& name) const {
    Fp8Matrix m = fp8(name);
    Bf16Tensor out;
    out.n = m.n;
    out.k = m.k;
    out.owned.resize(static_cast<size_t>(m.n * m.k));
    out.values = out.owned.data();
    anon_ += out.owned.size() * sizeof(uint16_t);
    const int64_t scale_cols = (m.k + 31) / 32;
    float codes[256];
    for (int i = 0; i < 256; ++i) codes[i] = e4m3_to_f32(static_cast<uint8_t>(i));
    for (int64_t r = 0; r < m.n; ++r) {
      for (int64_t c0 = 0; c0 < m.k; c0 += 32) {
        const float s = e8m0_to_f32(m.scale[(r / 32) * scale_cols + c0 / 32]);
        for (int64_t c = c0; c < std::min(m.k, c0 + 32); ++c) {
          out.owned[static_cast<size_t>(r * m.k + c)] = bf16_from_f32(codes[m.w[r * m.k + c]] * s);
        }
      }
    }
    release_mapped(m.w, m.n * m.k);  // the FP8 codes are never read again
    return out;
  }

 private:
  const Checkpoint& ckpt_;
  uint64_t& anon_;
};

// A share's routed experts: the others stay empty (never read, never packed).
void bind_experts(const Binder& b, const ModelConfig& c, const LayerRole& r, const std::string& p,
                  const ExpertShare& share, MoeWeights& f) {
  const int experts = c.routed_experts(r.layer);
  const auto [first, end] = share.experts(experts);
  f.experts.resize(static_cast<size_t>(experts));
  for (int64_t e = first; e < end; ++e) {
    const std::string ep = p + "ffn.experts." + std::to_string(e) + ".";
    f.experts[static_cast<size_t>(e)] = {b.fp4(ep + "w1"), b.fp4(ep + "w2"), b.fp4(ep + "w3")};
  }
}

void bind_block(const Binder& b, const ModelConfig& c, const LayerRole& r, const std::string& p, LayerWeights& L) {
  L.hc_attn_fn = b.f32(p + "hc_attn_fn");
  L.hc_ffn_fn = b.f32(p + "hc_ffn_fn");
  L.hc_attn_base = b.f32(p + "hc_attn_base");
  L.hc_ffn_base = b.f32(p + "hc_ffn_base");
  L.hc_attn_scale = b.f32(p + "hc_attn_scale");
  L.hc_ffn_scale = b.f32(p + "hc_ffn_scale");
  L.attn_norm = b.bf16(p + "attn_norm.weight");
  L.ffn_norm = b.bf16(p + "ffn_norm.weight");

  AttentionWeights& a = L.attn;
  const std::string ap = p + "attn.";
  a.attn_sink = b.f32(ap + "attn_sink");
  a.wq_a = b.fp8(ap + "wq_a");
  a.q_norm = b.bf16(ap + "q_norm.weight");
  a.wq_b = b.fp8(ap + "wq_b");
  a.wkv = b.fp8(ap + "wkv");
  a.kv_norm = b.bf16(ap + "kv_norm.weight");
  a.wo_a = b.fp8_dequant(ap + "wo_a");
  a.wo_b = b.fp8(ap + "wo_b");
  if (r.kv_source) {
    a.comp_wkv = b.bf16(ap + "compressor.wkv.weight");
    if (r.compress_ratio > 1) a.comp_wgate = b.bf16(ap + "compressor.wgate.weight");
    a.comp_norm = b.bf16(ap + "compressor.norm.weight");
    a.idx_wk = b.bf16(ap + "indexer.wk.weight");
    a.idx_k_norm = b.bf16(ap + "indexer.k_norm.weight");
  }
  if (r.index_source) {
    a.idx_wq_b = b.fp8(ap + "indexer.wq_b");
    a.idx_weights_proj = b.bf16(ap + "indexer.weights_proj.weight");
  }

  MoeWeights& f = L.ffn;
  const std::string fp = p + "ffn.";
  f.gate = b.bf16(fp + "gate.weight");
  f.gate_bias = b.f32(fp + "gate.bias");
  if (b.has(fp + "gate.bias_vl")) f.gate_bias_vl = b.f32(fp + "gate.bias_vl", c.routed_experts(r.layer));
  f.shared = {b.fp8(fp + "shared_experts.w1"), b.fp8(fp + "shared_experts.w2"), b.fp8(fp + "shared_experts.w3")};
}

// vision-spec §2: every tensor BF16, checked against the shapes the vision config implies.
std::unique_ptr<VisionWeights> bind_vision(const Binder& b, const Checkpoint& ckpt, const ModelConfig& c) {
  auto v = std::make_unique<VisionWeights>();
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const TensorSpec& t : vision_tensors(c)) shapes[t.name] = t.shape;
  const auto matrix = [&](const std::string& name) {
    ckpt.expect(name, DType::BF16, shapes.at(name));
    return b.bf16(name);
  };
  const auto bias = [&](const std::string& name) {
    ckpt.expect(name, DType::BF16, shapes.at(name));
    return b.bf16_as_f32(name);
  };
  v->patch_proj = matrix("vision.patch_embed.proj.weight");
  v->patch_bias = bias("vision.patch_embed.proj.bias");
  v->blocks.resize(static_cast<size_t>(c.vision.n_layers));
  for (int i = 0; i < c.vision.n_layers; ++i) {
    const std::string p = "vision.blocks." + std::to_string(i) + ".";
    VisionBlockWeights& w = v->blocks[static_cast<size_t>(i)];
    w.norm1 = matrix(p + "norm1.weight");
    w.norm2 = matrix(p + "norm2.weight");
    w.wqkv = matrix(p + "attn.wqkv.weight");
    w.wqkv_bias = bias(p + "attn.wqkv.bias");
    w.wo = matrix(p + "attn.wo.weight");
    w.wo_bias = bias(p + "attn.wo.bias");
    w.w1 = matrix(p + "mlp.w1.weight");
    w.w2 = matrix(p + "mlp.w2.weight");
  }
  v->norm = matrix("vision.norm.weight");
  v->aligner_w1 = matrix("aligner.w1.weight");
  v->aligner_b1 = bias("aligner.w1.bias");
  v->aligner_w2 = matrix("aligner.w2.weight");
  v->aligner_b2 = bias("aligner.w2.bias");
  v->image_start = matrix("image_start");
  v->image_end = matrix("image_end");
  v->image_newline = matrix("image_newline");
  return v;
}

}  // namespace

ModelWeights::~ModelWeights() = default;

ModelWeights::ModelWeights(const std::string& dir, const ModelConfig& config, std::shared_ptr<const Backend> backend,
                           EngramTier engram_tier, WeightPlacement placement)
    : config_(config), backend_(std::move(backend)), checkpoint_(std::make_unique<Checkpoint>(dir)) {
  if (!backend_) fail(dir, "weights need a backend");
  check_checkpoint(*checkpoint_, config_);
  check_expert_share(config_, placement.share);
  Binder b(*checkpoint_, anon_bytes_);
  if (placement.dense) {
    embed = b.bf16("embed.weight");
    head = b.bf16("head.weight");
    norm = b.bf16("norm.weight");
  }
  const auto roles = derive_layer_roles(config_);
  layers.resize(roles.size());
  for (const LayerRole& r : roles) {
    if (r.dspark && !config_.has_dspark()) continue;
    const std::string p = r.dspark ? "mtp." + std::to_string(r.layer - config_.n_layers) + "."
                                   : "layers." + std::to_string(r.layer) + ".";
    LayerWeights& L = layers[r.layer];
    if (placement.dense) bind_block(b, config_, r, p, L);
    bind_experts(b, config_, r, p, placement.share, L.ffn);
    if (r.engram) {
      EngramWeights e;
      const TensorView& table = checkpoint_->get(p + "engram.embed.weight");
      e.table = std::make_shared<EngramStore>(table, checkpoint_->get(p + "engram.embed.scale"), engram_tier, 4,
                                              placement.share.rows(table.shape()[0]));
      if (!placement.dense) {
        L.engram = std::move(e);
        continue;
      }
      e.wkv = b.fp8(p + "engram.wkv");
      std::vector<float> q = b.bf16_as_f32(p + "engram.q_weight"), k = b.bf16_as_f32(p + "engram.k_weight");
      e.qk.resize(q.size());
      for (size_t i = 0; i < q.size(); ++i) e.qk[i] = q[i] * k[i];
      anon_bytes_ += e.qk.size() * sizeof(float);
      L.engram = std::move(e);
    }
  }
  if (config_.vision.enabled() && placement.dense && b.has("vision.patch_embed.proj.weight")) {
    vision = bind_vision(b, *checkpoint_, config_);
    size_t bias_values = vision->patch_bias.size() + vision->aligner_b1.size() + vision->aligner_b2.size();
    for (const VisionBlockWeights& w : vision->blocks) bias_values += w.wqkv_bias.size() + w.wo_bias.size();
    anon_bytes_ += bias_values * sizeof(float);  // the biases, kept in fp32
  }
  if (config_.has_dspark() && placement.dense) {
    const std::string first = "mtp.0.", last = "mtp." + std::to_string(config_.n_mtp_layers - 1) + ".";
    dspark.main_proj = b.fp8(first + "main_proj");
    dspark.main_norm = b.bf16(first + "main_norm.weight");
    dspark.norm = b.bf16(last + "norm.weight");
    dspark.markov_embed = b.bf16(last + "markov_head.embed.weight");
    dspark.markov_head = b.bf16(last + "markov_head.head.weight");
    dspark.confidence = b.bf16(last + "confidence_head.proj.weight");
  }
  pack_matrices(*backend_, placement);
}

// Packs matrix by matrix, dropping each one's mapped pages as soon as its packed copy exists, so the
// load never holds a second copy of more than one matrix.
void ModelWeights::pack_matrices(const Backend& backend, WeightPlacement placement) {
  if (backend.weight_tile_rows() == 0) return;  // this backend reads the checkpoint's layout
  const auto fp8 = [&](Fp8Matrix& m) {
    if (m.w == nullptr || !placement.pack_dense) return;
    packed_.push_back(backend.pack(m));
    m.packed = packed_.back()->view();
    anon_bytes_ += packed_.back()->bytes();
    release_mapped(m.w, m.n * m.k);
  };
  const auto fp4 = [&](Fp4Matrix& m) {
    if (m.w == nullptr || !placement.pack_experts) return;
    packed_.push_back(backend.pack(m));
    m.packed = packed_.back()->view();
    anon_bytes_ += packed_.back()->bytes();
    release_mapped(m.w, m.n * m.k / 2);
  };
  // A BF16 matrix is then held once: its mapped pages dropped, or its own values (wo_a's conversion)
  // freed, since every level's kernels read a packed BF16 matrix from the tiles alone as long as the
  // sub-matrices the model takes (rows of `group_rows`) start on tile boundaries.
  const auto bf16 = [&](Bf16Tensor& t, int64_t group_rows) {
    if (t.empty() || !placement.pack_dense) return;
    auto p = backend.pack(t.view());
    anon_bytes_ += p->bytes();
    t.packed = std::move(p);
    if (t.owned.empty()) {
      release_mapped(reinterpret_cast<const uint8_t*>(t.values), t.n * t.k * 2);
    } else if (group_rows % backend.weight_tile_rows() == 0) {
      anon_bytes_ -= t.owned.size() * sizeof(uint16_t);
      std::vector<uint16_t>().swap(t.owned);  // gives the memory back (assigning {} keeps the capacity)
      t.values = nullptr;
    }
  };
  bf16(head, head.n);
  for (LayerWeights& L : layers) {
    AttentionWeights& a = L.attn;
    for (Fp8Matrix* m : {&a.wq_a, &a.wq_b, &a.wkv, &a.wo_b, &a.idx_wq_b}) fp8(*m);
    bf16(a.wo_a, config_.o_lora_rank);  // attention.cpp takes it a group of o_lora_rank rows at a time
    for (Bf16Tensor* t : {&a.comp_wkv, &a.comp_wgate, &a.idx_wk, &a.idx_weights_proj}) bf16(*t, t->n);
    bf16(L.ffn.gate, L.ffn.gate.n);
    for (Fp8Matrix* m : {&L.ffn.shared.w1, &L.ffn.shared.w2, &L.ffn.shared.w3}) fp8(*m);
    for (ExpertMatrices<Fp4Matrix>& e : L.ffn.experts) {
      for (Fp4Matrix* m : {&e.w1, &e.w2, &e.w3}) fp4(*m);
    }
    if (L.engram) fp8(L.engram->wkv);
  }
  fp8(dspark.main_proj);
  if (vision) {
    for (Bf16Tensor* t : {&vision->patch_proj, &vision->aligner_w1, &vision->aligner_w2}) bf16(*t, t->n);
    for (VisionBlockWeights& w : vision->blocks) {
      for (Bf16Tensor* t : {&w.wqkv, &w.wo, &w.w1, &w.w2}) bf16(*t, t->n);
    }
  }
  bf16(dspark.markov_head, dspark.markov_head.n);
  bf16(dspark.confidence, dspark.confidence.n);
}

}  // namespace dsv41
