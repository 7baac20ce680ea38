// The language model with image spans against the official reference on tiny-vision (its README):
// the reference's merged input embeddings (image_start, the aligner rows, image_newline, image_end
// written over each span) go in through ForwardOptions::spans, bypassing the vision tower, and
// what comes out — every prefill logit row, the residual stream after every block, the greedy
// decode after the prompt — is compared with the reference's. This is the span path of vision-spec
// §6: bias_vl selects the experts of span tokens (in every backbone layer it changes the chosen pair
// at nearly every span position), span tokens are DEAD for Engram (gate 0, a wall for the n-grams
// after them, kept in the history a decode step reads: prompt p3 ends one token after its image).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "golden_util.h"
#include "model/model.h"
#include "model/vision_tower.h"
#include "test_util.h"
#include "util/error.h"

namespace dsv41 {
namespace {

using test::Agreement;
using test::compare_rows;
using test::read_array;

struct VisionPrompt {
  std::vector<int32_t> ids;
  std::shared_ptr<SpanEmbeddings> spans;
  nlohmann::json meta;
};

VisionPrompt load_prompt(const std::string& dir, const nlohmann::json& meta, const std::string& name, int64_t dim) {
  VisionPrompt p;
  p.meta = meta["prompts"][name];
  p.ids = p.meta["input_ids"].get<std::vector<int32_t>>();
  const std::vector<int> types = p.meta["token_types"].get<std::vector<int>>();
  const std::vector<float> merged = read_array<float>(dir + "/" + p.meta["embeddings"]["file"].get<std::string>());
  p.spans = std::make_shared<SpanEmbeddings>();
  for (size_t i = 0; i < types.size(); ++i) {
    const bool span = types[i] >= 0;  // START, IMAGE, NEW_LINE, END alike (vision-spec §6.2)
    p.spans->mask.push_back(span ? 1 : 0);
    if (span) p.spans->rows.insert(p.spans->rows.end(), merged.begin() + i * dim, merged.begin() + (i + 1) * dim);
  }
  return p;
}

class GoldenVisionText : public ::testing::TestWithParam<std::string> {
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
  VisionPrompt prompt() const { return load_prompt(*dir_, *meta_, GetParam(), model_->config().dim); }
  std::vector<float> golden(const VisionPrompt& p, const char* what) const {
    return read_array<float>(*dir_ + "/" + p.meta[what]["file"].get<std::string>());
  }
  static std::string* dir_;
  static nlohmann::json* meta_;
  static Model* model_;
};
std::string* GoldenVisionText::dir_ = nullptr;
nlohmann::json* GoldenVisionText::meta_ = nullptr;
Model* GoldenVisionText::model_ = nullptr;

void report(const std::string& what, const Agreement& g) {
  std::printf("[golden] %-32s rel L2 %.2e  median max|d| %.2e  worst %.2e  argmax %.1f%%  identical rows %lld of %lld\n",
              what.c_str(), g.rel_l2, g.median_max_abs, g.worst_max_abs, 100 * g.argmax,
              static_cast<long long>(g.identical_rows), static_cast<long long>(g.rows));
}

TEST_P(GoldenVisionText, PrefillAndBlocksAreTheReferences) {
  const VisionPrompt p = prompt();
  SequenceState st = model_->new_sequence(test::pools_for(*model_));
  ForwardOptions opt;
  opt.spans = p.spans;
  opt.all_logits = true;
  opt.capture_blocks = true;
  const ForwardResult r = model_->forward(st, p.ids, opt);
  const Agreement logits = compare_rows(r.logits, golden(p, "prefill_all_positions"), model_->config().vocab_size);
  report(GetParam() + " prefill, all positions", logits);
  EXPECT_EQ(logits.identical_rows, logits.rows);
  const std::vector<float> blocks = golden(p, "block_outputs");
  ASSERT_EQ(r.block_outputs.size(), blocks.size());
  const size_t per_layer = blocks.size() / static_cast<size_t>(model_->config().n_layers);
  const size_t position_values = static_cast<size_t>(model_->config().hc_mult * model_->config().dim);
  for (int layer = 0; layer < model_->config().n_layers; ++layer) {
    int64_t differ = 0, first = -1;
    for (size_t i = layer * per_layer; i < (layer + 1) * per_layer; ++i) {
      if (r.block_outputs[i] == blocks[i]) continue;
      if (differ++ == 0) first = static_cast<int64_t>((i - layer * per_layer) / position_values);
    }
    std::printf("[golden] %s block %d: %lld of %zu values differ (first at position %lld)\n", GetParam().c_str(), layer,
                static_cast<long long>(differ), per_layer, static_cast<long long>(first));
    EXPECT_EQ(differ, 0) << "block " << layer;
  }
}

// The reference's greedy run after the prefill: decode steps carry no images, but Engram's history
// still holds the spans' DEAD marks.
TEST_P(GoldenVisionText, GreedyDecodeAfterTheSpans) {
  const VisionPrompt p = prompt();
  SequenceState st = model_->new_sequence(test::pools_for(*model_));
  ForwardOptions opt;
  opt.spans = p.spans;
  ForwardResult r = model_->forward(st, p.ids, opt);
  const std::vector<int32_t> want = p.meta["greedy"]["tokens"].get<std::vector<int32_t>>();
  std::vector<float> ours;
  int same = 0;
  for (size_t k = 0; k < want.size(); ++k) {
    ours.insert(ours.end(), r.logits.begin(), r.logits.end());
    same += std::max_element(r.logits.begin(), r.logits.end()) - r.logits.begin() == want[k];
    r = model_->forward(st, {want[k]}, {});
  }
  const Agreement g = compare_rows(ours, golden(p, "greedy"), model_->config().vocab_size);
  report(GetParam() + " greedy rows", g);
  EXPECT_EQ(same, static_cast<int>(want.size()));
  // Measured: identical on p1 and p2; on p3 one decode row within 0.01, where the reference's
  // one-token decode takes torch's scalar path with libm's exp and log1p (docs/agreement.md).
  EXPECT_GE(g.identical_rows, g.rows - 1);
  EXPECT_LE(g.worst_max_abs, 0.02);
}

// End to end from the pixels: the reference's patches of each image through dsv41's tower, its span
// rows into the language model, every prefill logit row against the reference's. Reported, and held
// only loosely: the tower is within 0.35% of the reference's bf16 tower (golden_vision_tower_test),
// whose own kernels move it 0.3-0.7%, and this tiny random model amplifies that noise about 13-14 times
// (docs/agreement.md).
TEST_P(GoldenVisionText, EndToEndFromThePatchesIsReported) {
  const VisionPrompt p = prompt();
  const ModelConfig& c = model_->config();
  const VisionTower tower(model_->backend(), *model_->weights().vision, c.vision, c.dim);
  auto spans = std::make_shared<SpanEmbeddings>();
  spans->mask = p.spans->mask;
  for (const auto& s : p.meta["image_spans"]) {
    const nlohmann::json& image = (*meta_)["images"][s["image"].get<std::string>()];
    const std::vector<float> patches = read_array<float>(*dir_ + "/" + image["patches"]["file"].get<std::string>());
    const std::vector<float> rows =
        tower.embed(patches.data(), {image["n_vit_hw"][0].get<int64_t>(), image["n_vit_hw"][1].get<int64_t>()});
    spans->rows.insert(spans->rows.end(), rows.begin(), rows.end());
  }
  ASSERT_EQ(spans->rows.size(), p.spans->rows.size());
  SequenceState st = model_->new_sequence(test::pools_for(*model_));
  ForwardOptions opt;
  opt.spans = spans;
  opt.all_logits = true;
  const ForwardResult r = model_->forward(st, p.ids, opt);
  const Agreement g = compare_rows(r.logits, golden(p, "prefill_all_positions"), c.vocab_size);
  report(GetParam() + " end to end from patches", g);
  // measured: p3 (image a, whose ViT is the reference's bits) identical; p1 (image c, ViT 0.18% off)
  // 4.6% rel L2 and 86% argmax; p2 (a and b) 2.8% and 99%
  EXPECT_LE(g.rel_l2, 0.10);
  EXPECT_GE(g.argmax, 0.75);
  // the rows before the first image see none of the tower's noise
  EXPECT_GE(g.identical_rows, p.meta["image_spans"][0]["start"].get<int64_t>());
}

std::string prompt_name(const ::testing::TestParamInfo<std::string>& info_) { return info_.param; }
INSTANTIATE_TEST_SUITE_P(Reference, GoldenVisionText, ::testing::Values("p1", "p2", "p3"), prompt_name);

// Span inputs that do not fit the call are refused, naming what is wrong.
TEST(GoldenVisionSpans, InputsThatDoNotFitAreRefused) {
  const std::string dir = test::golden_dir("tiny-vision");
  auto model = load_model(dir);
  const int64_t d = model->config().dim;
  auto run = [&](std::vector<uint8_t> mask, int64_t rows) {
    SequenceState st = model->new_sequence(test::pools_for(*model));
    ForwardOptions opt;
    auto sp = std::make_shared<SpanEmbeddings>();
    sp->mask = std::move(mask);
    sp->rows.assign(static_cast<size_t>(rows * d), 0.25f);
    opt.spans = sp;
    model->forward(st, {0, 5, 7, 9}, opt);
  };
  EXPECT_NO_THROW(run({0, 1, 1, 0}, 2));
  EXPECT_THROW(run({0, 1, 1}, 2), Error);     // a mask for 3 of 4 tokens
  EXPECT_THROW(run({0, 1, 1, 0}, 1), Error);  // rows for 1 of 2 span positions
  // a text-only checkpoint has no bias_vl to select a span token's experts with
  auto text_only = load_model(test::golden_dir("tiny-dense"));
  SequenceState st = text_only->new_sequence(test::pools_for(*text_only));
  ForwardOptions opt;
  auto sp = std::make_shared<SpanEmbeddings>();
  sp->mask = {0, 1};
  sp->rows.assign(static_cast<size_t>(d), 0.25f);
  opt.spans = sp;
  EXPECT_THROW(text_only->forward(st, {0, 5}, opt), Error);
  EXPECT_EQ(st.length(), 0);  // refused before anything moved: the sequence goes on as before
  EXPECT_NO_THROW(text_only->forward(st, {0, 5}, {}));
}

}  // namespace
}  // namespace dsv41
