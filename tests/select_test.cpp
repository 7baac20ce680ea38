// Top-k selection with TopkTies::Torch against torch.topk itself (tests/tools/topk_expected.py): on
// rows full of ties, in both regimes of torch's CPU kernel, the same entries as torch, so the engine
// can pick the reference's rows where scores are equal (kernels/select.cpp).
#include <gtest/gtest.h>

#include "kernels/reference.h"
#include "topk_expected.h"

namespace dsv41 {
namespace {

TEST(TopK, PicksTorchsEntriesAmongTies) {
  int lower_index_first_differs = 0;
  for (const test::TopkExpected& e : test::topk_expected()) {
    const int64_t n = static_cast<int64_t>(e.scores.size());
    EXPECT_EQ(reference::topk_ascending(e.scores.data(), n, e.k, TopkTies::Torch), e.selected)
        << "n = " << n << ", k = " << e.k;
    // the rows are made so that ties decide: the serving order picks other entries
    lower_index_first_differs +=
        reference::topk_ascending(e.scores.data(), n, e.k, TopkTies::LowerIndexFirst) != e.selected;
  }
  EXPECT_GE(lower_index_first_differs, 4);  // measured: 5 of the 12 rows
}

TEST(TopK, EdgeSizes) {
  const float s[] = {1, 2, 2, 0};
  EXPECT_TRUE(reference::topk_ascending(s, 4, 0, TopkTies::Torch).empty());
  EXPECT_EQ(reference::topk_ascending(s, 4, 4, TopkTies::Torch), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(reference::topk_ascending(s, 4, 1, TopkTies::Torch).size(), 1u);
}

}  // namespace
}  // namespace dsv41
