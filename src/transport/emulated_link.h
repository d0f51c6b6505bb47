// EmulatedLink: WAN emulation wrapped around any Link, for local mode (no netem needed)
// and for tests. It models, on the SEND side, what makes a WAN slow and unreliable:
//
//  * a serialization bottleneck (Bottleneck) of `bandwidth_bits_per_s`: B wire bytes
//    (header included) occupy it for B*8/bandwidth seconds, first come first served.
//    The N EmulatedLinks of one site pair (the streams a StripedLink uses) can share one
//    Bottleneck, so the configured bandwidth is the site pair's, not each stream's; links in
//    other processes can share it too (Bottleneck::in_file), and a chain of them models,
//    say, each host's egress in front of the site pair's path;
//  * a propagation delay `one_way_delay` plus a per-frame random `jitter` uniform in
//    [0, jitter]: a frame is handed to the inner link when its last byte "arrives",
//        arrival = max(previous arrival on this link, serialised + one_way_delay + jitter)
//    by a background thread, so many frames are in flight at once (bandwidth-delay
//    product) and frames of one link are never reordered (as TCP would not);
//  * a TCP window (`window_bytes`): at most that many bytes of this link are in flight,
//    counted from the start of their serialisation until the ACK would be back
//    (arrival + one_way_delay). One stream's goodput is then <= window / RTT, as for a
//    real TCP connection, which is why striping over N streams helps on long fat pipes;
//  * scheduled faults (WanFault): cut the link, stall delivery, corrupt a frame, or black-hole
//    it (silence both ways, the common failure of a real WAN path).
//
// Frames are serialised in segments of at most kSegmentBytes (and at most the window),
// each taking its turn at the bottleneck, so frames of links sharing a bottleneck
// interleave the way packets do, and a frame larger than the window still moves at
// window/RTT. Not modelled: slow start, loss and retransmission, the return path's
// bandwidth; recv() passes through to the inner link, so wrap both gateways' links to
// emulate both directions.
//
// send() blocks the caller until its frame has finished serialising (what a full socket
// buffer does to a real sender), then returns. If even an idle window could not finish
// the frame before the deadline (bottleneck backlog + serialisation time), it throws
// Timeout at once and sends nothing (the link stays usable). If the deadline passes while
// the frame is partly serialised (window or a shared bottleneck slower than estimated),
// it throws Timeout and the link is broken: the inner link is closed and later calls throw
// PeerLost, as for a TcpLink whose byte stream is out of step.
//
// Frames in flight are copies held in memory: at most the window, or, with no window,
// everything sent during one delay.
//
// The background thread hands each frame to the inner link with the caller's deadline
// shifted by its delay. If the inner link throws, the error is stored, the frames still in
// flight are dropped, and the same typed error (PeerLost, Timeout, ...) is rethrown by
// every later send() and recv().
//
// close() stops accepting frames, lets the frames already in flight arrive (waiting at
// most until the last one is due plus kDrainGrace for the inner link to take them), then
// stops the thread and closes the inner link. The destructor calls close().
//
// Thread safety: as for every Link (see link.h). A Bottleneck is thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "transport/link.h"
#include "util/thread_annotations.h"

