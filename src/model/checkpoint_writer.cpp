#include "model/checkpoint_writer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/safetensors_writer.h"
#include "numeric/formats.h"
#include "numeric/quant.h"
#include "util/error.h"

namespace dsv41 {

using nlohmann::json;

namespace {

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

TensorBlob plain_blob(const TensorSpec& s, const std::vector<float>& v) {
  TensorBlob b{s.name, s.dtype, s.shape, {}};
  if (s.dtype == DType::F32) {
    b.bytes.resize(v.size() * 4);
    std::memcpy(b.bytes.data(), v.data(), b.bytes.size());
  } else {  // BF16
    b.bytes.resize(v.size() * 2);
    for (size_t i = 0; i < v.size(); ++i) {
      uint16_t h = bf16_from_f32(v[i]);
      std::memcpy(&b.bytes[2 * i], &h, 2);
    }
  }
  return b;
}

// FP8 weight with one power-of-two scale per 32×32 tile (per 32 along a row for Engram tables,
// whose scale shape is [rows, dim/32]): the scale is the smallest power of two that fits amax in
// e4m3's range, as the release's UE8M0 scales are.
void fp8_blobs(const TensorSpec& w, const TensorSpec& sc, const std::vector<float>& v, TensorBlob& wb, TensorBlob& sb) {
  const int64_t n = w.shape[0], k = w.shape[1];
  const int64_t tile_rows = w.kind == TensorKind::EngramTable ? 1 : 32;
  wb = {w.name, DType::F8_E4M3, w.shape, std::vector<uint8_t>(static_cast<size_t>(n * k))};
  sb = {sc.name, DType::F8_E8M0, sc.shape, std::vector<uint8_t>(static_cast<size_t>(numel(sc.shape)))};
  const int64_t scale_cols = sc.shape[1];
  for (int64_t r0 = 0; r0 < n; r0 += tile_rows) {
    for (int64_t c0 = 0; c0 < k; c0 += 32) {
      const int64_t r1 = std::min(n, r0 + tile_rows), c1 = std::min(k, c0 + 32);
      float amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t col = c0; col < c1; ++col) amax = std::max(amax, std::fabs(v[r * k + col]));
      const float s = pow2_ceil_scale(std::max(amax, 1e-30f), 1.0f / 448.0f);
      sb.bytes[(r0 / tile_rows) * scale_cols + c0 / 32] = e8m0_from_pow2(s);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t col = c0; col < c1; ++col) wb.bytes[r * k + col] = e4m3_from_f32(v[r * k + col] / s);
    }
  }
}

// MXFP4 expert weight: E2M1 codes packed two per byte along K, one power-of-two scale per 32.
void fp4_blobs(const TensorSpec& w, const TensorSpec& sc, const std::vector<float>& v, TensorBlob& wb, TensorBlob& sb) {
  const int64_t n = w.shape[0], k = w.logical_in;
  wb = {w.name, DType::I8, w.shape, std::vector<uint8_t>(static_cast<size_t>(n * k / 2))};
  sb = {sc.name, DType::F8_E8M0, sc.shape, std::vector<uint8_t>(static_cast<size_t>(n * k / 32))};
  std::vector<uint8_t> codes(32);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c0 = 0; c0 < k; c0 += 32) {
      const float* x = &v[r * k + c0];
      float amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float s = pow2_ceil_scale(std::max(amax, 1e-30f), 1.0f / 6.0f);
      sb.bytes[r * (k / 32) + c0 / 32] = e8m0_from_pow2(s);
      for (int i = 0; i < 32; ++i) codes[i] = e2m1_from_f32(std::clamp(x[i] / s, -6.0f, 6.0f));
      pack_e2m1(codes.data(), 32, &wb.bytes[(r * k + c0) / 2]);
    }
  }
}

bool is_quantized(const TensorSpec& s) {
  return s.kind == TensorKind::Fp8Weight || s.kind == TensorKind::Fp4Weight || s.kind == TensorKind::EngramTable;
}

}  // namespace

int64_t logical_numel(const TensorSpec& s) { return is_quantized(s) ? s.shape[0] * s.logical_in : numel(s.shape); }

void write_checkpoint(const std::string& dir, const ModelConfig& c, const json& tokenizer, uint64_t shard_bytes,
                      const TensorValues& values) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(fs::path(dir) / "inference", ec);
  if (ec) fail(dir, "cannot create the folder: " + ec.message());

  auto write_json = [](const fs::path& path, const json& j) {
    std::string text = j.dump(2) + "\n";
    write_file_atomic(path.string(), text.data(), text.size());
  };
  write_json(fs::path(dir) / "config.json", config_to_hf_json(c));
  write_json(fs::path(dir) / "inference" / "config.json", config_to_inference_json(c));
  write_json(fs::path(dir) / "tokenizer.json", tokenizer);

  ShardedWriter writer(dir, shard_bytes);
  std::vector<TensorSpec> specs = checkpoint_tensors(c);
  // A vision tower brings the image routing biases and its own tensors (none without one).
  for (const auto& extra : {image_routing_biases(c), vision_tensors(c)}) specs.insert(specs.end(), extra.begin(), extra.end());
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    if (s.kind == TensorKind::Scale) continue;  // written with its weight
    const int64_t count = logical_numel(s);
    std::vector<float> v = values(s, count);
    if (static_cast<int64_t>(v.size()) != count) {
      fail(s.name, "expected " + std::to_string(count) + " values, got " + std::to_string(v.size()));
    }
    if (!is_quantized(s)) {
      writer.add(plain_blob(s, v));
      continue;
    }
    TensorBlob wb, sb;
    if (s.kind == TensorKind::Fp4Weight) {
      fp4_blobs(s, specs[i + 1], v, wb, sb);
    } else {
      fp8_blobs(s, specs[i + 1], v, wb, sb);
    }
    writer.add(std::move(wb));
    writer.add(std::move(sb));
  }
  writer.finish();
}

}  // namespace dsv41
