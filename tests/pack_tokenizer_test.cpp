// The data-preparation commands tools/train relies on: `dsv41 tokenizer train|encode|engram-map` and
// `dsv41 pack`, which quantizes full-precision weights into the released layout.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "model/tensor_layout.h"
#include "numeric/formats.h"
#include "test_util.h"
#include "text/engram_token_map.h"
#include "text/tokenizer.h"

namespace dsv41 {
namespace {

using nlohmann::json;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

template <typename T>
std::vector<T> read_array(const std::string& path) {
  const std::string bytes = read_bytes(path);
  std::vector<T> v(bytes.size() / sizeof(T));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(T));
  return v;
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

constexpr const char* kText =
    "The cat sat on the mat. The dog sat on the log. A cat and a dog sat together on the mat,\n"
    "and the cat said to the dog: \"The mat is mine.\" The dog said nothing, and sat on the log.\n";

TEST(CliTokenizer, TrainEncodeAndEngramMapAgreeWithTheEngine) {
  test::TempDir dir;
  write_text(dir / "text.txt", kText);
  auto r = test::run_dsv41("tokenizer train -f " + dir / "text.txt" + " --vocab 320 -o " + dir / "tok.json");
  ASSERT_EQ(r.status, 0) << r.out;
  const Tokenizer tok = Tokenizer::from_file(dir / "tok.json");
  EXPECT_EQ(tok.vocab_size(), 320);
  EXPECT_TRUE(tok.token_id("<｜User｜>").has_value());  // the chat specials are there
  EXPECT_TRUE(tok.token_id("<｜Assistant｜>").has_value());
  EXPECT_TRUE(tok.token_id("Ġcat").has_value()) << "a frequent word of the text became one token";

  r = test::run_dsv41("tokenizer encode -t " + dir / "tok.json" + " -f " + dir / "text.txt" + " -o " + dir / "ids");
  ASSERT_EQ(r.status, 0) << r.out;
  const auto ids = read_array<uint32_t>(dir / "ids");
  const auto want = tok.encode(kText, false);
  ASSERT_EQ(ids.size(), want.size());
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(ids[i], static_cast<uint32_t>(want[i])) << i;
  EXPECT_LT(ids.size(), std::strlen(kText) / 2) << "merges shorten the text";
  EXPECT_EQ(tok.decode(std::vector<int32_t>(ids.begin(), ids.end())), kText);

  r = test::run_dsv41("tokenizer engram-map -t " + dir / "tok.json" + " --vocab 320 -o " + dir / "map");
  ASSERT_EQ(r.status, 0) << r.out;
  const EngramTokenMap map = build_engram_token_map(json::parse(read_bytes(dir / "tok.json")), 320);
  EXPECT_EQ(std::stoll(r.out), map.size);
  const auto written = read_array<int32_t>(dir / "map");
  ASSERT_EQ(written.size(), 320u);
  for (size_t i = 0; i < written.size(); ++i) EXPECT_EQ(written[i], map.compressed[i]) << i;

  r = test::run_dsv41("make-tiny --out " + dir / "m" + " --tokenizer " + dir / "tok.json");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(load_config(dir / "m").vocab_size, 320);
  EXPECT_EQ(load_config(dir / "m").engram_compressed_vocab_size, map.size);
  r = test::run_dsv41("inspect " + dir / "m");
  EXPECT_EQ(r.status, 0) << r.out;
}

TEST(CliTokenizer, BadInputsGetClearErrors) {
  test::TempDir dir;
  write_text(dir / "text.txt", kText);
  write_text(dir / "bad.json", "{ not json");
  for (const auto& [args, expect] : std::vector<std::pair<std::string, std::string>>{
           {"tokenizer", "usage"},
           {"tokenizer split -f x", "unknown tokenizer action"},
           {"tokenizer train -f " + dir / "missing.txt" + " --vocab 300 -o " + dir / "t.json", "missing.txt"},
           {"tokenizer train -f " + dir / "text.txt" + " --vocab 100 -o " + dir / "t.json", "too small"},
           {"tokenizer train -f " + dir / "text.txt" + " -o " + dir / "t.json", "--vocab"},
           {"tokenizer encode -t " + dir / "bad.json" + " -f " + dir / "text.txt" + " -o " + dir / "ids", "bad.json"},
           {"tokenizer engram-map -t " + dir / "bad.json" + " --vocab 300 -o " + dir / "map", "not valid JSON"},
           {"make-tiny --out " + dir / "m" + " --tokenizer " + dir / "bad.json", "bad.json"},
       }) {
    auto r = test::run_dsv41(args);
    EXPECT_NE(r.status, 0) << args;
    EXPECT_NE(r.out.find(expect), std::string::npos) << args << "\n" << r.out;
  }
}

// Every tensor of a checkpoint as F32 over its logical shape, as tools/train exports them.
std::vector<TensorBlob> dequantized(const std::string& model_dir, const ModelConfig& config) {
  const Checkpoint ck(model_dir);
  std::vector<TensorBlob> out;
  const auto specs = checkpoint_tensors(config);
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    if (s.kind == TensorKind::Scale) continue;
    const TensorView& t = ck.get(s.name);
    std::vector<float> v;
    std::vector<int64_t> shape = s.shape;
    if (s.kind == TensorKind::F32) {
      v.assign(reinterpret_cast<const float*>(t.data), reinterpret_cast<const float*>(t.data) + t.numel());
    } else if (s.kind == TensorKind::Bf16) {
      for (int64_t k = 0; k < t.numel(); ++k) {
        uint16_t h;
        std::memcpy(&h, t.data + 2 * k, 2);
        v.push_back(bf16_to_f32(h));
      }
    } else {
      const TensorView& sc = ck.get(specs[i + 1].name);
      const int64_t rows = s.shape[0], cols = s.logical_in, scale_cols = sc.shape()[1];
      const int64_t tile_rows = s.kind == TensorKind::Fp8Weight ? 32 : 1;
      std::vector<uint8_t> codes(static_cast<size_t>(cols));
      for (int64_t r = 0; r < rows; ++r) {
        if (s.kind == TensorKind::Fp4Weight) unpack_e2m1(t.data + r * cols / 2, static_cast<size_t>(cols), codes.data());
        for (int64_t c = 0; c < cols; ++c) {
          const float scale = e8m0_to_f32(sc.data[(r / tile_rows) * scale_cols + c / 32]);
          const float q = s.kind == TensorKind::Fp4Weight ? e2m1_to_f32(codes[c]) : e4m3_to_f32(t.data[r * cols + c]);
          v.push_back(q * scale);
        }
      }
      shape = {rows, cols};
    }
    TensorBlob b{s.name, DType::F32, shape, std::vector<uint8_t>(v.size() * 4)};
    std::memcpy(b.bytes.data(), v.data(), b.bytes.size());
    out.push_back(std::move(b));
  }
  return out;
}

void write_weights(const std::string& path, const std::vector<TensorBlob>& blobs) {
  std::vector<const TensorBlob*> ptrs;
  for (const TensorBlob& b : blobs) ptrs.push_back(&b);
  write_safetensors(path, ptrs);
}

// Values already on the stored grid come back as the same values: pack quantizes as make-tiny does.
// (Not always as the same bytes: a block whose largest value rounded down may now take a scale half
// as large, with codes twice as large.)
TEST(CliPack, DequantizedWeightsPackBackToTheSameTensors) {
  test::TempDir dir;
  const ModelConfig config = load_config(test::tiny_model_dir());
  write_weights(dir / "w.safetensors", dequantized(test::tiny_model_dir(), config));
  auto r = test::run_dsv41("pack --like " + test::tiny_model_dir() + " --weights " + dir / "w.safetensors" +
                           " --out " + dir / "packed");
  ASSERT_EQ(r.status, 0) << r.out;
  const std::vector<TensorBlob> a = dequantized(test::tiny_model_dir(), config), b = dequantized(dir / "packed", config);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].name, b[i].name);
    ASSERT_EQ(a[i].shape, b[i].shape) << a[i].name;
    EXPECT_EQ(a[i].bytes, b[i].bytes) << a[i].name;
  }
  EXPECT_EQ(Checkpoint(dir / "packed").names(), Checkpoint(test::tiny_model_dir()).names());
  EXPECT_EQ(read_bytes(dir / "packed/tokenizer.json"), read_bytes(test::tiny_model_dir() + "/tokenizer.json"));
  r = test::run_dsv41("inspect " + dir / "packed");
  EXPECT_EQ(r.status, 0) << r.out;
}