namespace nebula::transport {

// A fault the emulator injects once, when its trigger is reached: `at` (time since the
// EmulatedLink was created) or `after_bytes` (once that many wire bytes, headers included,
// were accepted by send(): checked at the start of each send(), so after_bytes = 0 fires on
// the first one); if both are set, whichever comes first. Each fault fires once and is
// logged with spdlog::warn naming the peer.
struct WanFault {
  enum class Kind {
    kCut,      // close the inner link: both ends see PeerLost; this link's calls then throw
               // PeerLost("... cut by WAN emulation fault ..."); frames in flight are lost
    kStall,    // deliver nothing for `duration` from the firing (frames queue, ACKs stop, so
               // a window fills and send() blocks); nothing is lost
    kCorrupt,  // flip one byte of the payload of the next frame that has a payload, after its
               // checksum was computed: the receiver gets FrameError kBadChecksum
    kBlackhole,  // from the firing on, for good, every byte vanishes both ways with no FIN and
                 // no RST: frames in flight are dropped, send() blocks as on a full window that
                 // is never acknowledged (until its deadline: Timeout; or close()), and recv()
                 // reads and drops what the peer sends, so neither end hears anything and only
                 // a liveness check (ResilientOptions::liveness_timeout) can notice
  };
  Kind kind = Kind::kCut;
  std::optional<std::chrono::nanoseconds> at{};  // since the link was created
  std::optional<uint64_t> after_bytes{};       // once this many bytes were sent
  std::chrono::nanoseconds duration{0};        // stall length (kStall only)
};

struct WanEmulation {
  double bandwidth_bits_per_s = 0;            // 0 = unlimited; the site pair's when shared
  std::chrono::nanoseconds one_way_delay{0};  // propagation delay (RTT / 2), every frame
  // Bytes of this link in flight at most (0 = unlimited). 4 MiB is a typical Linux
  // maximum (net.ipv4.tcp_wmem / tcp_rmem); callers choose.
  uint64_t window_bytes = 0;
  std::chrono::nanoseconds jitter{0};  // extra one-way delay per frame, uniform in [0, jitter]
  uint64_t seed = 1;                   // of the jitter's std::mt19937_64; vary it per stream
  std::vector<WanFault> faults{};
};

// The serialisation bottleneck of one emulated path: a clock holding the end of the last slot
// handed out, first come first served. Shared by the EmulatedLinks of a site pair within one
// process (one object), or across the processes of one machine (in_file(): the clock lives in
// a shared file). Thread-safe, and process-safe in a file: the clock is one int64 updated by
// compare-exchange, with no lock.
//
// Bottlenecks chain: a segment passes this stage and then `next` (say, its host's egress,
// then the site pair's path), cut-through as in a pipeline, so a chain moves bytes at the rate
// of its slowest stage, and each stage is shared by everyone who passes it.
class Bottleneck {
 public:
  // `next`, if any, is the stage after this one (fixed for the object's life). Throws
  // nebula::Error if the bandwidth is negative or not finite. A bandwidth of 0 is unlimited:
  // that stage keeps no clock and delays nothing.
  explicit Bottleneck(double bandwidth_bits_per_s, std::shared_ptr<Bottleneck> next = nullptr);
  // The same with its clock in the file at `path` (created with mode 0600 if missing; 8 zero
  // bytes are a free bottleneck), so every process on this machine that opens that path shares
  // it. The clock counts nanoseconds of Clock (steady_clock, CLOCK_MONOTONIC on Linux: one
  // clock for all processes since boot), so use a new file for each run: one left from before
  // a reboot would hold a moment in the future. Throws nebula::Error naming the path if the
  // file cannot be opened, sized or mapped.
  static std::shared_ptr<Bottleneck> in_file(double bandwidth_bits_per_s, const std::string& path,
                                             std::shared_ptr<Bottleneck> next = nullptr);
  ~Bottleneck();
  Bottleneck(const Bottleneck&) = delete;
  Bottleneck& operator=(const Bottleneck&) = delete;

  // This stage's bandwidth (the first stage's, in a chain).
  double bandwidth_bits_per_s() const { return bandwidth_; }
  const std::shared_ptr<Bottleneck>& next() const { return next_; }
  // Time the slowest stage of the chain needs for `wire_bytes` bytes (zero when all are
  // unlimited).
  Clock::duration serialization_time(uint64_t wire_bytes) const;

  struct Slot {
    Clock::time_point start, end;
  };
  // Takes the next slot for `wire_bytes` at every stage: here, starting at max(now, end of the
  // last slot); then at `next` from the moment it starts here. The slot starts once the
  // segment has started at every stage and ends once every stage is done with it.
  Slot reserve(uint64_t wire_bytes, Clock::time_point now);
  // When a slot reserved now would start. Plus serialization_time(), an upper bound on when
  // it would end.
  Clock::time_point free_at(Clock::time_point now) const;

 private:
  Clock::duration stage_time(uint64_t wire_bytes) const;  // this stage's alone

  const double bandwidth_;
  const std::shared_ptr<Bottleneck> next_;
  // End of the last slot in nanoseconds of Clock: own_last_end_ns_, or the first word of
  // the file mapped at mapping_ (in_file). Accessed only through std::atomic_ref.
  alignas(std::atomic_ref<int64_t>::required_alignment) int64_t own_last_end_ns_ = 0;
  int64_t* last_end_ns_ = &own_last_end_ns_;
  void* mapping_ = nullptr;  // unmapped by the destructor
};

class EmulatedLink : public Link {
 public:
  static constexpr std::chrono::seconds kDrainGrace{1};
  static constexpr uint64_t kSegmentBytes = 64 * 1024;

  // With a private Bottleneck of emulation.bandwidth_bits_per_s. Throws nebula::Error if
  // the bandwidth is negative or not finite, a delay/jitter/fault time or duration is
  // negative, or a fault has neither `at` nor `after_bytes`.
  EmulatedLink(std::unique_ptr<Link> inner, WanEmulation emulation);
  // Sharing `bottleneck` with other links; emulation.bandwidth_bits_per_s must equal its
  // bandwidth (one number for the site pair, so a config mistake cannot hide here).
  EmulatedLink(std::unique_ptr<Link> inner, WanEmulation emulation, std::shared_ptr<Bottleneck> bottleneck);
  ~EmulatedLink() override;
  EmulatedLink(const EmulatedLink&) = delete;
  EmulatedLink& operator=(const EmulatedLink&) = delete;

