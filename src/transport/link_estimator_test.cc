#include "transport/link_estimator.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace nebula::transport {
namespace {

using namespace std::chrono_literals;

// Injected time: no sleeping.
const Clock::time_point t0 = Clock::time_point{} + 1000s;

TEST(LinkEstimatorTest, EmptyIsUnknown) {
  LinkEstimator e;
  LinkEstimates s = e.snapshot();
  EXPECT_EQ(s.rtt_s, 0);
  EXPECT_EQ(s.rtt_smoothed_s, 0);
  EXPECT_EQ(s.bandwidth_bits_per_s, 0);
  EXPECT_EQ(s.rtt_samples, 0u);
  EXPECT_EQ(s.bandwidth_samples, 0u);
}

TEST(LinkEstimatorTest, MinRttTracksTheMinimumAndForgetsItAfterTheWindow) {
  LinkEstimator e;  // 10 s window
  e.on_rtt_sample(0.100, t0);
  EXPECT_DOUBLE_EQ(e.snapshot().rtt_s, 0.100);
  e.on_rtt_sample(0.050, t0 + 1s);
  e.on_rtt_sample(0.080, t0 + 2s);
  e.on_rtt_sample(0.120, t0 + 3s);
  EXPECT_DOUBLE_EQ(e.snapshot().rtt_s, 0.050);
  e.on_rtt_sample(0.090, t0 + 10s);  // window [0 s, 10 s]: 0.050 at 1 s still in
  EXPECT_DOUBLE_EQ(e.snapshot().rtt_s, 0.050);
  e.on_rtt_sample(0.090, t0 + 11500ms);  // window [1.5 s, 11.5 s]: 0.080 at 2 s is the min
  EXPECT_DOUBLE_EQ(e.snapshot().rtt_s, 0.080);
  e.on_rtt_sample(0.200, t0 + 12500ms);  // [2.5 s, 12.5 s]: 0.090 (the 0.120 at 3 s was beaten)
  EXPECT_DOUBLE_EQ(e.snapshot().rtt_s, 0.090);
  e.on_rtt_sample(0.300, t0 + 30s);  // everything older expired
  EXPECT_DOUBLE_EQ(e.snapshot().rtt_s, 0.300);
  EXPECT_EQ(e.snapshot().rtt_samples, 8u);
}

TEST(LinkEstimatorTest, IdleLinkKeepsItsLastEstimates) {
  LinkEstimator e;
  e.on_rtt_sample(0.05, t0);
  ASSERT_TRUE(e.on_delivery(1'000'000, 0.1, t0));
  // No samples for an hour: the window is measured from the newest sample, not from now.
  LinkEstimates s = e.snapshot();
  EXPECT_DOUBLE_EQ(s.rtt_s, 0.05);
  EXPECT_DOUBLE_EQ(s.bandwidth_bits_per_s, 80e6);
}

TEST(LinkEstimatorTest, MaxBandwidthTracksTheMaximumAndForgetsItAfterTheWindow) {
  LinkEstimator e;  // 10 s window
  ASSERT_TRUE(e.on_delivery(125'000, 0.1, t0));  // 10 Mbit/s
  EXPECT_DOUBLE_EQ(e.snapshot().bandwidth_bits_per_s, 10e6);
  ASSERT_TRUE(e.on_delivery(500'000, 0.1, t0 + 1s));  // 40 Mbit/s
  ASSERT_TRUE(e.on_delivery(250'000, 0.1, t0 + 2s));  // 20 Mbit/s
  ASSERT_TRUE(e.on_delivery(62'500, 0.1, t0 + 3s));   // 5 Mbit/s
  EXPECT_DOUBLE_EQ(e.snapshot().bandwidth_bits_per_s, 40e6);
  ASSERT_TRUE(e.on_delivery(125'000, 0.1, t0 + 11500ms));  // [1.5 s, 11.5 s]: 20 Mbit/s at 2 s
  EXPECT_DOUBLE_EQ(e.snapshot().bandwidth_bits_per_s, 20e6);
  ASSERT_TRUE(e.on_delivery(12'500, 0.1, t0 + 12500ms));  // [2.5 s, 12.5 s]: 10 Mbit/s at 11.5 s
  EXPECT_DOUBLE_EQ(e.snapshot().bandwidth_bits_per_s, 10e6);
  ASSERT_TRUE(e.on_delivery(12'500, 0.1, t0 + 60s));
  EXPECT_DOUBLE_EQ(e.snapshot().bandwidth_bits_per_s, 1e6);
  EXPECT_EQ(e.snapshot().bandwidth_samples, 7u);
}

TEST(LinkEstimatorTest, SmoothedRttIsAnEwmaThatConverges) {
  LinkEstimator e;
  e.on_rtt_sample(0.100, t0);
  EXPECT_DOUBLE_EQ(e.snapshot().rtt_smoothed_s, 0.100);  // the first sample initialises it
  e.on_rtt_sample(0.200, t0 + 10ms);
  EXPECT_DOUBLE_EQ(e.snapshot().rtt_smoothed_s, 0.100 + (0.200 - 0.100) / 8);
  for (int i = 2; i < 100; ++i) e.on_rtt_sample(0.200, t0 + i * 10ms);
  // (7/8)^99 of the initial 0.1 s difference is left: < 1e-6 s.
  EXPECT_NEAR(e.snapshot().rtt_smoothed_s, 0.200, 1e-6);
  EXPECT_DOUBLE_EQ(e.snapshot().rtt_s, 0.100);  // the min filter still has the first one
}

TEST(LinkEstimatorTest, TinyIntervalsAndZeroRttsAreIgnored) {
  LinkEstimator e;
  EXPECT_FALSE(e.on_delivery(1'000'000, 0.0005, t0));  // would be 16 Gbit/s
  EXPECT_FALSE(e.on_delivery(1'000'000, 0.0, t0));
  e.on_rtt_sample(0.0, t0);
  LinkEstimates s = e.snapshot();
  EXPECT_EQ(s.bandwidth_bits_per_s, 0);
  EXPECT_EQ(s.bandwidth_samples, 0u);
  EXPECT_EQ(s.rtt_samples, 0u);
  EXPECT_TRUE(e.on_delivery(1'000, 0.001, t0));  // the floor itself is accepted
  EXPECT_DOUBLE_EQ(e.snapshot().bandwidth_bits_per_s, 8e6);

  LinkEstimatorOptions o;
  o.min_delivery_interval = 0ms;
  LinkEstimator no_floor(o);
  EXPECT_FALSE(no_floor.on_delivery(1'000, 0.0, t0));  // never a division by zero
  EXPECT_TRUE(no_floor.on_delivery(1'000, 1e-6, t0));
}

TEST(LinkEstimatorTest, AppLimitedSamplesOnlyRaiseTheEstimate) {
  LinkEstimator e;
  EXPECT_TRUE(e.on_delivery(1'000, 0.1, t0, /*app_limited=*/true));  // raises "unknown"
  ASSERT_TRUE(e.on_delivery(1'250'000, 0.1, t0 + 1s));             // 100 Mbit/s
  EXPECT_FALSE(e.on_delivery(12'500, 0.1, t0 + 2s, true));          // 1 Mbit/s: says nothing
  EXPECT_TRUE(e.on_delivery(2'500'000, 0.1, t0 + 3s, true));        // 200 Mbit/s: a lower bound
  LinkEstimates s = e.snapshot();
  EXPECT_DOUBLE_EQ(s.bandwidth_bits_per_s, 200e6);
  EXPECT_EQ(s.bandwidth_samples, 3u);
}

TEST(LinkEstimatorTest, ALowerBoundIsReportedAsOneWhileItIsTheMaximum) {
  LinkEstimator e;
  ASSERT_TRUE(e.on_delivery(125'000, 0.1, t0, false, /*lower_bound=*/true));  // 10 Mbit/s, or more
  EXPECT_DOUBLE_EQ(e.snapshot().bandwidth_bits_per_s, 10e6);
  EXPECT_TRUE(e.snapshot().bandwidth_at_least);
  ASSERT_TRUE(e.on_delivery(62'500, 0.1, t0 + 1s));  // a measurement, but slower: the bound stays the maximum
  EXPECT_DOUBLE_EQ(e.snapshot().bandwidth_bits_per_s, 10e6);
  EXPECT_TRUE(e.snapshot().bandwidth_at_least);
  ASSERT_TRUE(e.on_delivery(500'000, 0.1, t0 + 2s));  // 40 Mbit/s, measured
  EXPECT_DOUBLE_EQ(e.snapshot().bandwidth_bits_per_s, 40e6);
  EXPECT_FALSE(e.snapshot().bandwidth_at_least);
  ASSERT_TRUE(e.on_delivery(1'250'000, 0.1, t0 + 3s, false, true));  // a bound above it: ">= 100 Mbit/s"
  EXPECT_TRUE(e.snapshot().bandwidth_at_least);
  // After the window only the newest sample is left.
  ASSERT_TRUE(e.on_delivery(250'000, 0.1, t0 + 14s));
  EXPECT_DOUBLE_EQ(e.snapshot().bandwidth_bits_per_s, 20e6);
  EXPECT_FALSE(e.snapshot().bandwidth_at_least);
}

TEST(LinkEstimatorTest, FilterMemoryIsBounded) {
  LinkEstimator e;
  // Ever-larger RTTs within one window: each stays a candidate for the minimum.
  const size_t n = LinkEstimator::kMaxFilterSamples + 500;
  for (size_t i = 0; i < n; ++i) e.on_rtt_sample(0.001 * static_cast<double>(i + 1), t0 + static_cast<int>(i) * 1ms);
  // The oldest 500 were forgotten early.
  EXPECT_NEAR(e.snapshot().rtt_s, 0.001 * 501, 1e-12);
}

TEST(LinkEstimatorTest, RejectsBadSamplesAndOptions) {
  LinkEstimator e;
  EXPECT_THROW(e.on_rtt_sample(-0.1, t0), Error);
  EXPECT_THROW(e.on_rtt_sample(std::numeric_limits<double>::quiet_NaN(), t0), Error);
  EXPECT_THROW(e.on_delivery(10, -1.0, t0), Error);
  EXPECT_THROW(e.on_delivery(10, std::numeric_limits<double>::infinity(), t0), Error);
  LinkEstimatorOptions o;
  o.rtt_window = 0s;
  EXPECT_THROW(LinkEstimator{o}, Error);
  o = {};
  o.rtt_ewma_alpha = 0;
  EXPECT_THROW(LinkEstimator{o}, Error);
  o = {};
  o.min_delivery_interval = -1ms;
  EXPECT_THROW(LinkEstimator{o}, Error);
}

}  // namespace
}  // namespace nebula::transport
