#include "transport/link_estimator.h"

#include <cmath>

#include "nebula/error.h"

namespace nebula::transport {

LinkEstimator::LinkEstimator(LinkEstimatorOptions options) : options_(options) {
  NEBULA_CHECK(options.rtt_window.count() > 0 && options.bandwidth_window.count() > 0,
               "LinkEstimator windows must be positive, got rtt_window ",
               std::chrono::duration<double>(options.rtt_window).count(), " s and bandwidth_window ",
               std::chrono::duration<double>(options.bandwidth_window).count(), " s");
  NEBULA_CHECK(options.min_delivery_interval.count() >= 0, "LinkEstimator min_delivery_interval must not be negative");
  NEBULA_CHECK(options.rtt_ewma_alpha > 0 && options.rtt_ewma_alpha <= 1,
               "LinkEstimator rtt_ewma_alpha must be in (0, 1], got ", options.rtt_ewma_alpha);
}

template <typename Better>
void LinkEstimator::add(std::deque<Sample>& filter, Sample s, Clock::duration window, Better better) {
  // A sample that the new one beats (or equals) can never be the extremum again: the new
  // one is at least as good and stays in the window longer.
  while (!filter.empty() && !better(filter.back().value, s.value)) filter.pop_back();
  filter.push_back(s);
  while (filter.front().at < s.at - window) filter.pop_front();  // the back (s) always stays
  if (filter.size() > kMaxFilterSamples) filter.pop_front();
}

void LinkEstimator::on_rtt_sample(double seconds, Clock::time_point now) {
  NEBULA_CHECK(std::isfinite(seconds) && seconds >= 0, "RTT sample must be finite and >= 0, got ", seconds);
  if (seconds == 0) return;
  MutexLock lock(mu_);
  add(min_rtt_, {now, seconds}, options_.rtt_window, [](double a, double b) { return a < b; });
  smoothed_rtt_ = rtt_samples_ == 0 ? seconds : smoothed_rtt_ + options_.rtt_ewma_alpha * (seconds - smoothed_rtt_);
  ++rtt_samples_;
}

bool LinkEstimator::on_delivery(uint64_t bytes, double interval_seconds, Clock::time_point now, bool app_limited,
                                bool lower_bound) {
  NEBULA_CHECK(std::isfinite(interval_seconds) && interval_seconds >= 0,
               "delivery interval must be finite and >= 0, got ", interval_seconds);
  if (interval_seconds < std::chrono::duration<double>(options_.min_delivery_interval).count()) return false;
  if (interval_seconds == 0) return false;  // min_delivery_interval 0: still no division by zero
  const double rate = static_cast<double>(bytes) * 8 / interval_seconds;
  MutexLock lock(mu_);
  if (app_limited && (max_bw_.empty() ? 0.0 : max_bw_.front().value) >= rate) return false;
  add(max_bw_, {now, rate, lower_bound}, options_.bandwidth_window, [](double a, double b) { return a > b; });
  ++bw_samples_;
  return true;
}

LinkEstimates LinkEstimator::snapshot() const {
  MutexLock lock(mu_);
  LinkEstimates e;
  e.rtt_s = min_rtt_.empty() ? 0 : min_rtt_.front().value;
  e.rtt_smoothed_s = smoothed_rtt_;
  e.bandwidth_bits_per_s = max_bw_.empty() ? 0 : max_bw_.front().value;
  e.bandwidth_at_least = !max_bw_.empty() && max_bw_.front().lower_bound;
  e.rtt_samples = rtt_samples_;
  e.bandwidth_samples = bw_samples_;
  return e;
}

}  // namespace nebula::transport