  void send(const wire::Frame& frame, Deadline deadline) override;
  wire::Frame recv(Deadline deadline) override;
  void close() override;
  std::string peer() const override { return inner_->peer(); }
  std::string peer_identity() const override { return inner_->peer_identity(); }
  std::string peer_fingerprint() const override { return inner_->peer_fingerprint(); }
  LinkEstimates estimates() const override { return inner_->estimates(); }
  // What the caller sent (counted when send() returns) and received.
  LinkStats stats() const override;

  const WanEmulation& emulation() const { return emulation_; }
  const std::shared_ptr<Bottleneck>& bottleneck() const { return bottleneck_; }
  // Time the bottleneck needs for `wire_bytes` bytes (zero when bandwidth is unlimited).
  Clock::duration serialization_time(uint64_t wire_bytes) const;
  // Frames serialised by send() and not yet handed to the inner link.
  size_t in_flight() const;

 private:
  struct InFlight {
    wire::Frame frame;
    Clock::time_point due;  // arrival: when the frame reaches the inner link (before stalls)
    Deadline deadline;      // the sender's deadline shifted by the frame's delay
  };
  struct Segment {          // one window's worth of bytes in flight
    uint64_t bytes;
    Clock::time_point arrival;  // before stalls; its ACK is back at arrival + one_way_delay
  };
  struct Stall {
    Clock::time_point from, until;
  };
  struct PendingFault {
    WanFault fault;
    std::optional<Clock::time_point> at;  // absolute
    bool fired = false;
  };

  void pump();                                   // the background thread
  void throw_if_failed(const char* what) const REQUIRES(mu_);  // caller holds mu_
  // Fires every fault whose trigger was reached; returns true if the inner link must be
  // closed (a cut), which the caller does after releasing mu_. Caller holds mu_.
  bool fire_faults_locked(Clock::time_point now, bool at_send_start) REQUIRES(mu_);
  void fire_locked(PendingFault& f, Clock::time_point when, const char* trigger) REQUIRES(mu_);
  // A moment moved to the end of every stall that covers it. Caller holds mu_.
  Clock::time_point after_stalls(Clock::time_point t) const REQUIRES(mu_);
  // Window bytes still unacknowledged at `now`, dropping acknowledged segments; the moment
  // the oldest is acknowledged goes to *next_ack. Caller holds mu_.
  uint64_t window_in_use_locked(Clock::time_point now, Clock::time_point* next_ack) REQUIRES(mu_);
  // Next moment the pump must wake for a timed fault. Caller holds mu_.
  Clock::time_point next_timed_fault_locked() const REQUIRES(mu_);
  // Breaks the link after a partial send (caller holds mu_); the caller closes inner_.
  void break_locked(std::exception_ptr error) REQUIRES(mu_);

  const std::unique_ptr<Link> inner_;
  const WanEmulation emulation_;
  const std::shared_ptr<Bottleneck> bottleneck_;
  const Clock::time_point created_;

  Mutex send_mu_;                  // held for a whole send(): frames depart in FIFO order

  mutable Mutex mu_;
  std::condition_variable_any cv_;          // queue, window, faults, error, closing or pump state changed
  std::deque<InFlight> queue_ GUARDED_BY(mu_);          // ordered by due
  std::deque<Segment> window_ GUARDED_BY(mu_);          // segments not yet acknowledged
  std::vector<Stall> stalls_ GUARDED_BY(mu_);           // stalls that fired
  std::vector<PendingFault> faults_ GUARDED_BY(mu_);
  bool corrupt_next_ GUARDED_BY(mu_) = false;           // a kCorrupt waits for a payload
  bool blackholed_ GUARDED_BY(mu_) = false;             // a kBlackhole fired
  uint64_t bytes_accepted_ GUARDED_BY(mu_) = 0;         // wire bytes send() took on, for after_bytes
  Clock::time_point last_arrival_ GUARDED_BY(mu_){};    // frames never overtake each other
  std::mt19937_64 rng_ GUARDED_BY(mu_);
  std::exception_ptr error_ GUARDED_BY(mu_);            // first failure, sticky
  bool closing_ GUARDED_BY(mu_) = false;                // close() started; no new frames
  bool stop_ GUARDED_BY(mu_) = false;                   // pump must exit now
  bool pump_busy_ GUARDED_BY(mu_) = false;              // pump is inside inner_->send()
  bool pump_done_ GUARDED_BY(mu_) = false;
  Mutex close_mu_;                 // serializes close()
  bool closed_ GUARDED_BY(close_mu_) = false;

  LinkCounters counters_;

  std::thread pump_thread_;  // last member: started after everything it uses
};

}  // namespace nebula::transport
