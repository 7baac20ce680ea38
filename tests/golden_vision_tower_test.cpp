// The vision tower against the official reference on tiny-vision (its README, "How to compare"):
// the RoPE tables, the ViT and the aligner fed the reference's own patches, the tower end to end,
// and the span rows the assembly writes into the language model's input. The tower runs in bf16
// with torch's kernels in the reference, whose own choice of kernels moves it 0.3-0.7% rel-L2, so
// the bar is 1.5% (issue text, vision-spec §8); the span assembly only copies rows and is exact.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "golden_util.h"
#include "model/model.h"
#include "model/vision_tower.h"
#include "model/vision_weights.h"
#include "test_util.h"

namespace dsv41 {
namespace {

using test::read_array;

double rel_l2(const std::vector<float>& ours, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(ours[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

class GoldenVisionTower : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(test::golden_dir("tiny-vision"));
    std::ifstream in(*dir_ + "/golden.json");
    meta_ = new nlohmann::json(nlohmann::json::parse(in));
    model_ = load_model(*dir_).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete meta_;
    delete dir_;
  }
  const nlohmann::json& image() const { return (*meta_)["images"][GetParam()]; }
  std::vector<float> golden(const char* what) const {
    return read_array<float>(*dir_ + "/" + image()[what]["file"].get<std::string>());
  }
  ImageGrid grid() const {
    return {image()["n_vit_hw"][0].get<int64_t>(), image()["n_vit_hw"][1].get<int64_t>()};
  }
  VisionTower tower() const {
    return VisionTower(model_->backend(), *model_->weights().vision, model_->config().vision, model_->config().dim);
  }
  static std::string* dir_;
  static nlohmann::json* meta_;
  static Model* model_;
};
std::string* GoldenVisionTower::dir_ = nullptr;
nlohmann::json* GoldenVisionTower::meta_ = nullptr;
Model* GoldenVisionTower::model_ = nullptr;

TEST_P(GoldenVisionTower, TheCheckpointCarriesTheTowerAndItsConfig) {
  const VisionConfig& v = model_->config().vision;
  ASSERT_TRUE(v.enabled());
  EXPECT_EQ(v.n_layers, 2);
  EXPECT_EQ(v.dim, 64);
  EXPECT_EQ(v.head_dim(), 16);
  EXPECT_EQ(v.image_token_id, 510);
  ASSERT_NE(model_->weights().vision, nullptr);
  EXPECT_EQ(grid().llm_h(v.downsample_ratio), image()["n_llm_hw"][0].get<int64_t>());
  EXPECT_EQ(grid().llm_w(v.downsample_ratio), image()["n_llm_hw"][1].get<int64_t>());
  EXPECT_EQ(grid().span_length(v.downsample_ratio), image()["num_tokens"].get<int64_t>());
}

TEST_P(GoldenVisionTower, RopeTablesAreTheReferences) {
  std::vector<float> cos, sin;
  const VisionConfig& v = model_->config().vision;
  vision_rope_tables(grid().nh, grid().nw, v.head_dim(), v.rope_theta, cos, sin);
  const std::vector<float> want_cos = golden("rope_cos"), want_sin = golden("rope_sin");
  ASSERT_EQ(cos.size(), want_cos.size());
  ASSERT_EQ(sin.size(), want_sin.size());
  double worst = 0;
  int64_t identical = 0;
  for (size_t i = 0; i < cos.size(); ++i) {
    worst = std::max({worst, std::fabs(static_cast<double>(cos[i]) - want_cos[i]),
                      std::fabs(static_cast<double>(sin[i]) - want_sin[i])});
    identical += cos[i] == want_cos[i] && sin[i] == want_sin[i];
  }
  std::printf("[golden] image %s rope: %lld of %zu pairs identical, worst |d| %.2e\n", GetParam().c_str(),
              static_cast<long long>(identical), cos.size(), worst);
  EXPECT_LE(worst, 2.5e-7);  // one fp32 ulp at 1: torch's vectorised sin/cos against libm's
}

TEST_P(GoldenVisionTower, VitAlignerAndSpanAgreeWithTheReference) {
  const VisionTower t = tower();
  const std::vector<float> patches = golden("patches"), want_vit = golden("vit"), want_aligner = golden("aligner");
  const std::vector<float> vit = t.encode(patches.data(), grid());
  ASSERT_EQ(vit.size(), want_vit.size());
  const double vit_err = rel_l2(vit, want_vit);
  // the aligner alone, on the reference's ViT output
  const std::vector<float> aligned_on_ref = t.align(want_vit.data(), grid());
  ASSERT_EQ(aligned_on_ref.size(), want_aligner.size());
  const double aligner_err = rel_l2(aligned_on_ref, want_aligner);
  // the tower end to end
  const std::vector<float> aligned = t.align(vit.data(), grid());
  const double tower_err = rel_l2(aligned, want_aligner);
  const double self_vit = image()["fp32_tower_vs_reference"]["vit_rel_l2"].get<double>();
  std::printf("[golden] image %s: ViT rel L2 %.3f%%, aligner (on the reference's ViT) %.3f%%, tower end to end "
              "%.3f%% (the reference's fp32 tower moves the ViT %.3f%%)\n",
              GetParam().c_str(), 100 * vit_err, 100 * aligner_err, 100 * tower_err, 100 * self_vit);
  EXPECT_LE(vit_err, 0.015);
  EXPECT_LE(aligner_err, 0.015);
  EXPECT_LE(tower_err, 0.015);

  // The span rows: image_start, each grid row's aligner rows and image_newline, image_end; the
  // reference's merged embeddings hold exactly those rows over the span (golden prompt embeddings).
  const std::vector<float> span = t.span_rows(want_aligner.data(), grid());
  const int64_t d = model_->config().dim;
  ASSERT_EQ(static_cast<int64_t>(span.size()), grid().span_length(3) * d);
  for (const auto& [name, p] : (*meta_)["prompts"].items()) {
    const std::vector<float> merged = read_array<float>(*dir_ + "/" + p["embeddings"]["file"].get<std::string>());
    for (const auto& s : p["image_spans"]) {
      if (s["image"].get<std::string>() != GetParam()) continue;
      const int64_t start = s["start"].get<int64_t>();
      const std::vector<float> want(merged.begin() + start * d, merged.begin() + start * d + static_cast<int64_t>(span.size()));
      EXPECT_EQ(span, want) << "prompt " << name << ", span at " << start;
    }
  }
}

std::string image_name(const ::testing::TestParamInfo<std::string>& info_) { return info_.param; }
INSTANTIATE_TEST_SUITE_P(Reference, GoldenVisionTower, ::testing::Values("a", "b", "c"), image_name);

}  // namespace
}  // namespace dsv41
