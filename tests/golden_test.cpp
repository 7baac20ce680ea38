// Agreement with DeepSeek's official reference on the two golden checkpoints (tests/golden/README.md).
// The comparison is statistical where the README says summation order legitimately moves tiny random
// models (logits, streams), and exact up to ties where it is not (index selection).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "golden_util.h"
#include "model/model.h"
#include "test_util.h"

namespace dsv41 {
namespace {

using test::Agreement;
using test::compare_rows;
using test::Golden;

// Thresholds. The golden README: an equally correct kernel that sums the FP8/FP4 blocks in another
// order moved the reference's own logits by a median 0.04 (worst 0.11) per row and flipped 3% of
// argmaxes; a semantic error moves them by about the logits' size (std ~1), argmax at chance.
// Measured here (docs/agreement.md), with the reference's summation order for the means of squares:
// relative L2 0.35%, median per-row max |Δ| 0.000 (most rows bit-identical), argmax 99.3%. What
// still differs starts at single rounding events (golden_blocks_test.cpp counts them block by block)
// and spreads from there. So: relative L2 ≤ 1%, median per-row max |Δ| ≤ 0.01, argmax ≥ 98% (with
// at most one flip allowed on sets of fewer than fifty rows).
void expect_agreement(const Agreement& g, int64_t rows, const std::string& what) {
  std::printf("[golden] %-34s rel L2 %.4f  median max|d| %.4f  worst %.4f  argmax %.1f%%\n", what.c_str(), g.rel_l2,
              g.median_max_abs, g.worst_max_abs, 100 * g.argmax);
  EXPECT_LE(g.rel_l2, 0.01) << what;
  EXPECT_LE(g.median_max_abs, 0.01) << what;
  const double min_argmax = rows < 50 ? static_cast<double>(rows - 1) / static_cast<double>(rows) : 0.98;
  EXPECT_GE(g.argmax, min_argmax - 1e-9) << what;
}

class GoldenDense : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { model_ = load_model(test::golden_dir("tiny-dense")).release(); }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  static Model* model_;
};
Model* GoldenDense::model_ = nullptr;

TEST_F(GoldenDense, PrefillAllPositions) {
  Golden g("tiny-dense");
  SequenceState st = model_->new_sequence(test::pools_for(*model_));
  ForwardOptions opt;
  opt.all_logits = true;
  ForwardResult r = model_->forward(st, g.ids, opt);
  expect_agreement(compare_rows(r.logits, g.f32("golden_prefill_all_positions.f32"), 512), 152, "tiny-dense prefill, all positions");
}

TEST_F(GoldenDense, BlockOutputsLocateAnyDivergence) {
  Golden g("tiny-dense");
  SequenceState st = model_->new_sequence(test::pools_for(*model_));
  ForwardOptions opt;
  opt.capture_blocks = true;
  ForwardResult r = model_->forward(st, g.ids, opt);
  std::vector<float> ref = g.f32("golden_block_outputs.f32");
  const size_t per_layer = ref.size() / 6;
  for (int layer = 0; layer < 6; ++layer) {
    double num = 0, den = 0;
    for (size_t i = layer * per_layer; i < (layer + 1) * per_layer; ++i) {
      double d = r.block_outputs[i] - ref[i];
      num += d * d;
      den += static_cast<double>(ref[i]) * ref[i];
    }
    const double rel = std::sqrt(num / den);
    std::printf("[golden] block %d output: rel L2 %.5f\n", layer, rel);
    // Rounding events spread through the stream (measured 0.34% by the last block); a semantic error
    // shows as a jump to tens of percent at the first wrong block.
    EXPECT_LE(rel, 0.01) << "the residual stream first diverges after block " << layer;
  }
}

TEST_F(GoldenDense, PrefillLastAtEveryListedLength) {
  Golden g("tiny-dense");
  std::vector<float> ours;
  for (int len : g.meta["prefill_last"]["prompt_lengths"].get<std::vector<int>>()) {
    SequenceState st = model_->new_sequence(test::pools_for(*model_));
    ForwardResult r = model_->forward(st, std::vector<int32_t>(g.ids.begin(), g.ids.begin() + len), {});
    ours.insert(ours.end(), r.logits.begin(), r.logits.end());
  }
  expect_agreement(compare_rows(ours, g.f32("golden_prefill_last.f32"), 512), 9, "tiny-dense prefill, last rows");
}

TEST_F(GoldenDense, DecodeAfterPrefill) {
  Golden g("tiny-dense");
  const int prefill = g.meta["decode_teacher"]["prefill"];
  SequenceState st = model_->new_sequence(test::pools_for(*model_));
  ForwardResult r = model_->forward(st, std::vector<int32_t>(g.ids.begin(), g.ids.begin() + prefill), {});
  std::vector<float> ours = r.logits;
  for (int k = 1; k < g.meta["decode_teacher"]["rows"].get<int>(); ++k) {
    ForwardResult step = model_->forward(st, {g.ids[prefill + k - 1]}, {});
    ours.insert(ours.end(), step.logits.begin(), step.logits.end());
  }
  expect_agreement(compare_rows(ours, g.f32("golden_decode_teacher.f32"), 512), 76, "tiny-dense decode rows");
}

TEST_F(GoldenDense, GreedyTokens) {
  Golden g("tiny-dense");
  const int prefill = g.meta["greedy"]["prefill"];
  std::vector<int32_t> want = g.meta["greedy"]["tokens"].get<std::vector<int32_t>>();
  SequenceState st = model_->new_sequence(test::pools_for(*model_));
  ForwardResult r = model_->forward(st, std::vector<int32_t>(g.ids.begin(), g.ids.begin() + prefill), {});
  std::vector<float> ours;
  std::vector<int32_t> got;
  for (size_t k = 0; k < want.size(); ++k) {
    ours.insert(ours.end(), r.logits.begin(), r.logits.end());
    int32_t next = static_cast<int32_t>(std::max_element(r.logits.begin(), r.logits.end()) - r.logits.begin());
    got.push_back(next);
    // teacher-force the reference's token so one early flip does not derail the comparison
    r = model_->forward(st, {want[k]}, {});
  }
  int same = 0;
  for (size_t k = 0; k < want.size(); ++k) same += got[k] == want[k];
  std::printf("[golden] tiny-dense greedy tokens: %d of %zu equal\n", same, want.size());
  EXPECT_GE(same, static_cast<int>(want.size()) - 1);  // measured: every one
  expect_agreement(compare_rows(ours, g.f32("golden_greedy_logits.f32"), 512), 25, "tiny-dense greedy rows");
}

// The indexer's scores, selections and candidate pools are checked under teacher forcing, where
// every query's inputs are the reference's (golden_blocks_test.cpp).

// The two index-key modes on tiny-sparse's decode rows (model-spec §7 item 11). Selection ties make
// tiny-sparse's logits diverge from any other implementation quickly (the reference's own decode and
// prefill agree on only 79% of argmaxes there), so the check is relative: each of our modes must be
// closer to the golden rows made in the same mode than to those made in the other.
TEST(GoldenSparse, IndexKeyModesMatchTheirGoldenDecodeRows) {
  Golden g("tiny-sparse");
  auto model = load_model(g.dir);
  const int prefill = g.meta["decode_teacher"]["prefill"], rows = g.meta["decode_teacher"]["rows"];
  auto decode = [&](IndexKeysMode mode) {
    ForwardOptions opt;
    opt.index_keys = mode;
    SequenceState st = model->new_sequence(test::pools_for(*model));
    ForwardResult r = model->forward(st, std::vector<int32_t>(g.ids.begin(), g.ids.begin() + prefill), opt);
    std::vector<float> out = r.logits;
    for (int k = 1; k < rows; ++k) {
      ForwardResult step = model->forward(st, {g.ids[prefill + k - 1]}, opt);
      out.insert(out.end(), step.logits.begin(), step.logits.end());
    }
    return out;
  };
  std::vector<float> owner = decode(IndexKeysMode::Owner), reference = decode(IndexKeysMode::Reference);
  std::vector<float> gold_owner = g.f32("golden_decode_teacher.f32");
  std::vector<float> gold_reference = g.f32(g.meta["reference_keys_decode"]["decode_teacher_file"]);
  Agreement oo = compare_rows(owner, gold_owner, 512), or_ = compare_rows(owner, gold_reference, 512);
  Agreement rr = compare_rows(reference, gold_reference, 512), ro = compare_rows(reference, gold_owner, 512);
  std::printf("[golden] tiny-sparse decode, owner keys:     rel L2 %.3f vs owner goldens, %.3f vs reference-key goldens\n",
              oo.rel_l2, or_.rel_l2);
  std::printf("[golden] tiny-sparse decode, reference keys: rel L2 %.3f vs reference-key goldens, %.3f vs owner goldens\n",
              rr.rel_l2, ro.rel_l2);
  EXPECT_LT(oo.rel_l2, or_.rel_l2);
  EXPECT_LT(rr.rel_l2, ro.rel_l2);
  EXPECT_NE(owner, reference);  // the modes really differ once a ratio-2 source has more than k rows
}

}  // namespace
}  // namespace dsv41
