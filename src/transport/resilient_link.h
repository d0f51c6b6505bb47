// ResilientLink: a session over a sequence of connections to one peer, which survives cut
// connections (DESIGN.md, "Reliability"). When the connection underneath fails, it
// reconnects through a caller-supplied function, resumes where it left off and re-sends
// what the peer has not got, so the caller sees nothing but latency: every frame sent is
// delivered once, in order, unless the peer stays away longer than reconnect_timeout.
//
// Sequence numbers. ResilientLink OWNS header.seq: send() overwrites it with a session
// sequence number (1, 2, 3, ... per direction, starting again only with a new session) and
// recomputes the checksum; recv() returns frames with that session seq. Every other header
// field (type, flags, op_id, codec) and the payload travel untouched. A layer above that
// needs a per-operation sequence number carries it in op_id or in the payload.
// FrameType::kAck, kResume, kBye, kPing, kPong, kHeartbeat and kPart are reserved for the
// session protocol: send() rejects them (nebula::Error) and recv() never returns them.
//
// Protocol (frames on the connection underneath; u64 = little-endian, wire::ByteWriter):
//  * kData (and kHello): a caller's frame, header.seq = session seq. A frame whose payload is
//    larger than ResilientOptions::fragment_bytes goes as pieces of at most that many bytes:
//    kPart frames (seq = the frame's, op_id = its whole payload length, each with its own
//    CRC), then the last piece with the frame's own header fields. The receiver joins them
//    (no copy beyond the append; the joined frame's checksum is combined from the pieces'
//    CRCs, not recomputed) and delivers the frame whole; a connection that fails mid-frame
//    loses its pieces, and the resume re-sends the frame from its first byte. So a frame of
//    any size crosses links whose wan.max_frame is far smaller, and a control frame waits
//    behind at most one piece, never behind a whole multi-second exchange.
//  * kHeartbeat, no payload: written when the writer has written nothing for a quarter of
//    liveness_timeout. Not sequenced, not acknowledged; its arrival is the point.
//  * kAck, payload u64 `delivered`, u64 `held_ns`: every frame with seq <= delivered has been
//    delivered to the receiving caller (cumulative). The sender then forgets them. held_ns:
//    how long frame `delivered` was held on the receiving side, from its arrival (the reader
//    had it whole) to this ack's write (QUIC's ack delay; for the estimates). An ack of only
//    8 bytes (an older peer) counts as held_ns = 0. Acks are delayed by at most
//    ResilientOptions::ack_interval and sent at once when many frames wait.
//    Acknowledging delivery, not arrival, makes the SENDER's max_pending_bytes also bound
//    the memory of the RECEIVER's queue of frames its caller has not taken yet.
//  * kPing, payload u64 id: an RTT probe, written after a data frame when no probe is in
//    flight (one at a time per connection). Answered by
//  * kPong, payload u64 id, u64 held_ns: held_ns is how long the ping waited on the answering
//    side, from its arrival to the pong's write (its writer may have been busy with a data
//    frame). Neither is sequenced nor acknowledged; an answer to a ping of an older
//    connection is ignored.
//  * kResume, payload u64 session_id, u64 delivered, u64 received: the first frame each side
//    sends on every connection, the first one included. `received` is the highest seq held
//    (delivered or queued). The sender of frames drops everything <= delivered and re-sends,
//    in order, everything > received. session_id is random per ResilientLink: a peer that
//    comes back with another one has restarted and lost its state, so the session cannot be
//    resumed (PeerLost). The receiver discards any frame with seq <= received (a duplicate
//    after a resend), so delivery is exactly once.
//
// Failures. A connection fails when the layer underneath throws PeerLost, Timeout or
// FrameError on the session's own reading or writing, or when the peer breaks the protocol
// (a gap in the sequence, an unexpected kResume). Then ResilientLink closes it and calls
// `reconnect` (with exponential backoff from backoff_initial to backoff_max) until a new
// connection has completed the resume exchange, or until reconnect_timeout has passed since
// the failure. In the latter case the peer is lost: every pending and later send(), recv()
// and flush() throws PeerLost(peer, "<peer> lost: no reconnection within 30 s (last error:
// <last attempt>; the connection failed with: <first error>)"). A peer that comes back with
// another session id, or whose resume is inconsistent with ours, is lost at once. Frames
// received but not yet taken by recv() are dropped then: the session is over, and the layer
// above resynchronises when the peer rejoins.
//
// Threads. Two background threads per link: a reader, which reads every frame from the
// current connection (so acks and failures are noticed even when the caller is not in
// recv()) and is the ONLY thread that reconnects; and a writer, which writes queued frames
// and acks (so neither the caller nor the reader ever blocks on the peer's window while the
// other waits: no distributed deadlock). send() only copies the frame into the queue of
// unacknowledged frames.
//
// Semantics of the Link calls:
//  * send(frame, deadline): returns once the frame is queued -- it will be delivered even
//    across reconnects. It blocks only while the unacknowledged frames hold
//    max_pending_bytes or more (a single frame larger than that is admitted when nothing is
//    pending); Timeout at the deadline, in which case the frame was NOT queued and nothing
//    is lost or duplicated. Concurrent sends are serialized, one at a time, in the order they
//    took their turn (a call waiting behind another still times out at its own deadline). Throws PeerLost once the link is closed or the peer lost.
//  * recv(deadline): the next frame in order; Timeout at the deadline (nothing consumed), also
//    while a reconnect is in progress. One receiving thread at a time (nebula::Error on
//    concurrent recv()).
//  * flush(deadline): waits until the peer has acknowledged every frame sent so far. Call it
//    before close() for an orderly end: close() discards frames not yet acknowledged.
//  * close(): idempotent, from any thread; every blocked and later call throws PeerLost at
//    once. The destructor also waits for a reconnect() call in flight to return (at most
//    attempt_timeout).
//  * peer(), peer_identity(), peer_fingerprint(): those of the current connection.
//  * stats(): LOGICAL counters -- frames and bytes (header included) the caller handed to
//    send() and got from recv() -- and, in the wire counters, what went over the network on
//    every connection of the session (TLS records, acks, probes, heartbeats, pieces' headers,
//    re-sends, resume frames, hellos). stats_ex() adds the session counters (reconnects,
//    re-sent frames, duplicates dropped, what is pending).
//
// Estimates (estimates(), LinkEstimates in link.h; filters in transport/link_estimator.h).
// Measured on the SENDING direction of this side, from the session's own acks, BBR-style
// (draft-cheng-iccrg-delivery-rate-estimation): when a kAck acknowledges up to seq S, the
// newest newly acknowledged frame P gives, with `arrived` = now - the ack's held_ns (when
// the ack would have come had the receiver acknowledged P on arrival; so neither the
// receiver's ack timer nor the time P waited for the receiver's caller -- a slower site still
// computing -- nor the receiver's writer busy with its own frames counts as path time):
//  * a delivery-rate sample: the bytes acknowledged since P's write began, over
//    max(time from the write of the frame acknowledged then to P's write, arrived - that
//    ack's arrived). Taking the longer of the send and ack intervals keeps bunched acks from
//    overstating the rate, and spreading a sample over about one round trip smooths it.
//    Idle time never counts: when a frame is written with nothing outstanding, its interval
//    starts at its own write; such an interval holds one round trip besides the transfer
//    (first byte written to the ack of the last), and once it is at least twice the min RTT
//    that RTT is subtracted: what is left is the transfer time alone, so one exchange-sized
//    frame between long pauses measures the bandwidth, not bytes / (transfer + RTT); a
//    shorter one (a frame smaller than the bandwidth-delay product) keeps the RTT in and is a
//    lower bound (LinkEstimates::bandwidth_at_least). A frame
//    written with nothing queued behind it is app-limited: its sample only counts if it
//    raises the estimate.
// RTT samples come from the probes, not from data frames: a ping's pong arriving `since`
// after the moment the writer took the ping (before its write began), minus the pong's
// held_ns. Every error in such a sample adds delay (the ping's few bytes of serialisation,
// queueing, a thread woken late), so the min filter's value is never below the path's round
// trip. A data frame could not give that: stamped before its write, a sample would include
// the frame's own serialisation (seconds for an exchange); stamped when the write returned,
// a writer scheduled late after it makes the sample short (17.1 ms on a 20 ms path in a
// loaded CI run).
// After a reconnect, samples start again on the new connection (frames written on an
// older one give none). No RTT sample is taken from the resume exchange: both sides send
// kResume at once, neither in answer to the other, so the time to the peer's kResume is
// not a round trip (on the dialling side it is about one one-way delay). A side that only
// receives has no samples (it sends no data, so no pings); the peer measures that path.
//
// Liveness. Each side writes something at least every liveness_timeout / 4 (a piece, an ack,
// a probe, or else a heartbeat), so a connection on which NOTHING arrives for liveness_timeout
// is dead or black-holed, whatever the layers underneath believe: the reader then fails it
// ("nothing arrived from X for 20 s (wan.liveness_timeout)") and reconnects as after any
// failure, so a silent partition costs at most liveness_timeout plus the reconnection, and one
// longer than reconnect_timeout ends in PeerLost like a closed one. The bound assumes one
// piece (fragment_bytes) crosses the path within liveness_timeout / 2; the configuration
// checks that for emulated paths (config.cc).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "transport/link.h"
#include "transport/link_estimator.h"
#include "util/thread_annotations.h"

