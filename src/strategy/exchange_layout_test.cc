#include "strategy/exchange_layout.h"

#include <gtest/gtest.h>

namespace nebula::strategy {
namespace {

using parallel::ShardLayout;
using parallel::ShardRun;

// 10 values; the fragment [2, 8). A site of 3 workers has shards of 4 ([0,4) [4,8) [8,12)), one
// of 2 shards of 5, one of 1 the whole.
TEST(ExchangeLayout, HoldingsForSitesOfDifferentWorkerCounts) {
  const FragmentRange fr{2, 6};
  const collective::Holdings h =
      wan_holdings(fr, {ShardLayout::contiguous(10, 3), ShardLayout::contiguous(10, 2), ShardLayout::contiguous(10, 1)});
  ASSERT_EQ(h.size(), 3u);
  ASSERT_EQ(h[0].size(), 3u);
  ASSERT_EQ(h[0][0].size(), 1u);
  EXPECT_EQ(h[0][0][0].begin, 0);
  EXPECT_EQ(h[0][0][0].end, 2);
  EXPECT_EQ(h[0][1][0].begin, 2);
  EXPECT_EQ(h[0][1][0].end, 6);
  EXPECT_TRUE(h[0][2].empty());  // the third worker's part is empty
  EXPECT_EQ(h[1][0][0].end, 3);
  EXPECT_EQ(h[2][0][0].begin, 0);
  EXPECT_EQ(h[2][0][0].end, 6);
}

TEST(ExchangeLayout, PartsOfOneUnitAreInRankOrder) {
  const auto parts = parts_of({2, 6}, ShardLayout::contiguous(10, 3));
  EXPECT_EQ(counts_of(parts), (std::vector<int64_t>{2, 4, 0}));
  EXPECT_TRUE(in_rank_order(parts));
  EXPECT_EQ(parts[1][0], (ShardRun{4, 0, 4}));
  // A fragment inside one shard: the other workers' parts are empty.
  EXPECT_EQ(counts_of(parts_of({5, 2}, ShardLayout::contiguous(10, 3))), (std::vector<int64_t>{0, 2, 0}));
}

// ZeRO-3's units: every worker holds a piece of each unit the fragment meets, so a fragment of
// one or more units is spread over all of a site's workers, not over the one or two whose
// contiguous shard it falls in.
TEST(ExchangeLayout, UnitsSpreadEveryFragmentOverEveryWorker) {
  const ShardLayout units({0, 8, 16, 24}, 4);
  const auto parts = parts_of({8, 16}, units);
  EXPECT_EQ(counts_of(parts), (std::vector<int64_t>{4, 4, 4, 4}));
  EXPECT_FALSE(in_rank_order(parts));
  EXPECT_EQ(parts[1].size(), 2u);
  EXPECT_EQ(parts[1][0], (ShardRun{10, 2, 2}));
  EXPECT_EQ(parts[1][1], (ShardRun{18, 4, 2}));
  EXPECT_EQ(counts_of(parts_of({8, 16}, ShardLayout::contiguous(24, 4))), (std::vector<int64_t>{0, 4, 6, 6}));
}

// Sites of different layouts in one exchange: {pipeline 2 × data 2} (stages [0, 9) and [9, 20))
// and {data 3}. Each site's holdings cover the fragment exactly once, in flat order, whatever
// its layout: the exchange pairs workers by position, not by rank.
TEST(ExchangeLayout, StagedAndUnstagedSitesCoverTheFragmentOnceEach) {
  const parallel::StageLayout staged({0, 9, 20}, 2);
  const FragmentRange fr{4, 12};  // [4, 16): both stages
  const collective::Holdings h = wan_holdings(fr, {staged, ShardLayout::contiguous(20, 3)});
  ASSERT_EQ(h.size(), 2u);
  ASSERT_EQ(h[0].size(), 4u);
  ASSERT_EQ(h[1].size(), 3u);
  for (const auto& site : h) {
    int64_t next = 0;
    for (const auto& spans : site)
      for (const auto& span : spans) {
        EXPECT_EQ(span.begin, next);
        next = span.end;
      }
    EXPECT_EQ(next, fr.numel);
  }
  // Stage 0's pieces are [0, 5) and [5, 9), stage 1's [9, 15) and [15, 20).
  const auto parts = parts_of(fr, staged);
  EXPECT_EQ(counts_of(parts), (std::vector<int64_t>{1, 4, 6, 1}));
  EXPECT_TRUE(in_rank_order(parts));
  EXPECT_EQ(parts[2][0], (ShardRun{9, 0, 6}));
  EXPECT_EQ(parts[3][0], (ShardRun{15, 6, 1}));
  EXPECT_EQ(workers_of(staged), 4);
}

// What each worker holds of the flat vector, by layout: ZeRO's workers all of it, a stage its
// range, a slice its rows and columns (SliceLayout::held_runs); and which part and replica each
// rank is (SiteGrid's orders: stage-major; replica-major for slices).
TEST(ExchangeLayout, HeldValuesPartsAndReplicasOfEveryLayout) {
  const ShardLayout zero = ShardLayout::contiguous(20, 3);
  const std::vector<ShardRun> all = held_of(zero, 2);
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].flat, 0);
  EXPECT_EQ(all[0].len, 20);
  EXPECT_EQ(holding_of(zero, 2), 0);
  EXPECT_EQ(replica_of(zero, 2), 2);
  EXPECT_EQ(replicas_of(zero), 3);
  const parallel::StageLayout stages({0, 9, 20}, 2);  // ranks: stage 0 {0, 1}, stage 1 {2, 3}
  const std::vector<ShardRun> second = held_of(stages, 3);
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(second[0].flat, 9);
  EXPECT_EQ(second[0].local, 0);
  EXPECT_EQ(second[0].len, 11);
  EXPECT_EQ(holding_of(stages, 3), 1);
  EXPECT_EQ(replica_of(stages, 3), 1);
  EXPECT_EQ(replica_of(stages, 2), 0);
  EXPECT_EQ(replicas_of(stages), 2);
  // A [4, 2] weight cut by rows and a [2] bias whole, 2 slices × 2 replicas: rank 3 is slice 1 of
  // replica 1, holding rows 2-3 (flat [4, 8)) and the bias (flat [8, 10)).
  const parallel::SliceLayout slices({{4, 2}, {2}}, {0, -1}, 2, 2);
  const std::vector<ShardRun> held = held_of(slices, 3);
  ASSERT_EQ(held.size(), 1u);  // adjacent runs joined
  EXPECT_EQ(held[0].flat, 4);
  EXPECT_EQ(held[0].local, 0);
  EXPECT_EQ(held[0].len, 6);
  EXPECT_EQ(holding_of(slices, 3), 1);
  EXPECT_EQ(replica_of(slices, 3), 1);
  EXPECT_EQ(replicas_of(slices), 2);
}

}  // namespace
}  // namespace nebula::strategy
