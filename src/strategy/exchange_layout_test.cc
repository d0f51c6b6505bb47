#include "strategy/exchange_layout.h"

#include <gtest/gtest.h>

namespace nebula::strategy {
namespace {

// 10 values; the fragment [2, 8). A site of 3 workers has shards of 4 ([0,4) [4,8) [8,12)), one
// of 2 shards of 5, one of 1 the whole.
TEST(ExchangeLayout, WanCutsForSitesOfDifferentWorkerCounts) {
  const FragmentRange fr{2, 6};
  const auto cuts = wan_cuts(fr, 10, {3, 2, 1});
  ASSERT_EQ(cuts.size(), 3u);
  EXPECT_EQ(cuts[0], (std::vector<int64_t>{0, 2, 6, 6}));
  EXPECT_EQ(cuts[1], (std::vector<int64_t>{0, 3, 6}));
  EXPECT_EQ(cuts[2], (std::vector<int64_t>{0, 6}));
  EXPECT_EQ(counts_of(cuts[0]), (std::vector<int64_t>{2, 4, 0}));  // the third worker's part is empty
  EXPECT_EQ(counts_of(cuts[1]), (std::vector<int64_t>{3, 3}));
}

TEST(ExchangeLayout, PartsAreTheCutsOfThisWorker) {
  const FragmentRange fr{2, 6};
  const int64_t shard = parallel::shard_numel(10, 3);
  EXPECT_EQ(part_counts(fr, shard, 3), (std::vector<int64_t>{2, 4, 0}));
  const PartRange p0 = part_of(fr, shard, 3, 0), p1 = part_of(fr, shard, 3, 1), p2 = part_of(fr, shard, 3, 2);
  EXPECT_EQ(p0.at, 0);
  EXPECT_EQ(p0.len, 2);
  EXPECT_EQ(p1.at, 2);
  EXPECT_EQ(p1.len, 4);
  EXPECT_EQ(p2.at, 6);
  EXPECT_EQ(p2.len, 0);
  // A fragment inside one shard: the other workers' parts are empty.
  EXPECT_EQ(part_counts({5, 2}, shard, 3), (std::vector<int64_t>{0, 2, 0}));
  // Unsharded (one worker): the whole fragment.
  const PartRange whole = part_of(fr, parallel::shard_numel(10, 1), 1, 0);
  EXPECT_EQ(whole.at, 0);
  EXPECT_EQ(whole.len, 6);
}

}  // namespace
}  // namespace nebula::strategy
