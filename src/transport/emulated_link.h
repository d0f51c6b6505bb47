// EmulatedLink: WAN emulation wrapped around any Link, for local mode (no netem needed)
// and for tests. It models, on the SEND side, the two things that make a WAN slow:
//
//  * a serialization bottleneck of `bandwidth_bits_per_s`: a frame of B wire bytes
//    (header included) occupies the bottleneck for B*8/bandwidth seconds, starting when
//    the previous frame has finished: depart_end = max(now, last_end) + B*8/bandwidth;
//  * a propagation delay `one_way_delay`: the frame is handed to the inner link at
//    depart_end + one_way_delay by a background thread, so many frames can be in flight
//    at once, as in a real long fat pipe (bandwidth-delay product).
//
// send() blocks the caller until its frame has finished serialising (what a full socket
// buffer does to a real sender), then returns; if that moment would be past the deadline
// it throws Timeout at once and sends nothing (the link stays usable). recv() passes
// through to the inner link; wrap both gateways' links to emulate both directions.
//
// Frames in flight are copies held in memory: with unlimited bandwidth and a delay that
// is everything sent during one delay.
//
// The background thread hands each frame to the inner link with the caller's deadline
// shifted by one_way_delay. If the inner link throws, the error is stored, the frames
// still in flight are dropped, and the same typed error (PeerLost, Timeout, ...) is
// rethrown by every later send() and recv().
//
// close() stops accepting frames, lets the frames already in flight arrive (waiting at
// most until the last one is due plus kDrainGrace for the inner link to take them), then
// stops the thread and closes the inner link. The destructor calls close().
//
// Thread safety: as for every Link (see link.h).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "transport/link.h"

namespace nebula::transport {

struct WanEmulation {
  double bandwidth_bits_per_s = 0;            // 0 = unlimited
  std::chrono::nanoseconds one_way_delay{0};  // propagation delay, added to every frame
};

class EmulatedLink : public Link {
 public:
  static constexpr std::chrono::seconds kDrainGrace{1};

  // Throws nebula::Error if the bandwidth is negative or not finite, or the delay negative.
  EmulatedLink(std::unique_ptr<Link> inner, WanEmulation emulation);
  ~EmulatedLink() override;
  EmulatedLink(const EmulatedLink&) = delete;
  EmulatedLink& operator=(const EmulatedLink&) = delete;

  void send(const wire::Frame& frame, Deadline deadline) override;
  wire::Frame recv(Deadline deadline) override;
  void close() override;
  std::string peer() const override { return inner_->peer(); }
  std::string peer_identity() const override { return inner_->peer_identity(); }
  std::string peer_fingerprint() const override { return inner_->peer_fingerprint(); }
  // What the caller sent (counted when send() returns) and received.
  LinkStats stats() const override;

  const WanEmulation& emulation() const { return emulation_; }
  // Time the bottleneck needs for `wire_bytes` bytes (zero when bandwidth is unlimited).
  Clock::duration serialization_time(uint64_t wire_bytes) const;
  // Frames accepted by send() and not yet handed to the inner link.
  size_t in_flight() const;

 private:
  struct InFlight {
    wire::Frame frame;
    Clock::time_point due;  // when the frame reaches the inner link
    Deadline deadline;      // the sender's deadline shifted by the delay
  };
  void pump();                                          // the background thread
  void throw_if_failed(const char* what) const;  // caller holds no lock

  const std::unique_ptr<Link> inner_;
  const WanEmulation emulation_;

  std::mutex send_mu_;                         // held for a whole send(): FIFO departures
  Clock::time_point last_end_{};               // GUARDED_BY(send_mu_): when the bottleneck frees up

  mutable std::mutex mu_;
  std::condition_variable cv_;                 // queue, error, closing or pump state changed
  std::deque<InFlight> queue_;                 // GUARDED_BY(mu_), ordered by due
  std::exception_ptr error_;                   // GUARDED_BY(mu_): first inner failure, sticky
  bool closing_ = false;                       // GUARDED_BY(mu_): close() started; no new frames
  bool stop_ = false;                          // GUARDED_BY(mu_): pump must exit now
  bool pump_busy_ = false;                     // GUARDED_BY(mu_): pump is inside inner_->send()
  bool pump_done_ = false;                     // GUARDED_BY(mu_)
  std::mutex close_mu_;                        // serializes close()
  bool closed_ = false;                        // GUARDED_BY(close_mu_)

  LinkCounters counters_;

  std::thread pump_thread_;  // last member: started after everything it uses
};

}  // namespace nebula::transport
