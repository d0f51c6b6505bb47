#include "parallel/shard_layout.h"

#include <gtest/gtest.h>

#include <numeric>
#include <stdexcept>

namespace nebula::parallel {
namespace {

// Every value of the flat vector is held by exactly one worker, once, at a local index inside
// that worker's shard and inside its unit's slot.
TEST(ShardLayoutTest, EveryValueHeldOnceInsideItsSlot) {
  for (int64_t n : {1, 2, 3, 4}) {
    const ShardLayout layout({0, 0, 7, 8, 20, 20, 41}, n);
    std::vector<int> held(static_cast<size_t>(layout.total()), 0);
    for (int64_t q = 0; q < n; ++q) {
      std::vector<int> local_used(static_cast<size_t>(layout.shard_numel()), 0);
      for (const ShardRun& r : layout.runs(q, 0, layout.total())) {
        ASSERT_GT(r.len, 0);
        for (int64_t i = 0; i < r.len; ++i) {
          ++held[static_cast<size_t>(r.flat + i)];
          ASSERT_LT(r.local + i, layout.shard_numel());
          ++local_used[static_cast<size_t>(r.local + i)];
        }
      }
      for (int used : local_used) EXPECT_LE(used, 1);
    }
    for (int h : held) EXPECT_EQ(h, 1) << n << " workers";
  }
}

// FSDP's cut: every unit in N pieces of ceil(n_u / N), so no worker's piece exceeds the unit's
// N-th share rounded up, and a unit's pieces sum to it.
TEST(ShardLayoutTest, UnitsCutEvenly) {
  const ShardLayout layout({0, 1000, 1999, 3001}, 4);
  for (size_t u = 0; u < layout.units(); ++u) {
    const std::vector<int64_t> c = layout.piece_counts(u);
    EXPECT_EQ(std::accumulate(c.begin(), c.end(), int64_t{0}), layout.unit_numel(u));
    for (int64_t x : c) EXPECT_LE(x, (layout.unit_numel(u) + 3) / 4);
    EXPECT_GE(*std::min_element(c.begin(), c.end()), layout.unit_numel(u) / 4 - 3);
  }
  EXPECT_EQ(layout.shard_numel(), 250 + 250 + 251);
}

// One unit is the contiguous layout the free functions describe: [q S, (q + 1) S).
TEST(ShardLayoutTest, OneUnitIsTheContiguousCut) {
  const ShardLayout layout = ShardLayout::contiguous(10, 3);
  EXPECT_EQ(layout.shard_numel(), shard_numel(10, 3));
  for (int64_t offset : {0, 2, 4, 9})
    for (int64_t numel : {0, 1, 5}) {
      if (offset + numel > 10) continue;
      EXPECT_EQ(layout.counts(offset, numel), part_counts(4, 3, offset, numel));
      const std::vector<int64_t> cuts = part_cuts(4, 3, offset, numel);
      for (int64_t q = 0; q < 3; ++q) {
        const std::vector<ShardRun> runs = layout.runs(q, offset, numel);
        ASSERT_LE(runs.size(), 1u);
        if (runs.empty()) continue;
        EXPECT_EQ(runs[0].flat, offset + cuts[q]);
        EXPECT_EQ(runs[0].local, offset + cuts[q] - q * 4);
      }
    }
}

// A range that spans units: a run from each unit's piece, in flat order, local offsets rising.
TEST(ShardLayoutTest, RunsOfARangeAcrossUnits) {
  const ShardLayout layout({0, 8, 16}, 2);  // pieces of 4: worker 1 holds [4, 8) and [12, 16)
  const std::vector<ShardRun> runs = layout.runs(1, 6, 8);
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0], (ShardRun{6, 2, 2}));
  EXPECT_EQ(runs[1], (ShardRun{12, 4, 2}));
  EXPECT_EQ(layout.counts(6, 8), (std::vector<int64_t>{4, 4}));
  EXPECT_TRUE(layout.runs(0, 4, 4).empty());
}

TEST(ShardLayoutTest, BadBoundsThrow) {
  EXPECT_THROW(ShardLayout({0, 5, 3}, 2), std::invalid_argument);
  EXPECT_THROW(ShardLayout({1, 5}, 2), std::invalid_argument);
  EXPECT_THROW(ShardLayout({0, 5}, 0), std::invalid_argument);
}

// A staged site: every value of the flat vector has one worker, of the stage that trains it, at
// its index among that stage's values; the site's ranks hold the vector in flat order; and a
// stage's replicas split it as ShardLayout::contiguous splits a site of that many workers.
TEST(StageLayoutTest, EveryValueHeldOnceAtItsIndexInTheStage) {
  for (int64_t data : {1, 2, 3}) {
    const StageLayout layout({0, 10, 10, 23, 24}, data);
    ASSERT_EQ(layout.workers(), 4 * data);
    std::vector<int> held(static_cast<size_t>(layout.total()), 0);
    int64_t next = 0;
    for (int64_t rank = 0; rank < layout.workers(); ++rank) {
      const int64_t s = layout.stage_of(rank);
      const std::vector<ShardRun> runs = layout.runs(rank, 0, layout.total());
      ASSERT_LE(runs.size(), 1u);
      const std::vector<ShardRun> cut = ShardLayout::contiguous(layout.stage_numel(s), data).runs(rank % data, 0, layout.stage_numel(s));
      ASSERT_EQ(runs.size(), cut.size());
      for (size_t k = 0; k < runs.size(); ++k) {
        EXPECT_EQ(runs[k].flat, layout.stage_begin(s) + cut[k].flat);
        EXPECT_EQ(runs[k].local, cut[k].flat);
        EXPECT_EQ(runs[k].flat, next) << "rank " << rank;
        next = runs[k].flat + runs[k].len;
        for (int64_t i = 0; i < runs[k].len; ++i) ++held[static_cast<size_t>(runs[k].flat + i)];
      }
      // A range inside the vector: the run clipped to it, its local index moved alike.
      for (const ShardRun& r : layout.runs(rank, 5, 12)) {
        EXPECT_GE(r.flat, 5);
        EXPECT_LE(r.flat + r.len, 17);
        EXPECT_EQ(r.local, r.flat - layout.stage_begin(s));
      }
    }
    EXPECT_EQ(next, layout.total());
    for (int h : held) EXPECT_EQ(h, 1) << data << " replicas";
  }
}

TEST(StageLayoutTest, BadBoundsThrow) {
  EXPECT_THROW(StageLayout({0, 5, 3}, 1), std::invalid_argument);
  EXPECT_THROW(StageLayout({1, 5}, 1), std::invalid_argument);
  EXPECT_THROW(StageLayout({0}, 1), std::invalid_argument);
  EXPECT_THROW(StageLayout({0, 5}, 0), std::invalid_argument);
}

}  // namespace
}  // namespace nebula::parallel
