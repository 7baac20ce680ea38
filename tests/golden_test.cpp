// Agreement with DeepSeek's official reference on the two golden checkpoints (tests/golden/README.md).
// The comparison is statistical where the README says summation order legitimately moves tiny random
// models (logits, streams), and exact up to ties where it is not (index selection).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "model/model.h"
#include "test_util.h"

namespace dsv41 {
namespace {

using nlohmann::json;

template <typename T>
std::vector<T> read_array(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::vector<T> v(static_cast<size_t>(in.tellg()) / sizeof(T));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  return v;
}

struct Golden {
  std::string dir;
  json meta;
  std::vector<int32_t> ids;
  explicit Golden(const std::string& name) : dir(test::golden_dir(name)) {
    std::ifstream in(dir + "/golden.json");
    meta = json::parse(in);
    ids = meta["input_ids"].get<std::vector<int32_t>>();
  }
  std::vector<float> f32(const std::string& file) const { return read_array<float>(dir + "/" + file); }
};

// How far our logits rows are from the reference's.
struct Agreement {
  double rel_l2 = 0, median_max_abs = 0, worst_max_abs = 0, argmax = 0;
};

Agreement compare_rows(const std::vector<float>& ours, const std::vector<float>& ref, int64_t vocab) {
  const int64_t rows = static_cast<int64_t>(ref.size()) / vocab;
  double num = 0, den = 0;
  int same = 0;
  std::vector<double> max_abs;
  for (int64_t r = 0; r < rows; ++r) {
    double m = 0;
    for (int64_t j = 0; j < vocab; ++j) {
      double d = ours[r * vocab + j] - ref[r * vocab + j];
      num += d * d;
      den += static_cast<double>(ref[r * vocab + j]) * ref[r * vocab + j];
      m = std::max(m, std::fabs(d));
    }
    max_abs.push_back(m);
    auto a = std::max_element(&ours[r * vocab], &ours[r * vocab] + vocab) - &ours[r * vocab];
    auto b = std::max_element(&ref[r * vocab], &ref[r * vocab] + vocab) - &ref[r * vocab];
    same += a == b;
  }
  Agreement g;
  g.rel_l2 = std::sqrt(num / den);
  std::sort(max_abs.begin(), max_abs.end());
  g.median_max_abs = max_abs[max_abs.size() / 2];
  g.worst_max_abs = max_abs.back();
  g.argmax = static_cast<double>(same) / static_cast<double>(rows);
  return g;
}

// Thresholds. The golden README: an equally correct kernel that sums the FP8/FP4 blocks in another
// order moved the reference's own logits by a median 0.04 (worst 0.11) per row and flipped 3% of
// argmaxes; a semantic error moves them by about the logits' size (std ~1), argmax at chance.
// Measured here (docs/agreement.md): relative L2 about 2%, median per-row max |Δ| about 0.06, argmax
// 95%. Our stream is bit-identical to the reference's until a single fp32 reduction (torch's
// vectorised sums vs ours) flips one bf16 or e4m3 rounding, which then spreads (block outputs show it
// position by position). So: relative L2 ≤ 5%, median per-row max |Δ| ≤ 0.08, argmax ≥ 90% (with at
// most one flip allowed on sets of fewer than ten rows).
void expect_agreement(const Agreement& g, int64_t rows, const std::string& what) {
  std::printf("[golden] %-34s rel L2 %.4f  median max|d| %.4f  worst %.4f  argmax %.1f%%\n", what.c_str(), g.rel_l2,
              g.median_max_abs, g.worst_max_abs, 100 * g.argmax);
  EXPECT_LE(g.rel_l2, 0.05) << what;
  EXPECT_LE(g.median_max_abs, 0.08) << what;
  const double min_argmax = rows < 10 ? static_cast<double>(rows - 1) / static_cast<double>(rows) : 0.90;
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
    // Rounding flips spread through the stream (measured up to ~2% by the last block); a semantic
    // error shows as a jump to tens of percent at the first wrong block.
    EXPECT_LE(rel, 0.04) << "the residual stream first diverges after block " << layer;
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
  EXPECT_GE(same, static_cast<int>(want.size() * 9 / 10));
  expect_agreement(compare_rows(ours, g.f32("golden_greedy_logits.f32"), 512), 25, "tiny-dense greedy rows");
}

// Selection on tiny-sparse. A query's scores depend on its layer's input stream at every position up to
// it; where that stream equals the reference's (relative difference ≤ 1e-6 up to the query), scores must
// equal the reference's and the selected sets must be equal except among entries tied with the k-th
// score (ties are broken arbitrarily by torch.topk). Past the first rounding flip upstream, FP4 index
// keys amplify it, so agreement there is reported, not asserted. The same rule for candidate blocks.
TEST(GoldenSparse, IndexerScoresSelectionsAndCandidatePools) {
  Golden g("tiny-sparse");
  auto model = load_model(g.dir);
  SequenceState st = model->new_sequence(test::pools_for(*model));
  ForwardOptions opt;
  opt.capture_index = true;
  opt.capture_blocks = true;
  ForwardResult r = model->forward(st, g.ids, opt);
  std::vector<float> ref_blocks = g.f32("golden_block_outputs.f32");
  const int64_t q = 152, row = 4 * 256;
  for (auto& [layer_key, info] : g.meta["index_selection"]["layers"].items()) {
    const int layer = std::stoi(layer_key);
    // queries whose input stream (block layer-1's output; the embedding for layer 0) matches
    int64_t exact = q;
    for (int64_t p = 0; p < q && layer > 0 && exact == q; ++p) {
      double num = 0, den = 0;
      for (int64_t j = 0; j < row; ++j) {
        const size_t i = static_cast<size_t>(((layer - 1) * q + p) * row + j);
        const double d = r.block_outputs[i] - ref_blocks[i];
        num += d * d;
        den += static_cast<double>(ref_blocks[i]) * ref_blocks[i];
      }
      if (std::sqrt(num / den) > 1e-6) exact = p;
    }
    const IndexCapture& cap = r.index[layer];
    std::vector<float> ref_scores = g.f32(info["scores_file"]);
    std::vector<int32_t> ref_sel = read_array<int32_t>(g.dir + "/" + info["selected_file"].get<std::string>());
    const int64_t n = info["scores_shape"][1], k = info["selected_shape"][1];
    ASSERT_EQ(cap.n_keys, n) << layer;
    ASSERT_EQ(cap.k, k) << layer;
    int64_t score_mismatch[2] = {}, set_mismatch[2] = {};
    for (int64_t i = 0; i < q; ++i) {
      const int region = i < exact ? 0 : 1;
      for (int64_t t = 0; t < n; ++t) {
        const float a = cap.scores[i * n + t], b = ref_scores[i * n + t];
        score_mismatch[region] += !(a == b);
      }
      std::vector<float> ref_row(ref_scores.begin() + i * n, ref_scores.begin() + (i + 1) * n);
      std::vector<float> sorted = ref_row;
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      const float kth = sorted[std::min<int64_t>(k, n) - 1];
      std::set<int32_t> ours, theirs;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t a = cap.selected[i * k + j], b = ref_sel[i * k + j];
        if (a >= 0 && ref_row[a] != kth) ours.insert(a);
        if (b >= 0 && ref_row[b] != kth) theirs.insert(b);
      }
      set_mismatch[region] += ours != theirs;
    }
    std::printf("[golden] tiny-sparse layer %d: %lld queries with a matching input stream: %lld score and %lld "
                "selection mismatches; other %lld queries: %lld score and %lld selection mismatches\n",
                layer, static_cast<long long>(exact), static_cast<long long>(score_mismatch[0]),
                static_cast<long long>(set_mismatch[0]), static_cast<long long>(q - exact),
                static_cast<long long>(score_mismatch[1]), static_cast<long long>(set_mismatch[1]));
    EXPECT_GT(exact, 8) << layer;  // the exact region must hold selections (index_topk = 8)
    EXPECT_EQ(score_mismatch[0], 0) << layer;
    EXPECT_EQ(set_mismatch[0], 0) << layer;
    if (info.contains("candidates_file")) {
      std::vector<uint8_t> ref_cand = read_array<uint8_t>(g.dir + "/" + info["candidates_file"].get<std::string>());
      const int64_t bs = model->config().candidate_block_size, ratio = model->config().compress_ratios[layer];
      int64_t cand_mismatch = 0;
      for (int64_t i = 0; i < exact; ++i) {
        std::vector<float> ref_row(ref_scores.begin() + i * n, ref_scores.begin() + (i + 1) * n);
        const int64_t blocks = (n + bs - 1) / bs, visible = (i + 1) / ratio;
        std::vector<float> bscore(static_cast<size_t>(blocks), -INFINITY);
        for (int64_t t = 0; t < n; ++t) bscore[t / bs] = std::max(bscore[t / bs], ref_row[t]);
        if (visible > 0) bscore[(visible - 1) / bs] = INFINITY;
        float weakest = INFINITY;  // a block tied with the weakest kept block may go either way
        for (int64_t b = 0; b < blocks; ++b)
          if (ref_cand[i * n + b * bs]) weakest = std::min(weakest, bscore[b]);
        for (int64_t b = 0; b < blocks; ++b) {
          if (bscore[b] != weakest) cand_mismatch += cap.candidates[i * n + b * bs] != ref_cand[i * n + b * bs];
        }
      }
      std::printf("[golden] tiny-sparse layer %d: %lld candidate-block mismatches\n", layer,
                  static_cast<long long>(cand_mismatch));
      EXPECT_EQ(cand_mismatch, 0);
    }
  }
}

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
