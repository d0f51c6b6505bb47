#include "strategy/fragment_schedule.h"

#include <gtest/gtest.h>

#include <vector>

namespace nebula::strategy {
namespace {

int64_t numel_of(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// The fragments tile the flat vector in order, and each one's pieces tile it.
void expect_tiling(const std::vector<FragmentCut>& cuts, const std::vector<std::vector<int64_t>>& shapes) {
  int64_t total = 0;
  for (const auto& s : shapes) total += numel_of(s);
  int64_t next = 0;
  for (size_t j = 0; j < cuts.size(); ++j) {
    EXPECT_EQ(cuts[j].offset, next) << "fragment " << j;
    EXPECT_GT(cuts[j].numel, 0) << "fragment " << j;
    int64_t sum = 0;
    for (const Piece& pc : cuts[j].pieces) {
      EXPECT_EQ(numel_of(pc.shape), pc.numel) << "fragment " << j << " param " << pc.param;
      sum += pc.numel;
    }
    EXPECT_EQ(sum, cuts[j].numel) << "fragment " << j;
    next += cuts[j].numel;
  }
  EXPECT_EQ(next, total);
}

TEST(FragmentSchedule, CutsFallBetweenRowsAndPiecesAreRowBlocks) {
  // 40 + 6 + 24 = 70 values; thirds at 23 and 46: inside the [10, 4] (rows of 4: 24) and at the
  // end of the vector (46 = 40 + 6).
  const std::vector<std::vector<int64_t>> shapes = {{10, 4}, {6}, {8, 3}};
  const auto cuts = cut_fragments(shapes, 3);
  ASSERT_EQ(cuts.size(), 3u);
  expect_tiling(cuts, shapes);
  EXPECT_EQ(cuts[1].offset, 24);
  EXPECT_EQ(cuts[2].offset, 46);
  ASSERT_EQ(cuts[0].pieces.size(), 1u);
  EXPECT_EQ(cuts[0].pieces[0].shape, (std::vector<int64_t>{6, 4}));  // a row block
  ASSERT_EQ(cuts[1].pieces.size(), 2u);
  EXPECT_EQ(cuts[1].pieces[0].at, 24);
  EXPECT_EQ(cuts[1].pieces[0].shape, (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(cuts[1].pieces[1].shape, (std::vector<int64_t>{6}));  // the whole vector, its own shape
  ASSERT_EQ(cuts[2].pieces.size(), 1u);
  EXPECT_EQ(cuts[2].pieces[0].shape, (std::vector<int64_t>{8, 3}));  // the whole matrix
}

TEST(FragmentSchedule, OneFragmentIsTheWholeModelInItsShapes) {
  const std::vector<std::vector<int64_t>> shapes = {{3, 2}, {}, {4}};
  const auto cuts = cut_fragments(shapes, 1);
  ASSERT_EQ(cuts.size(), 1u);
  expect_tiling(cuts, shapes);
  ASSERT_EQ(cuts[0].pieces.size(), 3u);
  EXPECT_EQ(cuts[0].pieces[1].shape, std::vector<int64_t>{});  // a scalar
}

TEST(FragmentSchedule, NeverEmptyWithMoreFragmentsThanRows) {
  // 2 rows, 4 fragments: the cuts fall inside rows, and the pieces are flat.
  const std::vector<std::vector<int64_t>> shapes = {{2, 3}};
  const auto cuts = cut_fragments(shapes, 4);
  ASSERT_EQ(cuts.size(), 4u);
  expect_tiling(cuts, shapes);
  for (const auto& c : cuts) EXPECT_EQ(c.pieces.at(0).shape, std::vector<int64_t>{c.numel});
  // More fragments than values: one value each.
  const auto tiny = cut_fragments({{3}}, 5);
  ASSERT_EQ(tiny.size(), 3u);
  expect_tiling(tiny, {{3}});
  // No values at all: one empty fragment.
  const auto none = cut_fragments({}, 3);
  ASSERT_EQ(none.size(), 1u);
  EXPECT_EQ(none[0].numel, 0);
}

// The inner step (1-based, of the round) after which fragment j goes: the end of its slot.
std::vector<int64_t> send_steps(int64_t h, size_t f) {
  std::vector<int64_t> at;
  size_t next = 0;
  for (int64_t in_round = 1; in_round <= h; ++in_round)
    while (next < f && fragment_due(next, in_round, h, f)) {
      at.push_back(in_round);
      ++next;
    }
  return at;
}

TEST(FragmentSchedule, FragmentJGoesAtTheEndOfSlotJ) {
  EXPECT_EQ(send_steps(4, 1), (std::vector<int64_t>{4}));
  EXPECT_EQ(send_steps(4, 2), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(send_steps(3, 2), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(send_steps(6, 3), (std::vector<int64_t>{2, 4, 6}));
  EXPECT_EQ(send_steps(1, 3), (std::vector<int64_t>{1, 1, 1}));  // a round shorter than F: all at once
  EXPECT_EQ(send_steps(5, 4), (std::vector<int64_t>{2, 3, 4, 5}));
}

struct FakeFragment {
  bool in_flight = false;
  int64_t merge_at = 0;
  uint64_t seq = 0;
};

TEST(FragmentSchedule, MergesGoInSendOrderWhenDue) {
  std::vector<FakeFragment> f = {{true, 7, 5}, {true, 6, 4}, {false, 0, 0}, {true, 9, 6}};
  EXPECT_EQ(next_merge(f, 5), f.size());  // none due
  EXPECT_EQ(next_merge(f, 6), 1u);
  EXPECT_EQ(next_merge(f, 8), 1u);  // sent first
  f[1].in_flight = false;
  EXPECT_EQ(next_merge(f, 8), 0u);
  f[0].in_flight = false;
  EXPECT_EQ(next_merge(f, 8), f.size());
  EXPECT_EQ(next_merge(f), 3u);  // drain: whatever is in flight
}

}  // namespace
}  // namespace nebula::strategy
