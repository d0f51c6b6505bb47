// Link: a bidirectional, ordered, reliable channel of wire::Frames to one peer site.
//
// Like gloo's transport Pair, everything above this layer talks to a Link and never to a
// socket: TLS, multi-stream striping and WAN emulation are Links that wrap another Link.
//
// Thread safety (every implementation must honour this):
//  * one thread may be in send() while another is in recv();
//  * concurrent send() calls are serialized internally (each frame goes out whole,
//    in the order the calls took the link's send lock);
//  * concurrent recv() calls are NOT allowed (implementations may detect it and throw
//    nebula::Error);
//  * close(), peer(), stats() and estimates() may be called from any thread at any time; close()
//    wakes a blocked send()/recv(), which then throws PeerLost.
//
// Errors (CONVENTIONS.md, "Two kinds of error"):
//  * PeerLost(peer, ...)  the peer closed or reset the connection, a write hit EPIPE, the
//                         link was closed locally, or an earlier failure broke it;
//  * Timeout(peer, ...)   the Deadline passed. If nothing of the frame had been moved yet
//                         the link stays usable; if a frame was partly moved the byte
//                         stream is out of step, so the link is marked broken and every
//                         later call throws PeerLost("link ... broken after ...");
//  * FrameError           the peer sent an invalid frame; the link is broken afterwards
//                         (close it and reconnect).
//  * nebula::Error        a violated precondition (e.g. a frame whose payload size does
//                         not match its header).
// Messages name the peer and the operation, e.g.
//   "recv header from site-b (127.0.0.1:4242): frame header: bad magic ...".
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "nebula/deadline.h"
#include "nebula/error.h"
#include "wire/frame.h"

namespace nebula::transport {

// Counters since the link was created. Bytes include frame headers.
struct LinkStats {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t frames_sent = 0;
  uint64_t frames_received = 0;
  // What crossed the sockets underneath, over every connection the link used: TCP payload
  // bytes, so with TLS the records (headers, tags, handshakes), and everything of the layers
  // in between (acks, probes, heartbeats, pieces' and stripes' headers, re-sends, hellos).
  // The counters above are the caller's frames; these are the network's.
  uint64_t wire_bytes_sent = 0;
  uint64_t wire_bytes_received = 0;
};

// a += b, field by field (totals over several links).
inline void add(LinkStats& a, const LinkStats& b) {
  a.bytes_sent += b.bytes_sent;
  a.bytes_received += b.bytes_received;
  a.frames_sent += b.frames_sent;
  a.frames_received += b.frames_received;
  a.wire_bytes_sent += b.wire_bytes_sent;
  a.wire_bytes_received += b.wire_bytes_received;
}

// The counters behind LinkStats, updated by any thread without a lock.
struct LinkCounters {
  std::atomic<uint64_t> bytes_sent{0}, bytes_received{0}, frames_sent{0}, frames_received{0};
  static void add(std::atomic<uint64_t>& c, uint64_t n) { c.fetch_add(n, std::memory_order_relaxed); }
  // Wire counters left at zero: the link fills them from the layer underneath.
  LinkStats snapshot() const {
    return {bytes_sent.load(std::memory_order_relaxed), bytes_received.load(std::memory_order_relaxed),
            frames_sent.load(std::memory_order_relaxed), frames_received.load(std::memory_order_relaxed)};
  }
};

// What a link measured of its path: estimates for strategies and the adaptive controller
// (how much to compress, how often to synchronise, how to split work between sites), taken
// from the link's own recent traffic. They describe what was seen, not what the next
// transfer will get: no guarantee, and stale after the path changes until traffic shows it.
// A value of 0 means "unknown" (nothing measured yet); fall back to configuration then.
struct LinkEstimates {
  // Round-trip time in seconds: the minimum of recent samples (windowed min filter), i.e.
  // propagation delay plus the least queueing seen (BBR's min_rtt). 0 = unknown.
  double rtt_s = 0;
  // Exponentially weighted moving average (alpha 1/8, like TCP's SRTT) of the same samples,
  // in seconds. Includes queueing: rtt_smoothed_s well above rtt_s means a standing queue.
  double rtt_smoothed_s = 0;
  // Delivery rate in bits per second (wire bytes, frame headers included, times 8): the
  // maximum of recent samples (windowed max filter), i.e. the bottleneck bandwidth as far as
  // the traffic probed it (BBR's btl_bw). A link that never carried much data reports the
  // rate it reached, which can be below the path's capacity. 0 = unknown.
  double bandwidth_bits_per_s = 0;
  // The maximum sample is a lower bound, not a measurement of the path: its transfer was shorter
  // than a round trip, so its interval still held the round trip (bytes / (transfer + RTT)).
  // Exchanges smaller than the path's bandwidth-delay product only ever measure so; a larger
  // transfer may show more. Report the figure as ">= bandwidth_bits_per_s".
  bool bandwidth_at_least = false;
  uint64_t rtt_samples = 0;        // samples accepted since the link was created
  uint64_t bandwidth_samples = 0;  // likewise
};

struct LinkOptions {
  // Largest payload this side accepts (recv) or sends (send). A header claiming more is
  // rejected with FrameError kTooLarge before anything is allocated; hellos and control
  // frames have smaller limits of their own (wire::max_payload_of).
  uint64_t max_payload = 1ull << 31;
  // TCP sockets only (0 = the kernel's defaults): TCP_USER_TIMEOUT, so that data written but
  // not acknowledged by the peer's kernel for this long fails the connection, and
  // SO_KEEPALIVE probing an idle connection after a third of it (at least 1 s). A path that
  // drops everything silently (a black hole, a NAT or firewall that forgot the connection)
  // then ends the connection instead of hanging it; ResilientLink's heartbeats
  // (ResilientOptions::liveness_timeout) catch the same above TLS.
  std::chrono::milliseconds tcp_user_timeout{0};
};

// A payload given as byte ranges in caller memory: the frame's payload is their
// concatenation, in order (see Link::send_parts).
using PayloadParts = std::span<const std::span<const uint8_t>>;

// The parts' total length.
uint64_t parts_size(PayloadParts parts);

class Link {
 public:
  virtual ~Link();