namespace nebula::transport {

// Returns a fresh, already authenticated connection to the same peer (the dialling side
// redials, the accepting side waits for the peer to dial back; TLS and any hello are done
// inside), or throws (any exception counts as a failed attempt; its message is kept as the
// "last error"). Must return by `deadline`. Called only from ResilientLink's reader thread,
// never concurrently with itself.
using Reconnect = std::function<std::unique_ptr<Link>(Deadline deadline)>;

struct ResilientOptions {
  // A peer away longer than this (from the failure to a completed resume) is lost.
  std::chrono::milliseconds reconnect_timeout{30000};
  // Pause after a failed reconnect attempt: backoff_initial, doubling up to backoff_max.
  std::chrono::milliseconds backoff_initial{50};
  std::chrono::milliseconds backoff_max{2000};
  // The deadline given to one reconnect() call plus its resume exchange, capped by what is
  // left of reconnect_timeout. Bounds how long the destructor may wait for an attempt.
  std::chrono::milliseconds attempt_timeout{10000};
  // Bytes (headers included) of frames sent but not acknowledged, kept for re-sending.
  // send() blocks, bounded by its deadline, while this much is pending.
  uint64_t max_pending_bytes = 1ull << 30;
  // Longest delay of an acknowledgement after the caller took a frame. An ack also goes at
  // once when ack_every_frames frames or max_pending_bytes/4 bytes wait to be acknowledged.
  // The delay also inflates the peer's RTT samples by up to ack_interval (see "Estimates").
  std::chrono::milliseconds ack_interval{10};
  uint64_t ack_every_frames = 256;
  // Payload bytes per piece on the wire (see "Protocol"): at most the connection's largest
  // frame (wan.max_frame, less the stripe headers).
  uint64_t fragment_bytes = 1 << 20;
  // A connection with no frame arriving for this long fails (see "Liveness"); 0 = never (only
  // the layers underneath can notice a dead path then).
  std::chrono::milliseconds liveness_timeout{20000};
  // close() tells the peer (a kBye frame), so the peer does not spend reconnect_timeout
  // trying to reconnect to a session that ended on purpose. Off only to test vanishing peers.
  bool goodbye = true;
};

// Session counters since construction (see also stats()).
struct ResilienceStats {
  LinkStats link;                   // logical, as stats()
  uint64_t reconnects = 0;          // connections that replaced a failed one and resumed
  uint64_t reconnect_attempts = 0;  // calls of reconnect(), successful or not
  uint64_t frames_resent = 0;       // frames written again after a reconnect
  uint64_t bytes_resent = 0;        // their bytes, headers included
  uint64_t duplicates_dropped = 0;  // received frames discarded as already held
  uint64_t acks_sent = 0;
  uint64_t acks_received = 0;
  uint64_t heartbeats_sent = 0;
  uint64_t pieces_sent = 0;         // kPart frames and last pieces of split frames written
  uint64_t liveness_failures = 0;   // connections failed because nothing arrived in time
  uint64_t pending_frames = 0;  // sent, not yet acknowledged (now)
  uint64_t pending_bytes = 0;
  bool connected = false;  // a resumed connection is in place (now)
};

class ResilientLink : public Link {
 public:
  // `first` is the connection to start with (may be null: then reconnect() is called at
  // once). Throws nebula::Error if reconnect is empty or an option is out of range.
  ResilientLink(std::unique_ptr<Link> first, Reconnect reconnect, ResilientOptions options = {});
  ~ResilientLink() override;
  ResilientLink(const ResilientLink&) = delete;
  ResilientLink& operator=(const ResilientLink&) = delete;

