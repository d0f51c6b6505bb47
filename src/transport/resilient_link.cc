#include "transport/resilient_link.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <random>

namespace nebula::transport {
namespace {

using wire::FrameType;

uint64_t wire_size(const wire::Frame& f) { return wire::kHeaderSize + f.payload.size(); }

uint64_t random_session_id() {
  std::random_device rd;
  uint64_t id = 0;
  while (id == 0) id = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return id;
}

double seconds(Clock::duration d) { return std::max(0.0, std::chrono::duration<double>(d).count()); }

long long ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

// "30 s" or "500 ms".
std::string duration_text(std::chrono::milliseconds d) {
  if (d.count() % 1000 == 0) return str_cat(d.count() / 1000, " s");
  return str_cat(d.count(), " ms");
}

wire::Frame u64_frame(FrameType type, std::initializer_list<uint64_t> values) {
  wire::ByteWriter w;
  for (uint64_t v : values) w.put_u64(v);
  return wire::make_frame(type, 0, 0, w.take());
}

}  // namespace

ResilientLink::ResilientLink(std::unique_ptr<Link> first, Reconnect reconnect, ResilientOptions options)
    : reconnect_(std::move(reconnect)), options_(options), session_id_(random_session_id()) {
  NEBULA_CHECK(static_cast<bool>(reconnect_), "ResilientLink needs a reconnect function");
  NEBULA_CHECK(options.reconnect_timeout.count() > 0, "reconnect_timeout must be positive, got ",
               options.reconnect_timeout.count(), " ms");
  NEBULA_CHECK(options.backoff_initial.count() >= 0 && options.backoff_max >= options.backoff_initial,
               "need 0 <= backoff_initial <= backoff_max, got ", options.backoff_initial.count(), " ms and ",
               options.backoff_max.count(), " ms");
  NEBULA_CHECK(options.attempt_timeout.count() > 0, "attempt_timeout must be positive, got ",
               options.attempt_timeout.count(), " ms");
  NEBULA_CHECK(options.max_pending_bytes > 0, "max_pending_bytes must be positive");
  NEBULA_CHECK(options.ack_interval.count() >= 0, "ack_interval must not be negative, got ",
               options.ack_interval.count(), " ms");
  NEBULA_CHECK(options.ack_every_frames > 0, "ack_every_frames must be positive");
  NEBULA_CHECK(options.fragment_bytes > 0, "fragment_bytes must be positive");
  NEBULA_CHECK(options.liveness_timeout.count() >= 0, "liveness_timeout must not be negative, got ",
               options.liveness_timeout.count(), " ms");
  if (first) first_peer_ = first->peer();
  failed_at_ = Clock::now();
  writer_ = std::thread([this] { writer_main(); });
  reader_ = std::thread([this, f = std::move(first)]() mutable { reader_main(std::move(f)); });
}

ResilientLink::~ResilientLink() {
  close();
  if (reader_.joinable()) reader_.join();
  if (writer_.joinable()) writer_.join();
}

// ---------------------------------------------------------------------------------------
// Caller-facing calls.

void ResilientLink::send(const wire::Frame& frame, Deadline deadline) {
  enqueue(std::make_shared<const wire::Frame>(frame), deadline);
}

void ResilientLink::send_shared(std::shared_ptr<const wire::Frame> frame, Deadline deadline) {
  NEBULA_CHECK(frame != nullptr, "send_shared to ", peer(), ": null frame");
  enqueue(std::move(frame), deadline);
}

void ResilientLink::enqueue(FramePtr frame, Deadline deadline) {
  NEBULA_CHECK(frame->payload.size() == frame->header.payload_len, "send to ", peer(), ": payload has ",
               frame->payload.size(), " bytes but header.payload_len is ", frame->header.payload_len);
  const FrameType type = frame->header.type;
  NEBULA_CHECK(type != FrameType::kAck && type != FrameType::kResume && type != FrameType::kBye &&
                   type != FrameType::kPing && type != FrameType::kPong && type != FrameType::kHeartbeat &&
                   type != FrameType::kPart,
               "send to ", peer(), ": frame type ", wire::frame_type_name(type),
               " is reserved for ResilientLink's session protocol");
  // One send() at a time (seq order == call order); a call waiting for its turn still times
  // out at its own deadline. A flag under mu_ rather than a std::timed_mutex, whose
  // try_lock_until (pthread_mutex_clocklock) ThreadSanitizer does not see, so that it reports
  // every unlock as "unlock of an unlocked mutex".
  MutexLock lock(mu_);
  const bool turn = wait_until(send_cv_, mu_, deadline, [&]() REQUIRES(mu_) { return closed_ || lost_ || !sending_; });
  throw_if_over_locked("send to");
  if (!turn)
    throw Timeout(peer_locked(), str_cat("send to ", peer_locked(),
                                         ": deadline passed waiting behind another send()", waiting_detail_locked()));
  sending_ = true;
  struct TurnEnd {  // gives the turn back on every way out (all with mu_ held)
    ResilientLink* self;
    ~TurnEnd() NO_THREAD_SAFETY_ANALYSIS {
      self->sending_ = false;
      self->send_cv_.notify_all();
    }
  } turn_end{this};
  const uint64_t seq = next_seq_;  // stable: only send() advances it, and this call has the turn
  // Re-checksum outside mu_ (nothing here throws): the reader, writer and recv() need not wait.
  lock.unlock();
  wire::FrameHeader header = frame->header;
  header.seq = seq;
  // A frame that goes in pieces is never written whole: each piece gets its own checksum.
  header.checksum =
      frame->payload.size() <= options_.fragment_bytes ? wire::compute_checksum(header, frame->payload) : 0;
  const uint64_t size = wire_size(*frame);
  lock.lock();

  bool room = wait_until(send_cv_, mu_, deadline, [&]() REQUIRES(mu_) {
    return closed_ || lost_ || pending_.empty() || pending_bytes_ + size <= options_.max_pending_bytes;
  });
  throw_if_over_locked("send to");
  if (!room)
    throw Timeout(peer_locked(), str_cat("send to ", peer_locked(), ": deadline passed waiting for room: ",
                                         pending_bytes_, " bytes in ", pending_.size(),
                                         " frames unacknowledged (max_pending_bytes ", options_.max_pending_bytes,
                                         "); the frame was not sent", waiting_detail_locked()));
  pending_.push_back(PendingFrame{header, std::move(frame), {}});
  pending_bytes_ += size;
  ++next_seq_;
  LinkCounters::add(logical_.frames_sent, 1);
  LinkCounters::add(logical_.bytes_sent, size);
  writer_cv_.notify_one();
}

wire::Frame ResilientLink::recv(Deadline deadline) {
  std::unique_lock<std::mutex> recv_lock(recv_mu_, std::try_to_lock);
  NEBULA_CHECK(recv_lock.owns_lock(), "concurrent recv() on the resilient link to ", peer(),
               " (one receiving thread per link; see transport/link.h)");
  MutexLock lock(mu_);
  wait_until(recv_cv_, mu_, deadline, [&]() REQUIRES(mu_) { return closed_ || lost_ || !inbox_.empty(); });
  // Frames that arrived before the peer said goodbye (or was lost) are still delivered.
  if (closed_ || inbox_.empty()) throw_if_over_locked("recv from");
  if (inbox_.empty())
    throw Timeout(peer_locked(), str_cat("recv from ", peer_locked(), ": deadline passed", waiting_detail_locked()));
  wire::Frame f = std::move(inbox_.front().frame);
  delivered_arrived_ = inbox_.front().at;
  inbox_.pop_front();
  const bool first_unacked = delivered_ == last_ack_sent_;
  if (first_unacked) ack_due_since_ = Clock::now();
  delivered_ = f.header.seq;
  const uint64_t size = wire_size(f);
  unacked_bytes_ += size;
  if (first_unacked || ack_urgent_locked()) writer_cv_.notify_one();
  LinkCounters::add(logical_.frames_received, 1);
  LinkCounters::add(logical_.bytes_received, size);
  return f;
}

void ResilientLink::flush(Deadline deadline) {
  MutexLock lock(mu_);
  wait_until(send_cv_, mu_, deadline, [&]() REQUIRES(mu_) { return closed_ || lost_ || pending_.empty(); });
  throw_if_over_locked("flush to");
  if (!pending_.empty())
    throw Timeout(peer_locked(), str_cat("flush to ", peer_locked(), ": deadline passed with ", pending_.size(),
                                         " frames (", pending_bytes_, " bytes) unacknowledged",
                                         waiting_detail_locked()));
}

void ResilientLink::close() {
  std::shared_ptr<Link> conn, candidate;
  {
    MutexLock lock(mu_);
    if (closed_) return;
    // An orderly end: tell the peer, so that it does not try to reconnect for
    // reconnect_timeout. Best effort: a peer that misses it finds out the slow way. The
    // writer writes it (ahead of anything else), so that close() never waits on the
    // connection's send lock behind a write stuck on a dead path: 200 ms at most.
    if (options_.goodbye && connected_ && conn_ && !lost_) {
      bye_wanted_ = true;
      writer_cv_.notify_all();
      wait_until(send_cv_, mu_, Deadline::after(std::chrono::milliseconds(200)),
                 [&]() REQUIRES(mu_) { return bye_done_ || !connected_ || lost_ || closed_; });
      if (closed_) return;
    }
    closed_ = true;
    connected_ = false;
    conn = conn_;
    candidate = candidate_;
    send_cv_.notify_all();
    recv_cv_.notify_all();
    writer_cv_.notify_all();
    reader_cv_.notify_all();
  }
  // Wakes the reader and writer if they are blocked on the connection.
  if (conn) conn->close();
  if (candidate) candidate->close();
}

std::string ResilientLink::peer() const {
  MutexLock lock(mu_);
  return peer_locked();
}

std::string ResilientLink::peer_locked() const {
  if (conn_) return conn_->peer();
  if (candidate_) return candidate_->peer();
  return first_peer_.empty() ? std::string("peer") : first_peer_;
}

std::string ResilientLink::peer_identity() const {
  MutexLock lock(mu_);
  return conn_ ? conn_->peer_identity() : candidate_ ? candidate_->peer_identity() : std::string();
}

std::string ResilientLink::peer_fingerprint() const {
  MutexLock lock(mu_);
  return conn_ ? conn_->peer_fingerprint() : candidate_ ? candidate_->peer_fingerprint() : std::string();
}

LinkStats ResilientLink::stats() const {
  LinkStats s = logical_.snapshot();
  MutexLock lock(mu_);
  s.wire_bytes_sent = retired_wire_.wire_bytes_sent;
  s.wire_bytes_received = retired_wire_.wire_bytes_received;
  for (const auto* c : {conn_.get(), candidate_.get()}) {
    if (!c) continue;
    const LinkStats w = c->stats();
    s.wire_bytes_sent += w.wire_bytes_sent;
    s.wire_bytes_received += w.wire_bytes_received;
  }
  return s;
}

void ResilientLink::retire_locked(const Link& conn) {
  const LinkStats w = conn.stats();
  retired_wire_.wire_bytes_sent += w.wire_bytes_sent;
  retired_wire_.wire_bytes_received += w.wire_bytes_received;
}

LinkEstimates ResilientLink::estimates() const { return estimator_.snapshot(); }

ResilienceStats ResilientLink::stats_ex() const {
  MutexLock lock(mu_);
  ResilienceStats s = counters_;
  s.link = logical_.snapshot();
  s.pending_frames = pending_.size();
  s.pending_bytes = pending_bytes_;
  s.connected = connected_;
  return s;
}

// ---------------------------------------------------------------------------------------
// Helpers (mu_ held).

void ResilientLink::throw_if_over_locked(const char* what) const {
  if (closed_) throw PeerLost(peer_locked(), str_cat(what, " ", peer_locked(), ": link was closed locally"));
  if (lost_) throw PeerLost(peer_locked(), str_cat(what, " ", peer_locked(), ": ", lost_message_));
}

std::string ResilientLink::waiting_detail_locked() const {
  if (connected_ || closed_ || lost_) return {};
  if (last_error_.empty()) return str_cat(" (connecting for ", ms_since(failed_at_), " ms)");
  return str_cat(" (reconnecting for ", ms_since(failed_at_), " ms; last error: ", last_error_, ")");
}

bool ResilientLink::ack_urgent_locked() const {
  return delivered_ - last_ack_sent_ >= options_.ack_every_frames ||
         unacked_bytes_ >= std::max<uint64_t>(options_.max_pending_bytes / 4, 1);
}

void ResilientLink::acknowledge_locked(uint64_t delivered) {
  if (delivered <= acked_) return;
  while (acked_ < delivered && !pending_.empty()) {
    pending_bytes_ -= wire_size(*pending_.front().frame);
    pending_.pop_front();
    ++acked_;
  }
  acked_ = delivered;
  if (next_write_seq_ <= acked_) {
    next_write_seq_ = acked_ + 1;
    write_offset_ = 0;
  }
  send_cv_.notify_all();
}

void ResilientLink::ack_received_locked(uint64_t delivered, Clock::duration held, uint64_t gen) {
  const Clock::time_point now = Clock::now();
  const WriteRecord p = pending_[delivered - acked_ - 1].write;  // the newest newly acked frame
  const uint64_t before = pending_bytes_;
  acknowledge_locked(delivered);
  delivered_bytes_ += before - pending_bytes_;
  const bool timed = p.gen == gen;  // else written on an older connection, or its write not finished yet
  // When the ack would have come had the peer acknowledged P on arrival: the time the peer
  // held P (waiting for its caller, its ack timer, its writer busy with its own frames) is
  // the peer's, not the path's. It cannot have held P longer than since P's write.
  const Clock::time_point arrived = timed ? now - std::min(std::max(held, Clock::duration::zero()), now - p.written) : now;
  delivered_at_ = arrived;
  delivered_at_idle_ = false;
  if (!timed) return;
  first_sent_ = p.written;
  if (p.rate_ok) {
    double interval = std::max(seconds(p.written - p.first_sent), seconds(arrived - p.delivered_at));
    // An interval that began with an idle link (nothing outstanding) runs from the first byte
    // written to the ack: the transfer plus one round trip, which is the path's latency, not
    // its bandwidth (the controller adds the RTT itself). A single exchange-sized frame is
    // all the traffic there is between long pauses, so leaving it in would cap the estimate
    // at bytes / (bytes / bandwidth + rtt). Subtracted only when the transfer took at least
    // as long as the round trip, so an error in the RTT can at most double the rate.
    // Shorter (or with no RTT measured yet), the round trip stays in: the sample is a lower
    // bound on the path (LinkEstimates::bandwidth_at_least).
    bool lower_bound = false;
    if (p.idle_start) {
      const double rtt = estimator_.snapshot().rtt_s;
      if (rtt > 0 && interval >= 2 * rtt)
        interval -= rtt;
      else
        lower_bound = true;
    }
    estimator_.on_delivery(delivered_bytes_ - p.delivered_bytes, interval, now, p.app_limited, lower_bound);
  }
}

std::shared_ptr<Link> ResilientLink::declare_lost_locked(const std::string& message) {
  if (lost_ || closed_) return nullptr;
  lost_ = true;
  connected_ = false;
  lost_message_ = message;
  spdlog::error("session with {}: {}", peer_locked(), message);
  send_cv_.notify_all();
  recv_cv_.notify_all();
  writer_cv_.notify_all();
  reader_cv_.notify_all();
  return conn_;
}

// ---------------------------------------------------------------------------------------
// Writer thread: writes queued frames in seq order and acks, on the current connection.

void ResilientLink::connection_failed(uint64_t gen, const std::string& why) {
  std::shared_ptr<Link> conn;
  {
    MutexLock lock(mu_);
    if (gen != gen_ || !connected_) return;  // already noticed (or closed): the reader handles it
    connected_ = false;
    writer_error_ = why;
    conn = conn_;
  }
  conn->close();  // the reader wakes up and reconnects
}

void ResilientLink::writer_main() {
  const auto heartbeat_every = options_.liveness_timeout / 4;
  MutexLock lock(mu_);
  for (;;) {
    if (closed_ || lost_) return;
    if (!connected_) {
      writer_cv_.wait(mu_);
      continue;
    }
    const Clock::time_point now = Clock::now();
    const bool ack_pending = delivered_ > last_ack_sent_;
    const bool bye = bye_wanted_;
    const auto ack_due_at = ack_due_since_ + options_.ack_interval;
    const bool heartbeats = heartbeat_every.count() > 0;
    const auto heartbeat_due_at = last_write_ + heartbeat_every;
    // What to write next, most urgent first: the session's control frames go between the
    // pieces of a large frame, so none waits behind more than one piece.
    FramePtr frame;              // a control frame, written as is
    FramePtr body;               // or a caller's: its payload [piece_at, piece_at + piece_len)
    wire::FrameHeader body_header;  // with the session's header (PendingFrame::header)
    uint64_t piece_at = 0, piece_len = 0;
    uint64_t data_seq = 0;  // seq of the caller's frame whose last byte this write carries, else 0
    bool data = false;      // this write carries a caller's bytes
    if (bye) {
      frame = std::make_shared<wire::Frame>(wire::make_frame(FrameType::kBye, 0, 0, {}));
      bye_wanted_ = false;
    } else if (ack_pending && (ack_urgent_locked() || now >= ack_due_at)) {
      // With how long the newest delivered frame was held here since it arrived (QUIC's
      // ack delay), so the peer's estimates leave this side's waiting out.
      const auto held = std::chrono::duration_cast<std::chrono::nanoseconds>(now - delivered_arrived_);
      frame = std::make_shared<wire::Frame>(
          u64_frame(FrameType::kAck, {delivered_, static_cast<uint64_t>(std::max<int64_t>(held.count(), 0))}));
      last_ack_sent_ = delivered_;
      unacked_bytes_ = 0;
      ++counters_.acks_sent;
    } else if (pong_pending_) {
      const auto held = std::chrono::duration_cast<std::chrono::nanoseconds>(now - pong_arrived_);
      frame = std::make_shared<wire::Frame>(
          u64_frame(FrameType::kPong, {pong_id_, static_cast<uint64_t>(std::max<int64_t>(held.count(), 0))}));
      pong_pending_ = false;
    } else if (ping_wanted_) {
      // Stamped before the write, so that nothing can make the sample shorter than the path.
      frame = std::make_shared<wire::Frame>(u64_frame(FrameType::kPing, {++ping_id_}));
      ping_wanted_ = false;
      ping_outstanding_ = true;
      ping_gen_ = gen_;
      ping_written_ = now;
    } else if (next_write_seq_ < next_seq_) {
      PendingFrame& p = pending_[next_write_seq_ - acked_ - 1];
      const uint64_t seq = next_write_seq_;
      const uint64_t size = p.frame->payload.size();
      if (write_offset_ == 0) {  // the frame's first byte on this connection
        if (seq <= max_written_seq_) {
          ++counters_.frames_resent;
          counters_.bytes_resent += wire_size(*p.frame);
        } else {
          max_written_seq_ = seq;
        }
        // Nothing outstanding: the delivery interval starts with this write, so idle time
        // before it never counts.
        if (seq == acked_ + 1) {
          delivered_at_ = first_sent_ = now;
          delivered_at_idle_ = true;
        }
        p.write = WriteRecord{0,   {}, delivered_bytes_, delivered_at_, first_sent_, seq + 1 == next_seq_,
                              acked_ >= rate_clean_after_, delivered_at_idle_};
      }
      data = true;
      body = p.frame;
      body_header = p.header;
      piece_at = write_offset_;
      piece_len = size <= options_.fragment_bytes ? size : std::min(options_.fragment_bytes, size - piece_at);
      if (size > options_.fragment_bytes) ++counters_.pieces_sent;
      write_offset_ += piece_len;
      if (write_offset_ == size) {  // its last byte: the next frame is next
        data_seq = seq;
        ++next_write_seq_;
        write_offset_ = 0;
      }
    } else if (heartbeats && now >= heartbeat_due_at) {
      frame = std::make_shared<wire::Frame>(wire::make_frame(FrameType::kHeartbeat, 0, 0, {}));
      ++counters_.heartbeats_sent;
    } else {
      Clock::time_point wake = Clock::time_point::max();
      if (ack_pending) wake = ack_due_at;
      if (heartbeats) wake = std::min(wake, heartbeat_due_at);
      if (wake == Clock::time_point::max())
        writer_cv_.wait(mu_);
      else
        writer_cv_.wait_until(mu_, wake);
      continue;
    }
    last_write_ = now;
    std::shared_ptr<Link> conn = conn_;
    const uint64_t gen = gen_;
    lock.unlock();
    try {
      if (body) {
        // Written from the caller's bytes where they lie: whole, or as a piece with its own
        // header and checksum (the CRC here, outside the lock).
        const std::span<const uint8_t> bytes = std::span<const uint8_t>(body->payload).subspan(piece_at, piece_len);
        wire::FrameHeader h = body_header;
        if (piece_len != body->payload.size()) {
          if (piece_at + piece_len < body->payload.size()) {  // not the last piece
            h = wire::FrameHeader{};
            h.type = FrameType::kPart;
            h.op_id = body->payload.size();
            h.seq = body_header.seq;
          }
          h.payload_len = piece_len;
          h.checksum = wire::compute_checksum(h, bytes);
        }
        conn->send_parts(h, PayloadParts(&bytes, 1), Deadline::never());
      } else {
        // No deadline: close() of the connection (by the reader, close() or a failure) wakes it.
        conn->send(*frame, Deadline::never());
      }
      if (bye) {
        MutexLock relock(mu_);
        bye_done_ = true;
        send_cv_.notify_all();
      }
      if (data) {
        const Clock::time_point written = Clock::now();
        MutexLock relock(mu_);
        if (data_seq != 0 && gen == gen_ && data_seq > acked_) {
          WriteRecord& w = pending_[data_seq - acked_ - 1].write;
          w.gen = gen;
          w.written = written;
        }
        if (gen == gen_ && !ping_outstanding_) ping_wanted_ = true;  // one RTT probe in flight at a time
      }
    } catch (const NetworkError& e) {
      connection_failed(gen, e.what());
    } catch (const FrameError& e) {
      connection_failed(gen, e.what());
    } catch (const std::exception& e) {
      // A precondition of the link underneath (e.g. its max_payload): resending cannot help.
      std::shared_ptr<Link> to_close;
      {
        MutexLock relock(mu_);
        to_close = declare_lost_locked(str_cat("session failed: ", e.what()));
      }
      if (to_close) to_close->close();
    }
    lock.lock();
  }
}

// ---------------------------------------------------------------------------------------
// Reader thread: reads frames, and is the only thread that reconnects.

bool ResilientLink::resume_on(const std::shared_ptr<Link>& conn, Deadline deadline) {
  uint64_t sent_delivered, sent_received;
  {
    MutexLock lock(mu_);
    sent_delivered = delivered_;
    sent_received = received_;  // stable: only this thread changes it
  }
  conn->send(u64_frame(FrameType::kResume, {session_id_, sent_delivered, sent_received}), deadline);
  wire::Frame f = conn->recv(deadline);
  if (f.header.type != FrameType::kResume)
    throw FrameError(FrameError::Kind::kBadPayload,
                     str_cat("resume with ", conn->peer(), ": expected a resume frame first, got a ",
                             wire::frame_type_name(f.header.type), " frame (is the peer a ResilientLink?)"));
  wire::ByteReader r(f.payload, str_cat("resume frame from ", conn->peer()));
  const uint64_t their_session = r.u64(), their_delivered = r.u64(), their_received = r.u64();
  r.expect_done();

  std::shared_ptr<Link> old;
  MutexLock lock(mu_);
  if (closed_ || lost_) return false;
  if (peer_session_ != 0 && their_session != peer_session_) {
    declare_lost_locked(str_cat(conn->peer(), " lost: it came back as a new session (", their_session,
                                " instead of ", peer_session_,
                                "), so it restarted and what it had not yet received cannot be resumed"));
    return false;
  }
  const bool fits = their_delivered <= their_received && their_received < next_seq_ && their_delivered >= acked_;
  if (!fits && peer_session_ == 0)
    // This session never got going and the other end remembers one that did: it is an older
    // session of the peer (we restarted; the peer's side of our old session reconnected). That
    // end will find out it lost us; this connection is stale, not the session: try again.
    throw PeerLost(conn->peer(), str_cat(conn->peer(), " answered as an older session (delivered ", their_delivered,
                                         "): a stale connection, reconnecting"));
  if (!fits) {
    declare_lost_locked(str_cat(conn->peer(), " lost: its resume state (delivered ", their_delivered,
                                ", received ", their_received, ") does not fit ours (acknowledged ", acked_,
                                ", sent up to ", next_seq_ - 1, "); the session cannot be resumed"));
    return false;
  }
  peer_session_ = their_session;
  acknowledge_locked(their_delivered);
  rate_clean_after_ = their_received;
  delivered_at_ = first_sent_ = Clock::now();
  delivered_at_idle_ = true;
  next_write_seq_ = their_received + 1;  // >= acked_ + 1: their_received >= their_delivered == acked_
  write_offset_ = 0;                     // pieces of a frame the peer did not get whole are lost with the connection
  last_write_ = Clock::now();
  last_ack_sent_ = sent_delivered;
  if (delivered_ > last_ack_sent_) ack_due_since_ = Clock::now();
  const uint64_t to_resend = max_written_seq_ >= next_write_seq_ ? max_written_seq_ + 1 - next_write_seq_ : 0;
  old = std::move(conn_);  // closed already; released after the lock (by the guard's scope end)
  if (old) retire_locked(*old);
  conn_ = conn;
  candidate_.reset();
  writer_error_.clear();
  ++gen_;
  connected_ = true;
  ping_wanted_ = ping_outstanding_ = pong_pending_ = false;  // probes of an older connection are void
  if (gen_ > 1) {
    ++counters_.reconnects;
    spdlog::info("session with {} resumed after {} ms: re-sending {} frame(s) from seq {}", conn->peer(),
                 ms_since(failed_at_), to_resend, next_write_seq_);
  }
  writer_cv_.notify_all();
  return true;
}

std::string ResilientLink::read_loop(Link& conn, uint64_t gen) {
  // The pieces of a frame that arrives split (see "Protocol"); lost with this connection.
  wire::Frame joined;
  uint64_t joined_seq = 0, joined_total = 0;
  uint32_t joined_crc = 0;  // CRC-32 of joined.payload, combined from the pieces'
  for (;;) {
    wire::Frame f;
    try {
      // Liveness: the peer writes at least every liveness_timeout / 4. close() of the
      // connection wakes the call early.
      f = conn.recv(options_.liveness_timeout.count() > 0 ? Deadline::after(options_.liveness_timeout)
                                                          : Deadline::never());
    } catch (const Timeout& e) {
      MutexLock lock(mu_);
      ++counters_.liveness_failures;
      return str_cat("nothing arrived from ", conn.peer(), " for ", duration_text(options_.liveness_timeout),
                     " (wan.liveness_timeout; it sends at least a heartbeat every ",
                     duration_text(options_.liveness_timeout / 4),
                     "): the path is silent (black-holed, or a NAT/firewall dropped the connection) or the peer hung");
    } catch (const NetworkError& e) {
      return e.what();
    } catch (const FrameError& e) {
      return e.what();
    }
    MutexLock lock(mu_);
    if (closed_ || lost_ || gen != gen_) return "session over";
    // A piece of a split frame, or its last piece (a frame of the caller's type with the same seq).
    const bool part = f.header.type == FrameType::kPart;
    if (part || (joined_total > 0 && f.header.seq == joined_seq)) {
      const uint64_t seq = f.header.seq;
      if (seq <= received_) {  // a duplicate after a resend: dropped with its last piece
        if (!part) ++counters_.duplicates_dropped;
        continue;
      }
      if (seq != received_ + 1)
        return str_cat("piece of frame seq ", seq, " from ", conn.peer(), " after seq ", received_, ": frames missing");
      const uint64_t total = part ? f.header.op_id : joined_total;
      if (joined_total == 0) {  // its first piece
        if (total <= f.payload.size())
          return str_cat("first piece of frame seq ", seq, " from ", conn.peer(), " claims a whole of ", total,
                         " bytes but carries ", f.payload.size());
        joined = wire::Frame{};
        joined_seq = seq;
        joined_total = total;
        joined_crc = 0;
        // Memory for the whole only up to what this side would queue anyway; beyond that it
        // grows as the pieces arrive.
        joined.payload.reserve(std::min(total, options_.max_pending_bytes));
      }
      // A part leaves some of the whole to come; the last piece completes it exactly.
      const uint64_t after = joined.payload.size() + f.payload.size();
      if (total != joined_total || (part ? after >= joined_total : after != joined_total))
        return str_cat("piece of frame seq ", seq, " from ", conn.peer(), " does not fit: ", joined.payload.size(),
                       " + ", f.payload.size(), " bytes of a whole of ", joined_total, " (claimed ", total, ")");
      joined_crc = wire::crc32_combine(joined_crc, wire::payload_crc(f.header), f.payload.size());
      joined.payload.insert(joined.payload.end(), f.payload.begin(), f.payload.end());
      if (part) continue;
      f.header.payload_len = joined_total;
      f.header.checksum = wire::checksum_from_payload_crc(f.header, joined_crc);
      f.payload = std::move(joined.payload);
      joined = wire::Frame{};
      joined_total = 0;
    }
    switch (f.header.type) {
      case FrameType::kHeartbeat:  // its arrival was the point
        break;
      case FrameType::kAck: {
        uint64_t delivered, held_ns = 0;
        try {
          wire::ByteReader r(f.payload, str_cat("ack frame from ", conn.peer()));
          delivered = r.u64();
          if (f.payload.size() > 8) held_ns = r.u64();  // a peer of an older version sends none
          r.expect_done();
        } catch (const FrameError& e) {
          return e.what();
        }
        if (delivered >= next_seq_)
          return str_cat("ack frame from ", conn.peer(), " acknowledges seq ", delivered, " but only ", next_seq_ - 1,
                         " were sent");
        ++counters_.acks_received;
        if (delivered > acked_) ack_received_locked(delivered, std::chrono::nanoseconds(held_ns), gen);
        break;
      }
      case FrameType::kPing:
      case FrameType::kPong: {
        uint64_t id, held_ns = 0;
        const bool ping = f.header.type == FrameType::kPing;
        try {
          wire::ByteReader r(f.payload, str_cat(ping ? "ping" : "pong", " frame from ", conn.peer()));
          id = r.u64();
          if (!ping) held_ns = r.u64();
          r.expect_done();
        } catch (const FrameError& e) {
          return e.what();
        }
        const Clock::time_point now = Clock::now();
        if (ping) {  // the newest one is answered (there is at most one in flight)
          pong_pending_ = true;
          pong_id_ = id;
          pong_arrived_ = now;
          writer_cv_.notify_one();
        } else if (ping_outstanding_ && id == ping_id_ && gen == ping_gen_) {
          ping_outstanding_ = false;
          const auto since = now - ping_written_;
          const auto held = std::min<Clock::duration>(std::chrono::nanoseconds(held_ns), since);
          estimator_.on_rtt_sample(seconds(since - held), now);
        }
        break;
      }
      case FrameType::kResume:
        return str_cat("unexpected resume frame from ", conn.peer(), " on an established connection");
      case FrameType::kBye: {
        // The peer closed the session on purpose: no reconnecting. Frames already received
        // are still handed to the caller; everything after that is PeerLost.
        spdlog::info("session with {} closed by the peer", conn.peer());
        lost_ = true;
        connected_ = false;
        lost_message_ = "the peer closed the session";
        send_cv_.notify_all();
        recv_cv_.notify_all();
        writer_cv_.notify_all();
        reader_cv_.notify_all();
        return "session over";
      }
      default: {
        const uint64_t seq = f.header.seq;
        if (seq <= received_) {
          ++counters_.duplicates_dropped;
        } else if (seq == received_ + 1) {
          received_ = seq;
          inbox_.push_back({std::move(f), Clock::now()});
          recv_cv_.notify_one();
        } else {
          return str_cat("frame seq ", seq, " from ", conn.peer(), " after seq ", received_, ": frames missing");
        }
      }
    }
  }
}

void ResilientLink::reader_main(std::unique_ptr<Link> first) {
  std::shared_ptr<Link> candidate(std::move(first));
  auto backoff = options_.backoff_initial;
  bool pause_first = false;  // the first attempt after a failure goes at once
  try {
    for (;;) {
      Clock::time_point give_up;
      {
        MutexLock lock(mu_);
        if (closed_ || lost_) break;
        give_up = failed_at_ + options_.reconnect_timeout;
        if (!candidate) {
          if (pause_first) {
            auto wake = std::min(give_up, Clock::now() + backoff);
            reader_cv_.wait_until(mu_, wake, [&]() REQUIRES(mu_) { return closed_ || lost_; });
            if (closed_ || lost_) break;
            backoff = std::min(backoff * 2, options_.backoff_max);
          }
          pause_first = true;
          if (Clock::now() >= give_up) {
            const std::string last = last_error_.empty() ? std::string("none") : last_error_;
            auto conn = declare_lost_locked(str_cat(
                peer_locked(), " lost: no reconnection within ", duration_text(options_.reconnect_timeout),
                " (last error: ", last,
                outage_cause_.empty() || outage_cause_ == last ? std::string()
                                                               : str_cat("; the connection failed with: ", outage_cause_),
                ")"));
            lock.unlock();
            if (conn) conn->close();
            break;
          }
          ++counters_.reconnect_attempts;
        }
      }
      const Deadline deadline = Deadline(std::min(give_up, Clock::now() + options_.attempt_timeout));
      if (!candidate) {
        try {
          std::unique_ptr<Link> fresh = reconnect_(deadline);
          if (!fresh) throw Error("the reconnect function returned no link");
          candidate = std::move(fresh);
        } catch (const std::exception& e) {
          MutexLock lock(mu_);
          last_error_ = str_cat("reconnect: ", e.what());
          continue;
        }
      }
      {
        MutexLock lock(mu_);
        if (closed_ || lost_) break;
        candidate_ = candidate;  // so that close() can cut the resume exchange short
      }
      bool resumed = false;
      try {
        resumed = resume_on(candidate, deadline);
      } catch (const std::exception& e) {
        MutexLock lock(mu_);
        if (candidate_) retire_locked(*candidate_);
        candidate_.reset();
        last_error_ = str_cat("resume: ", e.what());
      }
      if (!resumed) {
        candidate->close();
        candidate.reset();
        continue;  // the loop head ends the thread if the session is over
      }
      std::shared_ptr<Link> conn = std::move(candidate);
      uint64_t gen;
      {
        MutexLock lock(mu_);
        gen = gen_;
      }
      backoff = options_.backoff_initial;
      pause_first = false;

      std::string why = read_loop(*conn, gen);
      {
        MutexLock lock(mu_);
        if (closed_ || lost_) break;
        if (connected_ && gen_ == gen) {
          connected_ = false;
          last_error_ = why;
        } else {
          last_error_ = writer_error_.empty() ? why : writer_error_;  // the writer noticed first
        }
        outage_cause_ = last_error_;
        failed_at_ = Clock::now();
        spdlog::warn("session with {} interrupted: {}; reconnecting (for at most {})", conn->peer(), last_error_,
                     duration_text(options_.reconnect_timeout));
      }
      conn->close();
    }
  } catch (const std::exception& e) {
    std::shared_ptr<Link> conn;
    {
      MutexLock lock(mu_);
      conn = declare_lost_locked(str_cat("session failed: ", e.what()));
    }
    if (conn) conn->close();
  }
}

}  // namespace nebula::transport
