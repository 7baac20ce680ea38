// The DSpark drafter against the official reference's forward_spec on tiny-dense and tiny-sparse
// (golden README): at each greedy step the drafter's block logits (Markov bias included), drafted ids
// and confidence.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "golden_util.h"
#include "model/dspark.h"
#include "numeric/formats.h"
#include "runtime/sampler.h"
#include "test_util.h"

namespace dsv41 {
namespace {

using test::read_array;  // golden_util.h: it also names a file it cannot open

// A forward that returns the drafter's inputs.
ForwardOptions with_taps() {
  ForwardOptions o;
  o.dspark_taps = true;
  o.topk_ties = TopkTies::Torch;
  return o;
}

class GoldenDspark : public ::testing::TestWithParam<std::string> {};

// Both sets: on tiny-sparse the target's forwards pick the reference's rows among tied index scores
// (TopkTies::Torch), so the drafter's taps are the reference's there too.
TEST_P(GoldenDspark, DrafterMatchesTheReferenceAtEveryGreedyStep) {
  const std::string dir = test::golden_dir(GetParam());
  std::ifstream in(dir + "/golden.json");
  const nlohmann::json meta = nlohmann::json::parse(in);
  const std::vector<int32_t> ids = meta["input_ids"];
  const std::vector<int32_t> tokens = meta["greedy"]["tokens"];
  const int prefill = meta["greedy"]["prefill"];
  const auto drafts = meta["dspark"]["draft_ids"].get<std::vector<std::vector<int32_t>>>();
  const std::vector<float> ref_logits = read_array<float>(dir + "/" + meta["dspark"]["logits_file"].get<std::string>());
  const std::vector<float> ref_conf = read_array<float>(dir + "/" + meta["dspark"]["confidence_file"].get<std::string>());

  auto model = load_model(dir);
  Drafter drafter(*model);
  const int64_t V = model->config().vocab_size, B = drafter.block_size();
  SequenceState st = model->new_sequence(test::pools_for(*model));
  ForwardResult r = model->forward(st, std::vector<int32_t>(ids.begin(), ids.begin() + prefill), with_taps());
  drafter.observe(st, r.dspark_taps, 0, 0, prefill);
  Sampler greedy(SamplingParams{});
  double num = 0, den = 0, conf_err = 0;
  int same_ids = 0, total_ids = 0, same_argmax = 0;
  for (size_t k = 1; k <= drafts.size(); ++k) {
    // the target decodes tokens[k-1] (teacher-forced, as the goldens' greedy run) and produced tokens[k]
    ForwardResult step = model->forward(st, {tokens[k - 1]}, with_taps());
    drafter.observe(st, step.dspark_taps, 0, st.length() - 1, 1);
    Draft d = drafter.draft(st, tokens[k], greedy);
    const float* ref = &ref_logits[(k - 1) * B * V];
    for (int64_t i = 0; i < B; ++i) {
      for (int64_t v = 0; v < V; ++v) {
        const double diff = d.logits[i * V + v] - ref[i * V + v];
        num += diff * diff;
        den += static_cast<double>(ref[i * V + v]) * ref[i * V + v];
      }
      same_argmax += std::max_element(&d.logits[i * V], &d.logits[i * V] + V) - &d.logits[i * V] ==
                     std::max_element(ref + i * V, ref + (i + 1) * V) - (ref + i * V);
      conf_err = std::max(conf_err, std::fabs(static_cast<double>(d.confidence[i]) - ref_conf[(k - 1) * B + i]));
      same_ids += d.tokens[i] == drafts[k - 1][i + 1];
      ++total_ids;
    }
  }
  const double rel = std::sqrt(num / den);
  std::printf("[golden] %s DSpark: rel L2 of block logits %.2e, argmax %d/%d, drafted ids %d/%d, max |confidence diff| "
              "%.2e\n",
              GetParam().c_str(), rel, same_argmax, total_ids, same_ids, total_ids, conf_err);
  // The drafter sees the target only through its taps, the tapped layers' input streams, which are
  // bit-identical to the reference's (golden_blocks_test.cpp); its own arithmetic is the reference's
  // too, so every logit, drafted id and confidence is the reference's, bit for bit. (A semantic error
  // would be the size of the logits, relative L2 ~1, argmax at chance.)
  EXPECT_EQ(num, 0.0) << "relative L2 " << rel;
  EXPECT_EQ(same_argmax, total_ids);
  EXPECT_EQ(same_ids, total_ids);
  EXPECT_EQ(conf_err, 0.0);
}

std::string set_name(const ::testing::TestParamInfo<std::string>& set) {
  return set.param == "tiny-dense" ? "TinyDense" : "TinySparse";
}
INSTANTIATE_TEST_SUITE_P(Reference, GoldenDspark, ::testing::Values("tiny-dense", "tiny-sparse"), set_name);

// The same first draft with the rings seeded from the reference's own streams (the golden block
// outputs give the tapped layers' inputs at every prompt position): the drafter's remaining error.
TEST(GoldenDspark, FirstDraftFromTheReferenceTaps) {
  const std::string dir = test::golden_dir("tiny-dense");
  std::ifstream in(dir + "/golden.json");
  const nlohmann::json meta = nlohmann::json::parse(in);
  const std::vector<int32_t> ids = meta["input_ids"];
  const std::vector<int32_t> tokens = meta["greedy"]["tokens"];
  const int prefill = meta["greedy"]["prefill"];
  auto model = load_model(dir);
  const ModelConfig& c = model->config();
  Drafter drafter(*model);
  const int64_t V = c.vocab_size, B = drafter.block_size(), d = c.dim, hc = c.hc_mult;
  const std::vector<float> blocks = read_array<float>(dir + "/golden_block_outputs.f32");
  const int64_t n_taps = static_cast<int64_t>(c.dspark_target_layer_ids.size());
  std::vector<float> taps(static_cast<size_t>(prefill * n_taps * d));
  for (int64_t p = 0; p < prefill; ++p) {
    for (int64_t t = 0; t < n_taps; ++t) {
      const int64_t block = c.dspark_target_layer_ids[t] - 1;  // a layer's input is the previous block's output
      for (int64_t j = 0; j < d; ++j) {
        float acc = 0;
        for (int64_t cp = 0; cp < hc; ++cp) acc += blocks[static_cast<size_t>(((block * 152 + p) * hc + cp) * d + j)];
        taps[(p * n_taps + t) * d + j] = round_bf16(acc / static_cast<float>(hc));
      }
    }
  }
  SequenceState st = model->new_sequence(test::pools_for(*model));
  model->forward(st, std::vector<int32_t>(ids.begin(), ids.begin() + prefill), with_taps());
  drafter.observe(st, taps, 0, 0, prefill);
  ForwardResult step = model->forward(st, {tokens[0]}, with_taps());
  drafter.observe(st, step.dspark_taps, 0, prefill, 1);
  Sampler greedy(SamplingParams{});
  Draft dr = drafter.draft(st, tokens[1], greedy);
  const std::vector<float> ref = read_array<float>(dir + "/" + meta["dspark"]["logits_file"].get<std::string>());
  const std::vector<float> conf = read_array<float>(dir + "/" + meta["dspark"]["confidence_file"].get<std::string>());
  double num = 0, den = 0;
  for (int64_t i = 0; i < B * V; ++i) {
    num += (dr.logits[i] - ref[i]) * (dr.logits[i] - ref[i]);
    den += static_cast<double>(ref[i]) * ref[i];
  }
  std::printf("[golden] DSpark first draft from reference taps: rel L2 %.2e, confidence %.9g vs %.9g\n",
              std::sqrt(num / den), dr.confidence[0], conf[0]);
  // one ring row (position 76) is still ours, and equal to the reference's too
  EXPECT_EQ(num, 0.0) << "relative L2 " << std::sqrt(num / den);
  EXPECT_EQ(dr.confidence[0], conf[0]);
}

}  // namespace
}  // namespace dsv41
