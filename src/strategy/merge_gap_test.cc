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

// Gaps measured in a row at one setting are averaged (one is noisy); another setting starts anew.
TEST(MergeGap, AveragesTheGapsOfOneSettingInARow) {
  auto line = [](int t) { return 5.0 - 0.01 * t; };
  MergeGap g;
  int t = 0;
  auto round = [&](double reduction, double after) {  // 40 steps on the line, a merge, 10 steps `after` x the line
    for (int end = t + 40; t < end; ++t) g.observe(line(t));
    g.merged(reduction);
    for (int end = t + 10; t < end; ++t) g.observe(line(t) * after);
  };
  round(100, 1.03);
  EXPECT_NEAR(g.gap(), 0.03, 1e-12);
  EXPECT_EQ(g.count(), 1);
  round(100, 0.99);
  EXPECT_NEAR(g.gap(), 0.01, 1e-12);
  EXPECT_EQ(g.count(), 2);
  round(100, 1.04);
  EXPECT_NEAR(g.gap(), 0.02, 1e-12);
  EXPECT_EQ(g.count(), 3);
  round(400, 1.05);
  EXPECT_EQ(g.reduction(), 400);
  EXPECT_NEAR(g.gap(), 0.05, 1e-12);
  EXPECT_EQ(g.count(), 1);
  round(100, 1.01);  // back at 100: not in a row with the first three
  EXPECT_NEAR(g.gap(), 0.01, 1e-12);
  EXPECT_EQ(g.count(), 1);
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