  void send(const wire::Frame& frame, Deadline deadline) override;
  // Keeps `frame` itself until acknowledged (send() keeps a copy).
  void send_shared(std::shared_ptr<const wire::Frame> frame, Deadline deadline) override;
  wire::Frame recv(Deadline deadline) override;
  void close() override;
  std::string peer() const override;
  LinkStats stats() const override;
  std::string peer_identity() const override;
  std::string peer_fingerprint() const override;
  // Of the sending direction, measured from this session's acks (see "Estimates" above).
  LinkEstimates estimates() const override;

  // Waits until every frame sent so far has been acknowledged. Timeout / PeerLost.
  void flush(Deadline deadline) override;
  ResilienceStats stats_ex() const;
  // This side's random session id (as sent in kResume).
  uint64_t session_id() const { return session_id_; }

 private:
  using FramePtr = std::shared_ptr<const wire::Frame>;
  // What the writer noted when it wrote a frame, for the estimates (BBR's per-packet
  // delivery-rate state).
  struct WriteRecord {
    uint64_t gen = 0;                   // connection it was written on; 0 = not (yet) written whole
    Clock::time_point written{};        // when that write returned
    uint64_t delivered_bytes = 0;       // delivered_bytes_ when the write began
    Clock::time_point delivered_at{};   // delivered_at_ then
    Clock::time_point first_sent{};     // first_sent_ then
    bool app_limited = false;           // nothing was queued behind it
    bool rate_ok = false;               // acked_ >= rate_clean_after_ then
    bool idle_start = false;            // delivered_at then was a write's (nothing was outstanding)
  };
  struct PendingFrame {
    wire::FrameHeader header;  // the caller's, with this session's seq (and its checksum)
    FramePtr frame;            // the caller's frame: its payload is sent, its header is not
    WriteRecord write;
  };

