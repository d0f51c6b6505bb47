// Thread-safety annotations the compiler checks (CONVENTIONS.md 13), as abseil's
// ABSL_GUARDED_BY and Chromium's GUARDED_BY: under clang they are the attributes of
// -Wthread-safety (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html); under any other
// compiler they expand to nothing, so GCC builds are unaffected. A clang build with
// -DNEBULA_THREAD_SAFETY=ON turns every violation into an error (scripts/check_threads.sh).
//
// libstdc++'s std::mutex carries no annotations, so the analysis cannot see it being locked:
// shared state is guarded by nebula::Mutex (below), locked with nebula::MutexLock.
//
//   class Queue {
//     Mutex mu_;
//     std::condition_variable_any cv_;             // waits on the Mutex itself
//     std::deque<int> items_ GUARDED_BY(mu_);
//    public:
//     void push(int v) EXCLUDES(mu_) { MutexLock l(mu_); items_.push_back(v); cv_.notify_one(); }
//     int pop() EXCLUDES(mu_) {
//       MutexLock l(mu_);
//       cv_.wait(mu_, [&]() REQUIRES(mu_) { return !items_.empty(); });
//       ...
//
// Waiting: std::condition_variable_any waits on any BasicLockable, so a wait names the Mutex
// (it unlocks and relocks it inside, which the analysis does not see and need not: the lock
// is held again when the wait returns). A predicate lambda is analysed as its own function,
// so it says REQUIRES(mu_), which is true: the condition variable calls it with mu_ held.
#pragma once

#include <chrono>
#include <mutex>

#if defined(__clang__)
#define NEBULA_TSA(x) __attribute__((x))
#else
#define NEBULA_TSA(x)
#endif

#define CAPABILITY(x) NEBULA_TSA(capability(x))
#define SCOPED_CAPABILITY NEBULA_TSA(scoped_lockable)
#define GUARDED_BY(x) NEBULA_TSA(guarded_by(x))
#define PT_GUARDED_BY(x) NEBULA_TSA(pt_guarded_by(x))
#define REQUIRES(...) NEBULA_TSA(requires_capability(__VA_ARGS__))
#define EXCLUDES(...) NEBULA_TSA(locks_excluded(__VA_ARGS__))
#define ACQUIRE(...) NEBULA_TSA(acquire_capability(__VA_ARGS__))
#define RELEASE(...) NEBULA_TSA(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) NEBULA_TSA(try_acquire_capability(__VA_ARGS__))
#define RETURN_CAPABILITY(x) NEBULA_TSA(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS NEBULA_TSA(no_thread_safety_analysis)

namespace nebula {

// A std::mutex the analysis can see. BasicLockable (lock/unlock/try_lock), so it also works
// with std::condition_variable_any and std::scoped_lock.
class CAPABILITY("mutex") Mutex {
 public:
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }

 private:
  std::mutex mu_;
};

// The same over std::timed_mutex, for a lock taken with a deadline.
class CAPABILITY("mutex") TimedMutex {
 public:
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  template <typename TimePoint>
  bool try_lock_until(const TimePoint& t) TRY_ACQUIRE(true) {
    return mu_.try_lock_until(t);
  }

 private:
  std::timed_mutex mu_;
};

// Holds a Mutex for its scope (std::lock_guard), and may release it for a while in between
// (unlock() ... lock(), as std::unique_lock; the analysis tracks both).
template <typename M>
class SCOPED_CAPABILITY BasicMutexLock {
 public:
  explicit BasicMutexLock(M& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~BasicMutexLock() RELEASE() {
    if (held_) mu_.unlock();
  }
  BasicMutexLock(const BasicMutexLock&) = delete;
  BasicMutexLock& operator=(const BasicMutexLock&) = delete;
  void unlock() RELEASE() {
    mu_.unlock();
    held_ = false;
  }
  void lock() ACQUIRE() {
    mu_.lock();
    held_ = true;
  }

 private:
  M& mu_;
  bool held_ = true;
};
using MutexLock = BasicMutexLock<Mutex>;

}  // namespace nebula
