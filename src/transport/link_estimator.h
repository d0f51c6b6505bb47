// LinkEstimator: turns round-trip-time and delivery-rate samples of one link into
// LinkEstimates (transport/link.h), the way BBR models a path:
//
//  * rtt_s: a windowed MIN filter over RTT samples. Queueing only ever adds delay, so the
//    smallest recent sample is the best estimate of the path's own round trip;
//  * rtt_smoothed_s: an EWMA of every RTT sample (alpha = rtt_ewma_alpha, 1/8 as TCP's
//    SRTT; the first sample initialises it);
//  * bandwidth_bits_per_s: a windowed MAX filter over delivery-rate samples. A sender can
//    never deliver faster than the bottleneck, and slow samples come from idle, app-limited
//    or ack-delayed intervals, so the largest recent sample is the best estimate.
//
// Windows are TIME windows (default 10 s each, as BBR's min_rtt filter; BBR keeps bandwidth
// for 10 round trips, which on a WAN is about a second, but our traffic is bursty --
// one synchronisation every few seconds -- so a longer window keeps a burst's measurement
// until the next burst). A window is measured back from the NEWEST accepted sample, not from
// the present: an idle link keeps its last estimates (the path does not change because we
// stopped sending), and they are only replaced when new traffic shows something else. The
// exact filters keep a monotone deque of the samples in the window, at most
// kMaxFilterSamples entries; beyond that the oldest is forgotten early (only when more than
// that many ever-larger RTTs, or ever-smaller rates, arrive within one window).
//
// Delivery samples over an interval shorter than min_delivery_interval (1 ms) are ignored:
// timer and scheduling noise would make the rate absurd. A sample marked app_limited (the
// sender ran out of data during it, so it measures the application, not the path) is used
// only if it raises the current estimate (BBR's rule). A sample marked lower_bound (its
// interval holds a round trip besides the transfer) enters the filter like any other; when it
// is the maximum, the estimate says so (LinkEstimates::bandwidth_at_least).
//
// Pure logic: time is passed in (Clock::time_point), so tests need no sockets and no sleep.
// Thread-safe: every method may be called from any thread (one internal mutex).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>

#include "nebula/deadline.h"
#include "transport/link.h"
#include "util/thread_annotations.h"

namespace nebula::transport {

struct LinkEstimatorOptions {
  Clock::duration rtt_window = std::chrono::seconds(10);        // of the min filter
  Clock::duration bandwidth_window = std::chrono::seconds(10);  // of the max filter
  Clock::duration min_delivery_interval = std::chrono::milliseconds(1);
  double rtt_ewma_alpha = 1.0 / 8;  // weight of a new sample in rtt_smoothed_s, in (0, 1]
};

class LinkEstimator {
 public:
  static constexpr size_t kMaxFilterSamples = 1024;

  // Throws nebula::Error if a window is not positive, min_delivery_interval is negative or
  // rtt_ewma_alpha is outside (0, 1].
  explicit LinkEstimator(LinkEstimatorOptions options = {});

  // One round-trip time, in seconds, measured at `now`. A sample of 0 (clock granularity)
  // is ignored; a negative or non-finite one is a caller bug (nebula::Error).
  void on_rtt_sample(double seconds, Clock::time_point now) EXCLUDES(mu_);

  // `bytes` (wire bytes, headers included) were delivered over `interval_seconds` ending at
  // `now`: a rate sample of bytes * 8 / interval bits per second. Returns whether it was
  // used: false when the interval is below min_delivery_interval, or when `app_limited` and
  // the rate does not exceed the current estimate. Negative or non-finite intervals are a
  // caller bug (nebula::Error). `lower_bound`: the path is at least this fast (above).
  bool on_delivery(uint64_t bytes, double interval_seconds, Clock::time_point now, bool app_limited = false,
                   bool lower_bound = false) EXCLUDES(mu_);

  LinkEstimates snapshot() const EXCLUDES(mu_);

 private:
  struct Sample {
    Clock::time_point at;
    double value;
    bool lower_bound = false;  // delivery samples: the path is at least this fast
  };
  // A windowed extremum: a deque of samples whose values are strictly monotone from the
  // front (the extremum) to the back (the newest); `better(a, b)` says a beats b.
  template <typename Better>
  static void add(std::deque<Sample>& filter, Sample s, Clock::duration window, Better better);

  const LinkEstimatorOptions options_;

  mutable Mutex mu_;
  std::deque<Sample> min_rtt_ GUARDED_BY(mu_);  // increasing values, front = min
  std::deque<Sample> max_bw_ GUARDED_BY(mu_);   // decreasing values, front = max
  double smoothed_rtt_ GUARDED_BY(mu_) = 0;     // 0 until the first sample
  uint64_t rtt_samples_ GUARDED_BY(mu_) = 0;
  uint64_t bw_samples_ GUARDED_BY(mu_) = 0;
};

}  // namespace nebula::transport
