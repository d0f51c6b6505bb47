#include "strategy/merge_gap.h"

#include <gtest/gtest.h>

#include <limits>

namespace nebula::strategy {
namespace {

// A loss falling in a straight line through the merge: the merged model is where the local one
// was heading, a gap of 0; 2 % above that line after it: 0.02. The gap comes with the setting's
// reduction once m = min(10, 40 / 4) steps after the merge are in, and stays until the next.
TEST(MergeGap, MeasuresTheMergedModelAgainstTheLocalTrend) {
  auto line = [](int t) { return 5.0 - 0.01 * t; };
  MergeGap g;
  for (int t = 0; t < 40; ++t) g.observe(line(t));
  g.merged(123);
  for (int t = 40; t < 49; ++t) g.observe(line(t));
  EXPECT_EQ(g.reduction(), 0) << "9 of 10 steps after the merge: nothing measured yet";
  g.observe(line(49));
  EXPECT_EQ(g.reduction(), 123);
  EXPECT_NEAR(g.gap(), 0.0, 1e-12);
  for (int t = 50; t < 80; ++t) g.observe(line(t));
  g.merged(456);
  for (int t = 80; t < 90; ++t) g.observe(line(t) * 1.02);
  EXPECT_EQ(g.reduction(), 456);
  EXPECT_NEAR(g.gap(), 0.02, 1e-12);
  // A merged model better than the trend: negative. Non-finite losses are left out.
  for (int t = 90; t < 120; ++t) g.observe(line(t));
  g.merged(789);
  g.observe(std::numeric_limits<double>::quiet_NaN());
  for (int t = 120; t < 130; ++t) g.observe(line(t) * 0.97);
  EXPECT_EQ(g.reduction(), 789);
  EXPECT_NEAR(g.gap(), -0.03, 1e-12);
}

// Short rounds: m = max(1, len / 4). A round of one step measures nothing.
TEST(MergeGap, ShortRoundsUseShortWindows) {
  MergeGap g;
  for (double loss : {4.0, 3.0, 2.0, 1.0}) g.observe(loss);  // m = 1, slope -1 per step
  g.merged(10);
  g.observe(0.5);  // expected 1 - 1 = 0 is no base: nothing measured
  EXPECT_EQ(g.reduction(), 0);
  for (double loss : {4.0, 3.9, 3.8, 3.7}) g.observe(loss);
  g.merged(20);
  g.observe(3.6 * 1.1);
  EXPECT_EQ(g.reduction(), 20);
  EXPECT_NEAR(g.gap(), 0.1, 1e-9);
  g.merged(30);  // this round's one loss: the one measured above
  g.observe(1.0);
  EXPECT_EQ(g.reduction(), 20) << "a round of one step: nothing to extrapolate from";
}

}  // namespace
}  // namespace nebula::strategy
