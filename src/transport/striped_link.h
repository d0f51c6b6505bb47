// StripedLink: one logical Link over N inner Links ("streams": N >= 1 TCP or TLS
// connections between the same two gateways), so that one logical link can fill a path
// whose bandwidth-delay product is larger than one TCP window.
//
// Sending. A logical frame's payload is cut into N contiguous chunks whose sizes are as
// equal as possible (chunk i has total/N bytes, plus one for i < total % N; a payload
// shorter than N gives some empty chunks; there is no small-frame threshold, so every
// frame takes the same path). Chunk i goes on stream i as one inner wire frame (type kData,
// op_id = the logical op_id, seq = the logical sequence number) whose payload is a
// kChunkHeaderSize-byte ChunkHeader followed by the chunk's bytes. Every stream carries
// exactly one chunk per logical frame, so the order of logical frames is the order of
// chunks on every stream. The N chunk sends run concurrently: send()'s own thread sends
// stream 0's chunk, persistent sender threads those of streams 1..N-1 (each builds its chunk
// frame, copy + CRC, then sends it); send() returns when all N were handed to their
// streams, and rethrows the first failure, typed.
//
// Receiving. A persistent receiver thread per stream reads chunk frames ahead (at most
// kReadAhead chunks per stream) into a queue, so no stream's kernel buffer fills while
// another is being read, and checks each chunk against its stream (format, index == the
// stream's, count == N, length consistent with the total, total <= max_payload). These
// threads read without a deadline of their own; close() wakes them. recv() waits, until its
// deadline, for the next chunk of every stream, checks that the N chunk headers agree
// (same logical seq, the expected one, and the same original header fields) -- any
// mismatch is FrameError kBadPayload naming the stream -- then rebuilds the original frame:
// its header as sent, with the checksum recomputed from the chunks (CRC-32 combined from
// the per-chunk CRCs the receiver threads computed, so it costs no extra pass) and compared
// with the checksum the sender carried (kBadChecksum if they differ). A recv() Timeout
// leaves the link usable: chunks that did arrive stay queued for the next call.
//
// Pairing. How the two ends pair their N connections is the caller's business: stream i
// must be the same connection on both ends (e.g. the index a hello frame carries), both ends
// must use the same N, and each inner link must accept frames of
// ceil(max_payload / N) + kChunkHeaderSize payload bytes.
//
// Errors. Any failure of any stream (PeerLost, Timeout, FrameError, a bad chunk) breaks the
// logical link: every stream is closed (so the peer sees PeerLost at once and blocked calls
// wake) and every later call throws PeerLost("... striped link to X broken after ...").
// Errors are rethrown with their type and the stream named in the message. A stream's
// error that arrives after complete frames does not hide them: recv() returns those first.
//
// peer(), peer_identity(), peer_fingerprint() and estimates() are stream 0's (streams
// measure nothing today; a ResilientLink above measures the striped link as a whole). The
// constructor checks that every stream authenticated the same identity and certificate
// (else AuthError), so an authenticated logical link cannot have a stream from someone else.
//
// Thread safety: as for every Link (link.h); concurrent recv() calls throw nebula::Error.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "transport/link.h"
#include "util/thread_annotations.h"

namespace nebula::transport {

// The prefix of every chunk's payload (little-endian, wire::ByteWriter encoding):
//   magic u32 kChunkMagic, version u8 kChunkVersion, type u8, flags u16, index u16,
//   count u16, logical_seq u64, op_id u64, seq u64, codec u8, total_len u64, checksum u32.
// type, flags, op_id, seq, codec, total_len (= payload_len) and checksum are the original
// frame's header fields; logical_seq counts logical frames on this StripedLink from 0.
struct ChunkHeader {
  static constexpr uint32_t kChunkMagic = 0x5354524E;  // "NRTS" on the wire
  static constexpr uint8_t kChunkVersion = 1;
  uint16_t index = 0;
  uint16_t count = 1;
  uint64_t logical_seq = 0;
  wire::FrameHeader original;  // payload_len = the whole payload's length
};
inline constexpr size_t kChunkHeaderSize = 4 + 1 + 1 + 2 + 2 + 2 + 8 + 8 + 8 + 1 + 8 + 4;

// Byte range of chunk `index` of `count` in a payload of `total` bytes: {offset, length}.
std::pair<uint64_t, uint64_t> chunk_range(uint64_t total, uint32_t count, uint32_t index);

// A chunk's prefix, as it starts the inner frame's payload.
std::array<uint8_t, kChunkHeaderSize> encode_chunk_header(const ChunkHeader& h);

// The inner frame carrying chunk h.index of a logical frame (h.original describes it),
// with `data` as its bytes. Public so tests can hand-craft chunks.
wire::Frame make_chunk_frame(const ChunkHeader& h, std::span<const uint8_t> data);

// Parses a chunk frame's prefix. Throws FrameError kBadPayload (bad magic/version/size,
// naming `what`); the original fields are not validated here.
ChunkHeader parse_chunk_header(const wire::Frame& chunk, const std::string& what);

class StripedLink : public Link {
 public:
  static constexpr size_t kMaxStreams = 1024;
  static constexpr size_t kReadAhead = 2;  // chunks a receiver thread holds per stream

