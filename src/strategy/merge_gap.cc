#include "strategy/merge_gap.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace nebula::strategy {

namespace {
double mean(const std::vector<double>& v, size_t begin, size_t n) {
  return std::accumulate(v.begin() + static_cast<std::ptrdiff_t>(begin), v.begin() + static_cast<std::ptrdiff_t>(begin + n),
                         0.0) /
         static_cast<double>(n);
}
}  // namespace

void MergeGap::observe(double loss) {
  if (!std::isfinite(loss)) return;
  round_.push_back(loss);
  if (window_ > 0 && round_.size() == static_cast<size_t>(window_)) {
    const double gap = (mean(round_, 0, round_.size()) - expected_) / expected_;
    if (count_ > 0 && pending_reduction_ == reduction_) {  // the same setting again: the running mean
      gap_ += (gap - gap_) / static_cast<double>(++count_);
    } else {
      gap_ = gap;
      count_ = 1;
    }
    reduction_ = pending_reduction_;
    window_ = 0;
  }
}

void MergeGap::merged(double reduction) {
  const size_t n = round_.size();
  window_ = 0;
  if (n >= 2) {
    const auto m = static_cast<size_t>(std::max<size_t>(1, std::min<size_t>(10, n / 4)));
    const double last = mean(round_, n - m, m);
    const size_t middle = n / 2;
    const double distance = static_cast<double>(n - m) - static_cast<double>(middle);
    const double slope = distance > 0 ? (last - mean(round_, middle, m)) / distance : 0.0;
    expected_ = last + slope * static_cast<double>(m);
    if (expected_ > 0) {
      window_ = static_cast<int64_t>(m);
      pending_reduction_ = reduction;
    }
  }
  round_.clear();
}

}  // namespace nebula::strategy