  // send() and send_shared(): queues `frame` as the next seq.
  void enqueue(FramePtr frame, Deadline deadline);
  void reader_main(std::unique_ptr<Link> first);
  void writer_main();
  // Reads frames from `conn` until it fails; returns why.
  std::string read_loop(Link& conn, uint64_t gen);
  // Resume exchange on a fresh connection; installs it as the current one. Throws on failure
  // (NetworkError/FrameError: try again; returns false if the session is over).
  bool resume_on(const std::shared_ptr<Link>& conn, Deadline deadline);
  // Called by the writer when a write on generation `gen` failed.
  void connection_failed(uint64_t gen, const std::string& why);
  // Ends the session (PeerLost for everyone). Caller holds mu_ and closes the returned
  // connection (if any) after releasing it.
  std::shared_ptr<Link> declare_lost_locked(const std::string& message) REQUIRES(mu_);
  // Adds a connection's wire bytes to retired_wire_, before it is let go. Caller holds mu_.
  void retire_locked(const Link& conn) REQUIRES(mu_);
  // Forgets frames up to `delivered`. Caller holds mu_.
  void acknowledge_locked(uint64_t delivered) REQUIRES(mu_);
  // A kAck for `delivered` (> acked_) that the peer sent `held` after that frame arrived there
  // came on connection `gen`: takes the samples, then acknowledges. Caller holds mu_.
  void ack_received_locked(uint64_t delivered, Clock::duration held, uint64_t gen) REQUIRES(mu_);
  // Throws PeerLost if closed or lost. Caller holds mu_.
  void throw_if_over_locked(const char* what) const REQUIRES(mu_);
  std::string peer_locked() const REQUIRES(mu_);
  std::string waiting_detail_locked() const REQUIRES(mu_);
  bool ack_urgent_locked() const REQUIRES(mu_);

  const Reconnect reconnect_;
  const ResilientOptions options_;
  const uint64_t session_id_;
  std::string first_peer_;  // peer() of the first connection (for messages before any)

  // Guards no data (so it stays a plain std::mutex): detects a second receiving thread.
  std::mutex recv_mu_;  // try-locked by recv()

  mutable Mutex mu_;
  std::condition_variable_any send_cv_;    // senders and flush(): space freed, acks, over
  std::condition_variable_any recv_cv_;    // recv(): frame queued, over
  std::condition_variable_any writer_cv_;  // writer: work, connection installed, over
  std::condition_variable_any reader_cv_;  // reader's backoff sleep: close

  // Everything from here to counters_ is guarded by mu_ (checked: GUARDED_BY).
  std::shared_ptr<Link> conn_ GUARDED_BY(mu_);       // current connection (resumed), or the last one
  std::shared_ptr<Link> candidate_ GUARDED_BY(mu_);  // a connection in its resume exchange (close() cuts it)
  uint64_t gen_ GUARDED_BY(mu_) = 0;                 // bumped each time a connection is installed
  bool connected_ GUARDED_BY(mu_) = false;           // conn_ resumed and not failed
  std::string writer_error_ GUARDED_BY(mu_);         // why the writer failed on gen_, if it did
  Clock::time_point failed_at_ GUARDED_BY(mu_){};    // when the current outage began
  std::string last_error_ GUARDED_BY(mu_);           // why the last connection / attempt failed
  std::string outage_cause_ GUARDED_BY(mu_);         // why the last connection failed
  bool closed_ GUARDED_BY(mu_) = false;              // close() was called
  bool bye_wanted_ GUARDED_BY(mu_) = false;          // close() asks the writer for a kBye
  bool bye_done_ GUARDED_BY(mu_) = false;            // the writer wrote it
  bool lost_ GUARDED_BY(mu_) = false;                // peer lost; lost_message_ says why
  std::string lost_message_ GUARDED_BY(mu_);
  uint64_t peer_session_ GUARDED_BY(mu_) = 0;  // the peer's session id, once known