  // Takes N >= 1 connected streams (N <= kMaxStreams), stream i paired with the peer's
  // stream i. `options.max_payload` bounds logical frames, both ways. Throws nebula::Error
  // for a null stream or a bad N, AuthError if the streams' peer identities differ.
  StripedLink(std::vector<std::unique_ptr<Link>> streams, LinkOptions options = {});
  ~StripedLink() override;  // closes and joins the stream threads
  StripedLink(const StripedLink&) = delete;
  StripedLink& operator=(const StripedLink&) = delete;

  void send(const wire::Frame& frame, Deadline deadline) override;
  // Each stream's chunk goes out as its chunk header and the parts' bytes in its range,
  // where they lie (no copy).
  void send_parts(const wire::FrameHeader& header, PayloadParts parts, Deadline deadline) override;
  wire::Frame recv(Deadline deadline) override;
  // Closes every stream; idempotent. Blocked and later calls throw PeerLost.
  void close() override;
  std::string peer() const override { return streams_[0]->link->peer(); }
  std::string peer_identity() const override { return streams_[0]->link->peer_identity(); }
  std::string peer_fingerprint() const override { return streams_[0]->link->peer_fingerprint(); }
  LinkEstimates estimates() const override { return streams_[0]->link->estimates(); }
  // Logical traffic, as the caller sees it: frames sent/received and their bytes
  // (kHeaderSize + payload each), not the chunk frames on the streams (see stream_stats()).
  LinkStats stats() const override;

  size_t num_streams() const { return streams_.size(); }
  // Each stream's own stats (chunk frames, their headers and chunk headers included).
  std::vector<LinkStats> stream_stats() const;

 private:
  struct Received {  // one entry of a stream's read-ahead queue: a chunk or the stream's error
    wire::Frame frame;
    ChunkHeader header;
    uint32_t data_crc = 0;  // CRC-32 of the chunk's bytes alone
    std::exception_ptr error;
    uint64_t error_order = 0;  // errors_seen_ when queued: recv() reports the earliest
  };
  struct Stream {
    size_t index = 0;
    std::unique_ptr<Link> link;
    // Send job, GUARDED_BY(StripedLink::mu_): set by send(), cleared by the sender thread.
    // The header and parts are send()'s, valid until every stream's job is done.
    bool has_job = false;
    const wire::FrameHeader* job_header = nullptr;
    PayloadParts job_parts;
    uint64_t job_seq = 0;
    Deadline job_deadline = Deadline::never();
    std::deque<Received> received;  // GUARDED_BY(StripedLink::mu_); an error entry is the last
    std::thread sender, receiver;
  };

  void sender_loop(Stream& s);
  // Sends frame's chunk for stream s (any thread, mu_ not held); on failure records the
  // first error in send_error_, breaks the link, and returns the error.
  std::exception_ptr send_chunk(Stream& s, const wire::FrameHeader& original, PayloadParts parts, uint64_t seq,
                                Deadline deadline) EXCLUDES(mu_);
  void receiver_loop(Stream& s);
  // Records the first failure, closes every stream; logs at warn, or at debug when `quiet`
  // (the stream already logged why). Caller holds no lock.
  void break_link(const std::string& reason, bool quiet = false) EXCLUDES(mu_);
  // Throws PeerLost if the link was closed or broken. Caller holds mu_.
  void throw_if_unusable_locked(const char* what) const REQUIRES(mu_);
  std::string stream_name(size_t i) const;

  const LinkOptions options_;
  std::vector<std::unique_ptr<Stream>> streams_;  // fixed after construction

  Mutex send_mu_;       // held for a whole send(): logical frames go out whole, in order
  uint64_t send_seq_ GUARDED_BY(send_mu_) = 0;
  std::mutex recv_mu_;  // try-locked by recv() to detect concurrent receivers; guards nothing
  uint64_t recv_seq_ = 0;  // the receiving thread's (recv_mu_ refuses a second one)

  mutable Mutex mu_;
  std::condition_variable_any send_cv_;  // a job was posted or finished, or closed_
  std::condition_variable_any recv_cv_;  // a chunk or error was queued, a queue drained, closed or broken
  size_t jobs_pending_ GUARDED_BY(mu_) = 0;          // chunk sends of the current send() not done
  std::exception_ptr send_error_ GUARDED_BY(mu_);    // first failure of the current send()
  uint64_t errors_seen_ GUARDED_BY(mu_) = 0;         // stream receive errors so far
  bool closed_ GUARDED_BY(mu_) = false;              // close() was called; idle threads exit
  std::optional<std::string> broken_reason_ GUARDED_BY(mu_);  // set once

  LinkCounters counters_;
  std::thread closer_;  // closes the streams after a failure; written once by break_link()
};

}  // namespace nebula::transport
