// The long-context geometry (`make-tiny --preset long`, issue: agent-scale contexts): tiny widths with
// the released 128-token window, 1M positions and selection that is sparse from a few thousand tokens
// on. Chunked prefill there equals one-shot prefill bit for bit, selections included, where the
// attention lists span several 64-row softmax chunks and top-k keeps a small share of the rows.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <utility>

#include "model/model.h"
#include "model/synthetic_checkpoint.h"
#include "test_util.h"

namespace dsv41 {
namespace {

const Model& long_model() {
  static test::TempDir dir;
  static const bool written = (write_synthetic_checkpoint(dir.path(), "long", 0), true);
  (void)written;
  static std::unique_ptr<Model> model = load_model(dir.path());
  return *model;
}

std::vector<int32_t> random_ids(int n, uint32_t seed, int vocab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& t : ids) t = static_cast<int32_t>(3 + rng() % static_cast<uint32_t>(vocab - 3));
  return ids;
}

struct PrefillRun {
  std::vector<float> logits;  // the last position's
  std::map<std::pair<int, int64_t>, std::vector<int32_t>> selected;  // (layer, position) -> rows
  int64_t sparse_queries = 0;  // queries that had more visible rows than top-k keeps
};

PrefillRun prefill_in_chunks(const std::vector<int32_t>& ids, int64_t chunk) {
  const Model& m = long_model();
  SequenceState st = m.new_sequence(test::pools_for(m));
  ForwardOptions opt;
  opt.capture_index = true;
  PrefillRun out;
  for (size_t done = 0; done < ids.size();) {
    const size_t take = std::min<size_t>(static_cast<size_t>(chunk), ids.size() - done);
    const int64_t start = st.length();
    ForwardResult r = m.forward(st, {ids.begin() + done, ids.begin() + done + take}, opt);
    for (size_t layer = 0; layer < r.index.size(); ++layer) {
      const IndexCapture& cap = r.index[layer];
      if (cap.k == 0) continue;
      for (size_t i = 0; i < take; ++i) {
        std::vector<int32_t> rows(cap.selected.begin() + static_cast<long>(i * cap.k),
                                  cap.selected.begin() + static_cast<long>((i + 1) * cap.k));
        int64_t visible = 0;
        for (int64_t t = 0; t < cap.n_keys; ++t) visible += cap.scores[i * cap.n_keys + t] > -1e30f;
        out.sparse_queries += visible > cap.k;
        out.selected[{static_cast<int>(layer), start + static_cast<int64_t>(i)}] = std::move(rows);
      }
    }
    done += take;
    out.logits = r.logits;
  }
  return out;
}

TEST(LongContext, PresetHasTheReleasedWindowAndSparseSelection) {
  const ModelConfig& c = long_model().config();
  EXPECT_EQ(c.window_size, 128);
  EXPECT_EQ(c.max_seq_len, 1048576);
  EXPECT_EQ(c.index_topk, 64);
  EXPECT_EQ(c.candidate_topk_blocks, 256);
  EXPECT_EQ(c.candidate_block_size, 8);
}

TEST(LongContext, ChunkedPrefillEqualsOneShotWhereSelectionIsSparse) {
  const std::vector<int32_t> ids = random_ids(3000, 5, 1000);
  const PrefillRun whole = prefill_in_chunks(ids, 3000);
  EXPECT_GT(whole.sparse_queries, 1000) << "top-k must keep a small share of the rows here";
  for (int64_t chunk : {1000, 128}) {
    const PrefillRun part = prefill_in_chunks(ids, chunk);
    EXPECT_EQ(part.logits, whole.logits) << "chunk " << chunk;
    EXPECT_EQ(part.selected, whole.selected) << "chunk " << chunk;
  }
}

}  // namespace
}  // namespace dsv41
