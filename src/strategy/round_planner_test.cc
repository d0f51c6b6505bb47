#include "strategy/round_planner.h"

#include <gtest/gtest.h>

#include "strategy/controller.h"

namespace nebula::strategy {
namespace {

// Two sites. info: [seconds per step, bandwidth, rtt, joiners, merge gap, its reduction, bandwidth
// is a lower bound, gaps in the mean] each.
std::vector<float> info(float t0, float t1, float bandwidth = 0, float at_least0 = 0, float bandwidth1 = -1) {
  return {t0, bandwidth, 0.01f, 1, 0, 0, at_least0, 0, t1, bandwidth1 < 0 ? bandwidth : bandwidth1, 0.02f, 1, 0, 0, 0, 0};
}

RoundPlannerOptions pinned(size_t site, int64_t h = 10) {
  RoundPlannerOptions o;
  o.codec = "int8";
  o.inner_steps = h;
  o.site_index = site;
  o.params = 100000;
  return o;
}

TEST(RoundPlanner, KnownInfoLagsOneRoundWithoutDelayAndTwoWithIt) {
  const std::vector<std::vector<float>> rows = {{1}, {2}, {3}};
  EXPECT_EQ(known_info(rows, 3, 0), std::vector<float>{3});
  EXPECT_EQ(known_info(rows, 3, 1), std::vector<float>{2});
  EXPECT_TRUE(known_info(rows, 1, 1).empty());
  EXPECT_TRUE(known_info(rows, 0, 0).empty());
  EXPECT_TRUE(known_info(rows, 5, 0).empty());  // not merged here yet
}

TEST(RoundPlanner, FasterSiteRunsProportionallyMoreStepsTheSlowestH) {
  ControllerMemory memory;
  const RoundPlan fast = plan_round(pinned(0), {info(0.01f, 0.03f), 1, 1000, 10, 10, "int8"}, memory);
  EXPECT_EQ(fast.nominal_h, 10);
  EXPECT_EQ(fast.round_steps, 30);
  EXPECT_EQ(fast.codec, "int8");
  EXPECT_EQ(fast.steps_line, "round 1: this site runs 30 inner steps (H 10; 10 ms per step here, 30 ms at the slowest site)");
  EXPECT_TRUE(fast.controller_line.empty());
  EXPECT_FALSE(memory.decided);  // pinned: the controller does not run
  const RoundPlan slow = plan_round(pinned(1), {info(0.01f, 0.03f), 1, 1000, 10, 10, "int8"}, memory);
  EXPECT_EQ(slow.round_steps, 10);
  EXPECT_TRUE(slow.steps_line.empty());  // as before: nothing to say
  // The same again: no new line; and back to H once the sites are equal: a line.
  EXPECT_TRUE(plan_round(pinned(0), {info(0.01f, 0.03f), 2, 1000, 20, 30, "int8"}, memory).steps_line.empty());
  const RoundPlan back = plan_round(pinned(0), {info(0.02f, 0.02f), 3, 1000, 30, 30, "int8"}, memory);
  EXPECT_EQ(back.round_steps, 10);
  EXPECT_EQ(back.steps_line, "round 3: this site runs 10 inner steps (H 10; 20 ms per step here, 20 ms at the slowest site)");
  // Heterogeneous off, or nothing measured: H.
  RoundPlannerOptions off = pinned(0);
  off.heterogeneous = false;
  EXPECT_EQ(plan_round(off, {info(0.01f, 0.03f), 1, 1000, 10, 10, "int8"}, memory).round_steps, 10);
  // ... and its last round, cut short, is no line: nothing timed enters the decisions.
  const RoundPlan cut = plan_round(off, {info(0.01f, 0.03f), 4, 45, 40, 10, "int8"}, memory);
  EXPECT_EQ(cut.round_steps, 5);
  EXPECT_TRUE(cut.steps_line.empty()) << cut.steps_line;
  EXPECT_EQ(plan_round(pinned(0), {{}, 0, 1000, 0, 0, "int8"}, memory).round_steps, 10);
  // The last round is cut to the job's steps.
  const RoundPlan last = plan_round(pinned(1), {info(0.01f, 0.03f), 4, 45, 40, 10, "int8"}, memory);
  EXPECT_EQ(last.nominal_h, 5);
  EXPECT_EQ(last.round_steps, 5);
}

TEST(RoundPlanner, AutoAsksTheControllerOnceUnmeasuredThenOnMeasurements) {
  RoundPlannerOptions o = pinned(0, 0);
  o.codec = "auto";
  o.heterogeneous = false;
  ControllerMemory memory;
  const RoundPlan first = plan_round(o, {{}, 0, 100000, 0, 0, ""}, memory);
  EXPECT_TRUE(memory.decided);
  EXPECT_FALSE(memory.decided_measured);
  EXPECT_EQ(first.controller_line.rfind("round 0: codec " + first.codec + ", H " + std::to_string(memory.h) + " — ", 0), 0u)
      << first.controller_line;
  EXPECT_EQ(first.nominal_h, memory.h);
  // Still unmeasured: not asked again, nothing logged.
  const RoundPlan second = plan_round(o, {{}, 1, 100000, memory.h, memory.h, first.codec}, memory);
  EXPECT_TRUE(second.controller_line.empty());
  EXPECT_EQ(second.codec, first.codec);
  // Measured: asked, and logged the first time it rests on measurements.
  const RoundPlan measured = plan_round(o, {info(0.1f, 0.1f, 1e9f), 2, 100000, 0, memory.h, second.codec}, memory);
  EXPECT_TRUE(memory.decided_measured);
  EXPECT_EQ(measured.controller_line.rfind("round 2: codec ", 0), 0u) << measured.controller_line;
  // The same numbers again (adaptive): asked, the same choice, nothing logged.
  const RoundPlan again = plan_round(o, {info(0.1f, 0.1f, 1e9f), 3, 100000, 0, memory.h, measured.codec}, memory);
  EXPECT_TRUE(again.controller_line.empty());
  EXPECT_EQ(again.codec, measured.codec);
  // Pinned H with an auto codec: H stays, the codec is the controller's.
  RoundPlannerOptions pin_h = o;
  pin_h.inner_steps = 7;
  ControllerMemory m2;
  const RoundPlan p = plan_round(pin_h, {{}, 0, 100000, 0, 0, ""}, m2);
  EXPECT_EQ(p.nominal_h, 7);
  EXPECT_FALSE(p.controller_line.empty());
}

// The slowest path's figure reaches the controller with its kind: a lower bound from site 0 is
// said so when site 0's path is the slowest, and not when another site measured a slower one.
TEST(RoundPlanner, TheSlowestPathsLowerBoundReachesTheControllersReason) {
  RoundPlannerOptions o = pinned(0, 0);
  o.codec = "auto";
  o.heterogeneous = false;
  ControllerMemory bound;
  const RoundPlan a = plan_round(o, {info(0.1f, 0.1f, 6e6f, /*at_least0=*/1, 8e6f), 2, 100000, 0, 0, ""}, bound);
  EXPECT_NE(a.controller_line.find("WAN >= 6 Mbit/s (a lower bound"), std::string::npos) << a.controller_line;
  ControllerMemory measured;
  const RoundPlan b = plan_round(o, {info(0.1f, 0.1f, 6e6f, 1, 5e6f), 2, 100000, 0, 0, ""}, measured);
  EXPECT_NE(b.controller_line.find("WAN 5 Mbit/s, RTT"), std::string::npos) << b.controller_line;
}

// Watching quality on a scripted trace. A setting's merge gap is 0.5 % up to 1,000x and 3 % above
// (a cliff the controller's proportional model cannot foresee, so it overshoots), the budget 2 %.
// As in a job, the exchange that ends round r - 1 carries the gap measured
// after round r - 2's merge, with that setting's reduction and the mean's count (the rounds in a
// row at that setting). The controller starts at int4 H = 50 (not at the time rules' choice), climbs
// (H at most doubling), backs off each time two gaps in a row are over the budget, and settles on
// the cheapest setting within it that its moves can reach.
TEST(RoundPlanner, WatchingQualitySettlesOnTheFewestBytesWithinTheBudget) {
  RoundPlannerOptions o;
  o.codec = "auto";
  o.inner_steps = 0;
  o.heterogeneous = false;
  o.max_loss_penalty = 0.02;
  o.params = 1000000;
  auto gap_of = [&](double reduction) { return reduction <= 1000 ? 0.005 : 0.03; };
  ControllerMemory memory;
  std::vector<double> used;  // each round's reduction
  std::string codec;
  int backoffs = 0;
  auto in_a_row = [&](int64_t k) {  // rounds up to k at round k's setting
    int64_t n = 1;
    while (k - n >= 0 && used[static_cast<size_t>(k - n)] == used[static_cast<size_t>(k)]) ++n;
    return n;
  };
  bool waited = false;  // a gap over the budget once, not acted on
  for (int64_t r = 0; r < 120; ++r) {
    // Fast sites and link: the time-only choice is the least compression (none, H 10).
    std::vector<float> info;
    const int64_t count = r >= 2 ? in_a_row(r - 2) : 0;
    for (int s = 0; s < 2; ++s) {
      const double measured = r >= 2 ? used[static_cast<size_t>(r - 2)] : 0;
      info.insert(info.end(), {0.1f, 1e10f, 0.001f, 1, static_cast<float>(measured > 0 ? gap_of(measured) : 0),
                               static_cast<float>(measured), 0, static_cast<float>(count)});
    }
    const RoundPlan plan = plan_round(o, {r == 0 ? std::vector<float>{} : info, r, 1 << 30, 0, 0, codec}, memory);
    codec = plan.codec;
    used.push_back(setting_reduction(codec, memory.h, o.params, o.codec_options));
    if (r >= 2 && gap_of(used[static_cast<size_t>(r - 2)]) > 0.02 && used[static_cast<size_t>(r - 2)] == used[r - 1]) {
      if (count >= kMergeGapsToAct) {
        // Evidence over the budget for the setting in use: it backs off, and says so.
        EXPECT_LT(used.back(), used[static_cast<size_t>(r - 1)]) << "round " << r;
        EXPECT_NE(plan.controller_line.find("backs off"), std::string::npos) << plan.controller_line;
        ++backoffs;
      } else {  // one gap: it waits for the next
        EXPECT_EQ(used.back(), used[static_cast<size_t>(r - 1)]) << "round " << r;
        waited = true;
      }
    }
    if (r <= 1) {  // a fixed start, whatever the time says (fast sites and link: none, H 10)
      EXPECT_EQ(codec + " " + std::to_string(memory.h), "int4 50") << "round " << r;
    }
  }
  EXPECT_GE(backoffs, 1);
  EXPECT_TRUE(waited);
  // Settled within the budget, below the ceiling, on the most reduction a move can reach from
  // there (any candidate with more, below the ceiling and at most twice the H, is over budget).
  const double settled = used.back();
  EXPECT_LE(gap_of(settled), 0.02);
  EXPECT_GT(memory.ceiling, settled);
  for (const auto& c : controller_codecs()) {
    if (c == "sparseloco") continue;  // never a candidate while watching quality (controller.h)
    for (int64_t h : controller_inner_steps()) {
      const double r = setting_reduction(c, h, o.params, o.codec_options);
      if (r > settled && r < memory.ceiling && h <= 2 * memory.h) EXPECT_GT(gap_of(r), 0.02) << c << " H " << h;
    }
  }
  EXPECT_GT(settled, 376.0) << "above the start";
  for (size_t r = used.size() - 10; r < used.size(); ++r) EXPECT_EQ(used[r], settled) << "and stays there, round " << r;
}

}  // namespace
}  // namespace nebula::strategy