TEST(CliPack, MissingMisshapenUnknownOrNonFiniteTensorsAreRefusedBeforeWriting) {
  test::TempDir dir;
  const ModelConfig config = load_config(test::tiny_model_dir());
  const std::vector<TensorBlob> good = dequantized(test::tiny_model_dir(), config);
  auto expect_refused = [&](std::vector<TensorBlob> blobs, const std::string& phrase) {
    write_weights(dir / "w.safetensors", blobs);
    auto r = test::run_dsv41("pack --like " + test::tiny_model_dir() + " --weights " + dir / "w.safetensors" +
                             " --out " + dir / "out");
    EXPECT_EQ(r.status, 1) << phrase;
    EXPECT_NE(r.out.find(phrase), std::string::npos) << r.out;
    EXPECT_FALSE(std::filesystem::exists(dir / "out")) << "nothing is written for a bad file";
  };
  std::vector<TensorBlob> missing(good.begin() + 1, good.end());
  expect_refused(missing, "has no tensor " + good[0].name);
  std::vector<TensorBlob> misshapen = good;
  misshapen[0].shape = {misshapen[0].shape[0] * misshapen[0].shape[1]};
  expect_refused(misshapen, good[0].name + " must be F32");
  std::vector<TensorBlob> unknown = good;
  unknown.push_back({"layers.0.attn.extra", DType::F32, {1}, std::vector<uint8_t>(4)});
  expect_refused(unknown, "layers.0.attn.extra");
  std::vector<TensorBlob> nan = good;
  const float q = std::nanf("");
  std::memcpy(nan[0].bytes.data(), &q, 4);
  expect_refused(nan, "not finite");
}

}  // namespace
}  // namespace dsv41
