// Deadlines: every blocking wait in nebula takes a Deadline, never a bare timeout, so a
// wait that crosses several calls cannot silently extend itself (CONVENTIONS.md #6).
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>

namespace nebula {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

class Deadline {
 public:
  // A deadline `timeout` from now. A non-positive timeout is already expired.
  static Deadline after(Clock::duration timeout) { return Deadline(Clock::now() + timeout); }
  static Deadline never() { return Deadline(Clock::time_point::max()); }
  explicit Deadline(Clock::time_point at) : at_(at) {}

  Clock::time_point at() const { return at_; }
  bool expired() const { return Clock::now() >= at_; }
  bool is_never() const { return at_ == Clock::time_point::max(); }
  // Time left, clamped at zero.
  Clock::duration remaining() const {
    if (is_never()) return Clock::duration::max();
    return std::max(Clock::duration::zero(), at_ - Clock::now());
  }
  // Milliseconds left for poll(2): -1 for never, else >= 0 (rounded up so we do not spin).
  int poll_timeout_ms() const {
    if (is_never()) return -1;
    auto left = std::chrono::duration_cast<Millis>(remaining() + std::chrono::microseconds(999)).count();
    return static_cast<int>(std::min<long long>(left, 1 << 30));
  }
  // The earlier of the two.
  Deadline min(const Deadline& other) const { return at_ <= other.at_ ? *this : other; }

 private:
  Clock::time_point at_;
};

// Waits on `cv` (with `lock` held) until `pred` holds or `deadline` passes; returns pred().
// Any condition variable and lock that go together: std::condition_variable with a
// std::unique_lock<std::mutex>, or std::condition_variable_any with any lockable (e.g. the
// nebula::Mutex itself, src/util/thread_annotations.h).
template <typename CondVar, typename Lock, typename Pred>
bool wait_until(CondVar& cv, Lock& lock, Deadline deadline, Pred pred) {
  if (deadline.is_never()) {
    cv.wait(lock, pred);
    return true;
  }
  return cv.wait_until(lock, deadline.at(), pred);
}

}  // namespace nebula