  // Sending direction.
  bool sending_ GUARDED_BY(mu_) = false;            // a send() has the turn (one at a time)
  uint64_t next_seq_ GUARDED_BY(mu_) = 1;           // seq of the next frame send() queues
  uint64_t acked_ GUARDED_BY(mu_) = 0;              // every seq <= acked_ is acknowledged and forgotten
  std::deque<PendingFrame> pending_ GUARDED_BY(mu_);  // seqs acked_+1 .. next_seq_-1
  uint64_t pending_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t next_write_seq_ GUARDED_BY(mu_) = 1;     // next seq the writer writes on conn_
  uint64_t write_offset_ GUARDED_BY(mu_) = 0;       // payload bytes of it already written as pieces
  Clock::time_point last_write_ GUARDED_BY(mu_){};  // when the writer last began a write on conn_
  uint64_t max_written_seq_ GUARDED_BY(mu_) = 0;    // highest seq ever written (to count re-sends)
  // Delivery-rate state (see "Estimates"): bytes acknowledged by kAck so far, when that last
  // grew (its `arrived`, or a write when an interval restarted), and the write time of the
  // frame it acknowledged.
  uint64_t delivered_bytes_ GUARDED_BY(mu_) = 0;
  Clock::time_point delivered_at_ GUARDED_BY(mu_){};
  bool delivered_at_idle_ GUARDED_BY(mu_) = true;  // delivered_at_ is a write's (an interval began idle), not an ack's
  Clock::time_point first_sent_ GUARDED_BY(mu_){};
  // After a resume, frames the peer held but had not delivered (seqs up to its `received`)
  // are acknowledged without being written again: rate samples only from frames written once
  // acked_ has passed them, so their bytes are not counted as delivered in an interval.
  uint64_t rate_clean_after_ GUARDED_BY(mu_) = 0;

  // Receiving direction.
  uint64_t received_ GUARDED_BY(mu_) = 0;            // highest contiguous seq held
  uint64_t delivered_ GUARDED_BY(mu_) = 0;           // highest seq recv() returned
  struct Arrived {
    wire::Frame frame;
    Clock::time_point at;  // when the reader had it whole
  };
  std::deque<Arrived> inbox_ GUARDED_BY(mu_);        // seqs delivered_+1 .. received_
  Clock::time_point delivered_arrived_ GUARDED_BY(mu_){};  // when frame delivered_ arrived (for the ack's held_ns)
  uint64_t last_ack_sent_ GUARDED_BY(mu_) = 0;       // `delivered` of the last ack or resume written
  uint64_t unacked_bytes_ GUARDED_BY(mu_) = 0;       // bytes delivered since then
  Clock::time_point ack_due_since_ GUARDED_BY(mu_){};  // when delivered_ first exceeded last_ack_sent_

  // RTT probes (see "Estimates"): ours, and the peer's waiting for an answer.
  bool ping_wanted_ GUARDED_BY(mu_) = false;       // a data frame was written with no probe in flight
  bool ping_outstanding_ GUARDED_BY(mu_) = false;  // ping ping_id_ written on ping_gen_, not answered yet
  uint64_t ping_id_ GUARDED_BY(mu_) = 0;
  uint64_t ping_gen_ GUARDED_BY(mu_) = 0;
  Clock::time_point ping_written_ GUARDED_BY(mu_){};  // taken before its write began
  bool pong_pending_ GUARDED_BY(mu_) = false;  // the peer's ping pong_id_ arrived at pong_arrived_
  uint64_t pong_id_ GUARDED_BY(mu_) = 0;
  Clock::time_point pong_arrived_ GUARDED_BY(mu_){};

  ResilienceStats counters_ GUARDED_BY(mu_);  // everything but link/pending/connected
  LinkStats retired_wire_ GUARDED_BY(mu_);    // wire bytes of the connections no longer held

  LinkCounters logical_;
  LinkEstimator estimator_;  // its own lock; fed under mu_, read without it

  std::thread reader_;
  std::thread writer_;
};

}  // namespace nebula::transport
