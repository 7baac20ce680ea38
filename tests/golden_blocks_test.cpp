// Teacher-forced agreement with the official reference, block by block (tests/golden/README.md):
// every block runs on the reference's own input stream (the previous block's golden output; block
// 0 on the embedding) and attends over the rows the reference selected, so what differs in a block's
// output is the block's own arithmetic, not carried in from upstream or from a tie broken another
// way. With equal inputs a value either equals the reference's bit for bit or differs by a rounding
// event: one fp32 result, computed in another order or by another libm, on the other side of a
// bf16, e4m3 or e2m1 rounding boundary. An event in a position's own path stays in that position;
// one in a window KV row reaches the positions whose window holds it (up to `window` of them), and
// one in a compressed row or index key every later position that reads it. A semantic error changes
// almost every value of almost every position. With the reference's own orders and exp there are no
// events left on these sets, and each block is held to that.
//
// The indexer's own choices are checked on the way: its selections must equal the reference's as
// sets except among entries tied with the k-th score (torch.topk breaks ties in no specified order),
// likewise the candidate pools, and its scores must equal the reference's bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "golden_util.h"
#include "io/layer_roles.h"
#include "model/model.h"
#include "test_util.h"
#include "util/error.h"

namespace dsv41 {
namespace {

using test::Golden;
using test::read_array;

struct BlockDiff {
  int64_t values = 0;     // values of the block's output that differ from the reference's
  int64_t positions = 0;  // positions with at least one
  int64_t first = -1;     // the first such position
  double max_abs = 0;
};

struct IndexDiff {
  int64_t score_mismatches = 0;  // scores that are not bit-identical
  int64_t score_queries = 0;     // queries with at least one
  int64_t set_mismatches = 0;    // queries whose selection differs beyond ties (from their own scores)
  int64_t pool_mismatches = 0;   // queries whose candidate pool differs beyond ties
  int64_t ties_broken_otherwise = 0;
};

struct TeacherForced {
  std::vector<BlockDiff> blocks;
  std::map<int, IndexDiff> index;  // by index-source layer
};

// The ids of a [k] selection, without -1 and without those scoring `kth` in `scores` (if given).
std::set<int32_t> selected_set(const int32_t* sel, int64_t k, const float* scores, const float* kth) {
  std::set<int32_t> s;
  for (int64_t j = 0; j < k; ++j) {
    if (sel[j] < 0 || (kth != nullptr && scores[sel[j]] == *kth)) continue;
    s.insert(sel[j]);
  }
  return s;
}

TeacherForced teacher_forced(const Golden& g) {
  auto model = load_model(g.dir);
  const ModelConfig& c = model->config();
  const int64_t count = static_cast<int64_t>(g.ids.size()), width = c.hc_mult * c.dim;
  auto teacher = std::make_shared<TeacherForcing>();
  teacher->streams = g.f32(g.meta["block_outputs"]["file"]);
  EXPECT_EQ(static_cast<int64_t>(teacher->streams.size()), c.n_layers * count * width);
  const auto& layers = g.meta["index_selection"]["layers"];
  for (auto& [key, info] : layers.items()) {
    const int layer = std::stoi(key);
    teacher->selections[layer] = read_array<int32_t>(g.dir + "/" + info["selected_file"].get<std::string>());
    if (info.contains("candidates_file"))
      teacher->pools[layer] = read_array<uint8_t>(g.dir + "/" + info["candidates_file"].get<std::string>());
  }
  SequenceState st = model->new_sequence(test::pools_for(*model));
  ForwardOptions opt;
  opt.capture_blocks = true;
  opt.capture_index = true;
  opt.teacher = teacher;
  opt.topk_ties = TopkTies::Torch;  // so the engine's own selections can equal the reference's, ties included
  const ForwardResult r = model->forward(st, g.ids, opt);
  const std::string name = g.dir.substr(g.dir.rfind('/') + 1);
  TeacherForced out;

  for (auto& [key, info] : layers.items()) {
    const int layer = std::stoi(key);
    const IndexCapture& cap = r.index[static_cast<size_t>(layer)];
    const std::vector<float> ref_scores = g.f32(info["scores_file"]);
    const std::vector<int32_t>& ref_sel = teacher->selections[layer];
    const int64_t n = info["scores_shape"][1], k = info["selected_shape"][1];
    EXPECT_EQ(cap.n_keys, n) << layer;
    EXPECT_EQ(cap.k, k) << layer;
    if (cap.n_keys != n || cap.k != k) continue;
    IndexDiff& d = out.index[layer];
    for (int64_t q = 0; q < count; ++q) {
      const float* ours = &cap.scores[static_cast<size_t>(q * n)];
      const float* theirs = &ref_scores[static_cast<size_t>(q * n)];
      int64_t here = 0;
      for (int64_t t = 0; t < n; ++t) here += !(ours[t] == theirs[t]);
      d.score_mismatches += here;
      d.score_queries += here > 0;
      // our selection from our scores against theirs from theirs, each ignoring its own k-th ties
      auto kth_of = [&](const float* row) {
        std::vector<float> sorted(row, row + n);
        std::sort(sorted.begin(), sorted.end(), std::greater<>());
        return sorted[static_cast<size_t>(k - 1)];
      };
      const float our_kth = kth_of(ours), their_kth = kth_of(theirs);
      const int32_t* a = &cap.selected[static_cast<size_t>(q * k)];
      const int32_t* b = &ref_sel[static_cast<size_t>(q * k)];
      const bool untied_same = selected_set(a, k, ours, &our_kth) == selected_set(b, k, theirs, &their_kth);
      d.set_mismatches += !untied_same;
      const bool raw_same = selected_set(a, k, ours, nullptr) == selected_set(b, k, theirs, nullptr);
      d.ties_broken_otherwise += untied_same && !raw_same;
    }
    if (info.contains("candidates_file")) {
      const std::vector<uint8_t>& ref_cand = teacher->pools[layer];
      const int64_t bs = c.candidate_block_size, ratio = c.compress_ratios[static_cast<size_t>(layer)];
      const int64_t blocks = (n + bs - 1) / bs;
      for (int64_t q = 0; q < count; ++q) {
        const float* ours = &cap.scores[static_cast<size_t>(q * n)];
        std::vector<float> block_score(static_cast<size_t>(blocks), -INFINITY);
        for (int64_t t = 0; t < n; ++t) block_score[t / bs] = std::max(block_score[t / bs], ours[t]);
        const int64_t visible = (q + 1) / ratio;
        if (visible > 0) block_score[(visible - 1) / bs] = INFINITY;  // the newest block is pinned
        float weakest = INFINITY;  // a block tied with the weakest one we kept may go either way
        for (int64_t b = 0; b < blocks; ++b)
          if (cap.candidates[static_cast<size_t>(q * n + b * bs)]) weakest = std::min(weakest, block_score[b]);
        bool raw_same = true, untied_same = true;
        for (int64_t b = 0; b < blocks; ++b) {
          const size_t i = static_cast<size_t>(q * n + b * bs);
          if (cap.candidates[i] == ref_cand[i]) continue;
          raw_same = false;
          untied_same = untied_same && block_score[b] == weakest;
        }
        d.pool_mismatches += !untied_same;
        d.ties_broken_otherwise += untied_same && !raw_same;
      }
    }
    std::printf("[golden] %s indexer layer %d, teacher-forced: %lld of %lld scores differ (%lld queries); %lld "
                "selections and %lld pools differ beyond ties; %lld ties broken otherwise\n",
                name.c_str(), layer, static_cast<long long>(d.score_mismatches), static_cast<long long>(count * n),
                static_cast<long long>(d.score_queries), static_cast<long long>(d.set_mismatches),
                static_cast<long long>(d.pool_mismatches), static_cast<long long>(d.ties_broken_otherwise));
  }

  out.blocks.resize(static_cast<size_t>(c.n_layers));
  for (int64_t layer = 0; layer < c.n_layers; ++layer) {
    BlockDiff& b = out.blocks[static_cast<size_t>(layer)];
    for (int64_t p = 0; p < count; ++p) {
      int64_t here = 0;
      for (int64_t j = 0; j < width; ++j) {
        const size_t i = static_cast<size_t>((layer * count + p) * width + j);
        const float ours = r.block_outputs[i], theirs = teacher->streams[i];
        if (ours == theirs) continue;
        ++here;
        b.max_abs = std::max(b.max_abs, std::fabs(static_cast<double>(ours) - theirs));
      }
      b.values += here;
      if (here > 0 && b.positions++ == 0) b.first = p;
    }
    std::printf("[golden] %s block %lld, teacher-forced: %lld of %lld values differ, at %lld of %lld positions "
                "(first %lld), max |d| %.3g\n",
                name.c_str(), static_cast<long long>(layer), static_cast<long long>(b.values),
                static_cast<long long>(count * width), static_cast<long long>(b.positions),
                static_cast<long long>(count), static_cast<long long>(b.first), b.max_abs);
  }
  return out;
}

// Measured (docs/agreement.md), with torch's summation order (cascade_sum.h) and torch's exp
// (torch_math.h): every value of every block and every index score equal to the reference's, on both
// sets. So that is what is asserted; a failure prints how many values and positions differ, which
// tells a rounding event (a few values at a few positions) from a semantic error (almost all).
void expect_identical(const TeacherForced& t) {
  for (const auto& [layer, d] : t.index) {
    EXPECT_EQ(d.score_mismatches, 0) << "indexer layer " << layer;
    EXPECT_EQ(d.set_mismatches, 0) << "indexer layer " << layer;
    EXPECT_EQ(d.pool_mismatches, 0) << "indexer layer " << layer;
    EXPECT_EQ(d.ties_broken_otherwise, 0) << "indexer layer " << layer;
  }
  for (size_t layer = 0; layer < t.blocks.size(); ++layer)
    EXPECT_EQ(t.blocks[layer].values, 0) << "block " << layer << ": " << t.blocks[layer].positions << " positions";
}

TEST(GoldenBlocks, TinyDenseEachBlockOnTheReferenceInput) {
  expect_identical(teacher_forced(Golden("tiny-dense")));
}

TEST(GoldenBlocks, TinySparseEachBlockOnTheReferenceInput) {
  expect_identical(teacher_forced(Golden("tiny-sparse")));
}

// Teacher forcing refuses what it cannot apply, naming it, instead of reading out of bounds.
TEST(GoldenBlocks, TeacherForcingRejectsInputsThatDoNotFit) {
  const Golden g("tiny-dense");
  auto model = load_model(g.dir);
  const std::vector<int32_t> ids(g.ids.begin(), g.ids.begin() + 20);
  auto run = [&](const TeacherForcing& t, int64_t tail_start) {
    SequenceState st = model->new_sequence(test::pools_for(*model));
    ForwardOptions opt;
    opt.teacher = std::make_shared<TeacherForcing>(t);
    opt.tail_start = tail_start;
    model->forward(st, ids, opt);
  };
  const ModelConfig& c = model->config();
  TeacherForcing streams;
  streams.streams.assign(static_cast<size_t>(c.n_layers * 20 * c.hc_mult * c.dim), 0.0f);
  EXPECT_NO_THROW(run(streams, -1));
  streams.streams.pop_back();
  EXPECT_THROW(run(streams, -1), Error);  // not [n_layers, count, hc, dim]
  EXPECT_THROW(run(TeacherForcing{}, 10), Error);  // tail mode
  TeacherForcing selection;
  const int64_t k = std::min<int64_t>(c.index_topk, 20 / c.compress_ratios[1]);
  selection.selections[1].assign(static_cast<size_t>(20 * k), -1);
  EXPECT_NO_THROW(run(selection, -1));
  selection.selections[1][5 * k] = 9;  // query 5 of a ratio-2 layer sees rows 0..2 only
  EXPECT_THROW(run(selection, -1), Error);
  selection.selections[1].pop_back();
  EXPECT_THROW(run(selection, -1), Error);  // not [count, k]
}

}  // namespace
}  // namespace dsv41