  // Sends one frame. `frame.payload.size()` must equal `frame.header.payload_len`, and the
  // header's checksum must already be right (wire::make_frame does both). Returns once
  // the frame has been handed to the layer below (for TCP: the kernel's socket buffer),
  // not when the peer has received it.
  virtual void send(const wire::Frame& frame, Deadline deadline) = 0;

  // Sends the frame send() would send for {header, the concatenation of `parts`}, reading
  // the parts where they lie (caller memory, read before this returns) instead of having
  // the caller first copy them into one Frame. `header.payload_len` must equal the parts'
  // total and `header.checksum` must be right for the joined bytes. Same errors as send().
  // The default joins the parts (one copy) and calls send(); TcpLink and TlsLink write them
  // as they are and StripedLink cuts its chunks from them, so a piece of a large frame
  // crosses the session stack without being copied.
  virtual void send_parts(const wire::FrameHeader& header, PayloadParts parts, Deadline deadline);

  // send() for a frame the caller will not change again: a link that keeps what it sends
  // (ResilientLink, until the peer acknowledges it) keeps this frame instead of a copy, and
  // one frame can go to several links. The default calls send(*frame).
  virtual void send_shared(std::shared_ptr<const wire::Frame> frame, Deadline deadline);

  // Receives the next frame, validated: header fields, length limit and checksum.
  virtual wire::Frame recv(Deadline deadline) = 0;

  // Closes the link; idempotent. Blocked and later calls throw PeerLost.
  virtual void close() = 0;
  // Waits until the peer has received everything sent so far, where the link can know it
  // (ResilientLink: acknowledged); call it before close() for an orderly end. The default
  // has nothing to wait for: a plain connection's close() lets the kernel deliver what it
  // holds. Throws PeerLost / Timeout like send().
  virtual void flush(Deadline deadline) {}

  // The peer's name as used in error messages and NetworkError::peer(), e.g. "site-b".
  virtual std::string peer() const = 0;

  virtual LinkStats stats() const = 0;

  // The peer's authenticated identity: the site name in its verified certificate, and the
  // SHA-256 fingerprint of that certificate (hex). Empty for unauthenticated (plaintext)
  // links. Wrappers (emulation, striping) forward their inner link's.
  virtual std::string peer_identity() const { return {}; }
  virtual std::string peer_fingerprint() const { return {}; }

  // Round-trip time and bandwidth measured on this link's traffic (see LinkEstimates: an
  // estimate, not a guarantee). All zero for links that measure nothing (TcpLink, TlsLink);
  // wrappers (emulation, striping) forward their inner link's; ResilientLink measures its
  // session (transport/resilient_link.h). Cheap; any thread, any time.
  virtual LinkEstimates estimates() const { return {}; }
};

}  // namespace nebula::transport
