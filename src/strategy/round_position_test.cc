#include "strategy/round_position.h"

#include <gtest/gtest.h>

#include "nebula/error.h"

namespace nebula::strategy {
namespace {

RoundPosition example() {
  RoundPosition p;
  p.next_seq = 14;
  p.rounds = 5;
  p.outer_steps = 13;
  p.nominal_done = 50;
  p.round_open = true;
  p.nominal_h = 10;
  p.round_steps = 30;
  p.in_round = 4;
  p.next_fragment = 1;
  p.controller = {true, true, 20, 800};
  p.codec = "int8";
  p.fragment_rounds = {5, 4, 4};
  for (int r = 0; r < 5; ++r) p.info_of_round.push_back({0.01f * static_cast<float>(r + 1), 1e6f, 0.02f, 1, 0.03f, 2e6f, 0.04f, 1});
  return p;
}

// What both encodings keep: the rounds before the last two carry no info (nothing looks at it).
void expect_equal(const RoundPosition& a, const RoundPosition& b, int64_t round_steps) {
  EXPECT_EQ(a.next_seq, b.next_seq);
  EXPECT_EQ(a.rounds, b.rounds);
  EXPECT_EQ(a.outer_steps, b.outer_steps);
  EXPECT_EQ(a.nominal_done, b.nominal_done);
  EXPECT_EQ(a.round_open, b.round_open);
  EXPECT_EQ(a.nominal_h, b.nominal_h);
  EXPECT_EQ(b.round_steps, round_steps);
  EXPECT_EQ(a.in_round, b.in_round);
  EXPECT_EQ(a.next_fragment, b.next_fragment);
  EXPECT_EQ(a.controller.decided, b.controller.decided);
  EXPECT_EQ(a.controller.decided_measured, b.controller.decided_measured);
  EXPECT_EQ(a.controller.h, b.controller.h);
  EXPECT_EQ(a.controller.ceiling, b.controller.ceiling);
  EXPECT_EQ(a.codec, b.codec);
  EXPECT_EQ(a.fragment_rounds, b.fragment_rounds);
  ASSERT_EQ(b.info_of_round.size(), 5u);
  for (size_t r = 0; r < 3; ++r) EXPECT_TRUE(b.info_of_round[r].empty()) << r;
  for (size_t r = 3; r < 5; ++r) EXPECT_EQ(b.info_of_round[r], a.info_of_round[r]) << r;
}

TEST(RoundPosition, RoundTripsThroughTheCheckpointKeys) {
  const RoundPosition p = example();
  StrategyState st;
  p.save(st);
  // The keys are the checkpoint format: old checkpoints must load.
  for (const char* key : {"f0/round", "f1/round", "f2/round", "rounds", "outer_steps", "nominal_done", "next_seq",
                          "round_open", "nominal_h", "round_steps", "in_round", "next_fragment", "controller_h",
                          "decided", "decided_measured", "info/3/0", "info/4/7"})
    EXPECT_EQ(st.numbers.count(key), 1u) << key;
  EXPECT_EQ(st.numbers.count("info/2/0"), 0u);
  EXPECT_EQ(st.numbers.size(), 15u + 16u + 1u);  // + controller_ceiling (only when set)
  EXPECT_EQ(st.strings.at("codec"), "int8");
  EXPECT_EQ(st.numbers.at("controller_h"), 20);
  expect_equal(p, RoundPosition::load(st, 3), 30);
  st.numbers.erase("controller_ceiling");  // an older checkpoint: no ceiling
  EXPECT_EQ(RoundPosition::load(st, 3).controller.ceiling, 0);
  st.numbers.erase("in_round");
  try {
    RoundPosition::load(st, 3);
    FAIL() << "no error for a missing key";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("'in_round'"), std::string::npos) << e.what();
  }
}

TEST(RoundPosition, RoundTripsThroughReconcilesVector) {
  const RoundPosition p = example();
  const std::vector<double> v = p.to_vector();
  // The layout sites exchange: 12 counters, the fragments' rounds, two rounds' info, the ceiling.
  ASSERT_EQ(v.size(), 12u + 3u + 2u * (1u + 8u) + 1u);
  EXPECT_EQ(v.back(), 800);
  EXPECT_EQ(std::vector<double>(v.begin(), v.begin() + 15),
            (std::vector<double>{14, 5, 13, 50, 1, 10, 4, 1, 20, 1, 1, 4 /* int8 */, 5, 4, 4}));
  EXPECT_EQ(v[15], 8);
  EXPECT_EQ(v[16], static_cast<double>(p.info_of_round[3][0]));
  expect_equal(p, RoundPosition::from_vector(v.data(), 3), 10);  // round_steps: back to H
  // An older build's vector ends before the ceiling; the reader pads with zeros: none.
  std::vector<double> old = v;
  old.back() = 0;
  EXPECT_EQ(RoundPosition::from_vector(old.data(), 3).controller.ceiling, 0);
  RoundPosition unknown = p;
  unknown.codec = "zstd";
  EXPECT_THROW(unknown.to_vector(), Error);
}

TEST(RoundPosition, ReconcileFollowsTheSiteFurthestAhead) {
  // (next outer step id, hash) per site; site 1 lost (sent nothing).
  const std::vector<std::vector<double>> positions = {{5, 1}, {}, {7, 2}, {7, 2}};
  ReconcileVerdict v = reconcile_verdict(positions, 0);
  EXPECT_EQ(v.leader, 2u);  // the lowest-numbered among equals
  EXPECT_TRUE(v.any);
  EXPECT_TRUE(v.adopt);
  v = reconcile_verdict(positions, 3);
  EXPECT_EQ(v.leader, 2u);
  EXPECT_TRUE(v.any);
  EXPECT_FALSE(v.adopt);
  v = reconcile_verdict({{7, 2}, {}, {7, 2}}, 2);
  EXPECT_EQ(v.leader, 0u);
  EXPECT_FALSE(v.any);
  EXPECT_FALSE(v.adopt);
  // Same step, other hash: the lower-numbered leads, the other takes its state.
  v = reconcile_verdict({{7, 2}, {7, 3}}, 1);
  EXPECT_EQ(v.leader, 0u);
  EXPECT_TRUE(v.adopt);
}

}  // namespace
}  // namespace nebula::strategy
