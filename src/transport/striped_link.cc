#include "transport/striped_link.h"

#include <spdlog/spdlog.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace nebula::transport {
namespace {

// The same exception, its message prefixed with `prefix` (e.g. "stream 2/4: "), type kept.
std::exception_ptr with_context(std::exception_ptr e, const std::string& prefix) {
  try {
    std::rethrow_exception(e);
  } catch (const Timeout& x) {
    return std::make_exception_ptr(Timeout(x.peer(), prefix + x.what()));
  } catch (const AuthError& x) {
    return std::make_exception_ptr(AuthError(x.peer(), prefix + x.what()));
  } catch (const PeerLost& x) {
    return std::make_exception_ptr(PeerLost(x.peer(), prefix + x.what()));
  } catch (const NetworkError& x) {
    return std::make_exception_ptr(NetworkError(x.peer(), prefix + x.what()));
  } catch (const FrameError& x) {
    return std::make_exception_ptr(FrameError(x.kind(), prefix + x.what()));
  } catch (const ConfigError& x) {
    return std::make_exception_ptr(ConfigError(prefix + x.what()));
  } catch (const DataError& x) {
    return std::make_exception_ptr(DataError(prefix + x.what()));
  } catch (const Error& x) {
    return std::make_exception_ptr(Error(prefix + x.what()));
  } catch (...) {
    return e;
  }
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

std::pair<uint64_t, uint64_t> chunk_range(uint64_t total, uint32_t count, uint32_t index) {
  NEBULA_CHECK(count >= 1 && index < count, "chunk index ", index, " of ", count);
  const uint64_t base = total / count, rem = total % count;
  return {index * base + std::min<uint64_t>(index, rem), base + (index < rem ? 1 : 0)};
}

std::array<uint8_t, kChunkHeaderSize> encode_chunk_header(const ChunkHeader& h) {
  wire::ByteWriter w;
  w.reserve(kChunkHeaderSize);
  w.put_u32(ChunkHeader::kChunkMagic);
  w.put_u8(ChunkHeader::kChunkVersion);
  w.put_u8(static_cast<uint8_t>(h.original.type));
  w.put_u16(h.original.flags);
  w.put_u16(h.index);
  w.put_u16(h.count);
  w.put_u64(h.logical_seq);
  w.put_u64(h.original.op_id);
  w.put_u64(h.original.seq);
  w.put_u8(h.original.codec);
  w.put_u64(h.original.payload_len);
  w.put_u32(h.original.checksum);
  const std::vector<uint8_t> bytes = w.take();
  std::array<uint8_t, kChunkHeaderSize> out;
  NEBULA_CHECK(bytes.size() == out.size(), "chunk header of ", bytes.size(), " bytes");
  std::copy(bytes.begin(), bytes.end(), out.begin());
  return out;
}

wire::Frame make_chunk_frame(const ChunkHeader& h, std::span<const uint8_t> data) {
  const auto head = encode_chunk_header(h);
  std::vector<uint8_t> payload(head.begin(), head.end());
  payload.insert(payload.end(), data.begin(), data.end());
  return wire::make_frame(wire::FrameType::kData, h.original.op_id, h.logical_seq, std::move(payload));
}

ChunkHeader parse_chunk_header(const wire::Frame& chunk, const std::string& what) {
  wire::ByteReader r(chunk.payload, what);
  ChunkHeader h;
  const uint32_t magic = r.u32();
  if (magic != ChunkHeader::kChunkMagic)
    throw FrameError(FrameError::Kind::kBadPayload,
                     str_cat(what, ": not a stripe chunk (magic ", hex32(magic), ", expected ",
                             hex32(ChunkHeader::kChunkMagic), "); is the peer striping with the same streams?"));
  const uint8_t version = r.u8();
  if (version != ChunkHeader::kChunkVersion)
    throw FrameError(FrameError::Kind::kBadPayload, str_cat(what, ": stripe chunk version ", int(version),
                                                            ", this side speaks ", int(ChunkHeader::kChunkVersion)));
  h.original.type = static_cast<wire::FrameType>(r.u8());
  h.original.flags = r.u16();
  h.index = r.u16();
  h.count = r.u16();
  h.logical_seq = r.u64();
  h.original.op_id = r.u64();
  h.original.seq = r.u64();
  h.original.codec = r.u8();
  h.original.payload_len = r.u64();
  h.original.checksum = r.u32();
  return h;
}

// ---------------------------------------------------------------------------------------

StripedLink::StripedLink(std::vector<std::unique_ptr<Link>> streams, LinkOptions options) : options_(options) {
  NEBULA_CHECK(!streams.empty() && streams.size() <= kMaxStreams, "StripedLink needs 1..", kMaxStreams,
               " streams, got ", streams.size());
  for (size_t i = 0; i < streams.size(); ++i) NEBULA_CHECK(streams[i] != nullptr, "StripedLink: stream ", i, " is null");
  for (size_t i = 1; i < streams.size(); ++i) {
    if (streams[i]->peer_identity() != streams[0]->peer_identity() ||
        streams[i]->peer_fingerprint() != streams[0]->peer_fingerprint())
      throw AuthError(streams[0]->peer(),
                      str_cat("striped link to ", streams[0]->peer(), ": stream ", i, " authenticated as '",
                              streams[i]->peer_identity(), "' (certificate ", streams[i]->peer_fingerprint(),
                              ") but stream 0 as '", streams[0]->peer_identity(), "' (certificate ",
                              streams[0]->peer_fingerprint(), "); refusing to mix them"));
  }
  for (size_t i = 0; i < streams.size(); ++i) {
    auto s = std::make_unique<Stream>();
    s->index = i;
    s->link = std::move(streams[i]);
    streams_.push_back(std::move(s));
  }
  // Threads last: every stream exists before any thread looks at streams_.
  for (auto& s : streams_) {
    Stream& ref = *s;
    if (s->index > 0) s->sender = std::thread([this, &ref] { sender_loop(ref); });  // send() sends stream 0's
    s->receiver = std::thread([this, &ref] { receiver_loop(ref); });
  }
}

StripedLink::~StripedLink() {
  close();
  for (auto& s : streams_) {
    if (s->sender.joinable()) s->sender.join();
    if (s->receiver.joinable()) s->receiver.join();
  }
  // Only the stream threads and recv() start it, so it is settled now.
  if (closer_.joinable()) closer_.join();
}

std::string StripedLink::stream_name(size_t i) const { return str_cat("stream ", i, "/", streams_.size()); }

LinkStats StripedLink::stats() const {
  LinkStats s = counters_.snapshot();
  for (const auto& stream : streams_) {
    const LinkStats st = stream->link->stats();
    s.wire_bytes_sent += st.wire_bytes_sent;
    s.wire_bytes_received += st.wire_bytes_received;
  }
  return s;
}

std::vector<LinkStats> StripedLink::stream_stats() const {
  std::vector<LinkStats> out;
  for (const auto& s : streams_) out.push_back(s->link->stats());
  return out;
}

void StripedLink::throw_if_unusable_locked(const char* what) const {
  if (closed_) throw PeerLost(peer(), str_cat(what, " ", peer(), ": striped link was closed locally"));
  if (broken_reason_)
    throw PeerLost(peer(), str_cat(what, " ", peer(), ": striped link broken after ", *broken_reason_,
                                   "; close it and reconnect"));
}

void StripedLink::break_link(const std::string& reason, bool quiet) {
  {
    MutexLock lock(mu_);
    if (broken_reason_ || closed_) return;
    broken_reason_ = reason;
  }
  if (quiet)
    spdlog::debug("striped link to {} ({} streams) ended: {}", peer(), streams_.size(), reason);
  else
    spdlog::warn("striped link to {} ({} streams) broken: {}", peer(), streams_.size(), reason);
  // Tell the peer at once and wake calls blocked on any stream. On a thread of its own:
  // a stream's close() may wait (an EmulatedLink drains its frames in flight), and the
  // caller -- a sender thread, or recv() -- must report the failure now, not after that.
  // Runs once (broken_reason_ is set once); joined by the destructor.
  closer_ = std::thread([this] {
    for (auto& s : streams_) s->link->close();
  });
  send_cv_.notify_all();
  recv_cv_.notify_all();
}

void StripedLink::close() {
  {
    MutexLock lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  for (auto& s : streams_) s->link->close();
  send_cv_.notify_all();
  recv_cv_.notify_all();
}

// ---------------------------------------------------------------------------------------

std::exception_ptr StripedLink::send_chunk(Stream& s, const wire::FrameHeader& original, PayloadParts parts,
                                           uint64_t seq, Deadline deadline) {
  const auto n = static_cast<uint32_t>(streams_.size());
  ChunkHeader h;
  h.index = static_cast<uint16_t>(s.index);
  h.count = static_cast<uint16_t>(n);
  h.logical_seq = seq;
  h.original = original;
  std::exception_ptr err;
  try {
    const auto [off, len] = chunk_range(original.payload_len, n, static_cast<uint32_t>(s.index));
    const auto head = encode_chunk_header(h);
    // The chunk header, then the parts' bytes [off, off + len).
    std::vector<std::span<const uint8_t>> out{std::span<const uint8_t>(head)};
    uint64_t at = 0;
    for (const auto& p : parts) {
      const uint64_t b = std::max(off, at), e = std::min(off + len, at + p.size());
      if (b < e) out.push_back(p.subspan(b - at, e - b));
      at += p.size();
    }
    wire::FrameHeader inner;
    inner.type = wire::FrameType::kData;
    inner.op_id = original.op_id;
    inner.seq = seq;
    inner.payload_len = kChunkHeaderSize + len;
    uint32_t crc = wire::compute_checksum(inner, out[0]);
    for (size_t i = 1; i < out.size(); ++i) crc = wire::crc32(crc, out[i]);
    inner.checksum = crc;
    s.link->send_parts(inner, out, deadline);
  } catch (...) {
    err = with_context(std::current_exception(), "striped link, " + stream_name(s.index) + ": ");
  }
  if (err) {
    // Recorded before breaking the link: the other streams' failures that the break
    // causes ("closed locally") must not be reported as the first error.
    {
      MutexLock first(mu_);
      if (!send_error_) send_error_ = err;
    }
    // Now, so the other streams' sends wake at once rather than at the deadline.
    break_link(str_cat("sending on ", stream_name(s.index), " failed: ", what_of(err)));
  }
  return err;
}

void StripedLink::sender_loop(Stream& s) {
  MutexLock lock(mu_);
  for (;;) {
    send_cv_.wait(mu_, [&]() REQUIRES(mu_) { return closed_ || s.has_job; });
    if (!s.has_job) return;  // closed and idle
    const wire::FrameHeader& header = *s.job_header;
    const PayloadParts parts = s.job_parts;
    const uint64_t seq = s.job_seq;
    const Deadline deadline = s.job_deadline;
    lock.unlock();
    send_chunk(s, header, parts, seq, deadline);
    lock.lock();
    s.has_job = false;
    if (--jobs_pending_ == 0) send_cv_.notify_all();
  }
}

void StripedLink::send(const wire::Frame& frame, Deadline deadline) {
  const std::span<const uint8_t> payload(frame.payload);
  send_parts(frame.header, PayloadParts(&payload, 1), deadline);
}

void StripedLink::send_parts(const wire::FrameHeader& header, PayloadParts parts, Deadline deadline) {
  const uint64_t size = parts_size(parts);
  NEBULA_CHECK(size == header.payload_len, "send to ", peer(), ": payload has ", size,
               " bytes but header.payload_len is ", header.payload_len);
  NEBULA_CHECK(header.payload_len <= options_.max_payload, "send to ", peer(), ": payload of ", header.payload_len,
               " bytes exceeds LinkOptions.max_payload ", options_.max_payload);
  MutexLock send_lock(send_mu_);
  MutexLock lock(mu_);
  throw_if_unusable_locked("send to");
  // Nothing has moved yet: a Timeout now leaves the link usable.
  if (deadline.expired()) throw Timeout(peer(), str_cat("send to ", peer(), ": deadline passed before sending"));
  // Stream 0's chunk is sent by this thread, the others by their sender threads: one
  // thread hand-off fewer per frame (the session stack sends 256 KiB pieces, so these
  // hand-offs, not the bytes, were most of its cost on loopback).
  for (size_t i = 1; i < streams_.size(); ++i) {
    streams_[i]->has_job = true;
    streams_[i]->job_header = &header;
    streams_[i]->job_parts = parts;
    streams_[i]->job_seq = send_seq_;
    streams_[i]->job_deadline = deadline;
  }
  jobs_pending_ = streams_.size() - 1;
  send_error_ = nullptr;
  const uint64_t seq = send_seq_;
  if (jobs_pending_ > 0) send_cv_.notify_all();
  lock.unlock();
  send_chunk(*streams_[0], header, parts, seq, deadline);
  lock.lock();
  // Bounded: every chunk send honours `deadline`, and a failure closes the other streams.
  send_cv_.wait(mu_, [&]() REQUIRES(mu_) { return jobs_pending_ == 0; });
  if (send_error_) {
    auto err = std::exchange(send_error_, nullptr);
    std::rethrow_exception(err);
  }
  ++send_seq_;
  lock.unlock();
  LinkCounters::add(counters_.bytes_sent, wire::kHeaderSize + size);
  LinkCounters::add(counters_.frames_sent, 1);
}

// ---------------------------------------------------------------------------------------

void StripedLink::receiver_loop(Stream& s) {
  const auto n = static_cast<uint32_t>(streams_.size());
  const auto i = static_cast<uint32_t>(s.index);
  const std::string what = str_cat("chunk from ", peer(), " on ", stream_name(i));
  for (;;) {
    {
      MutexLock lock(mu_);
      recv_cv_.wait(mu_, [&]() REQUIRES(mu_) { return closed_ || s.received.size() < kReadAhead; });
      if (closed_) return;
    }
    Received r;
    try {
      // No deadline of its own: this thread reads ahead for recv(), whose callers have
      // deadlines; close() and break_link() wake it by closing the stream.
      r.frame = s.link->recv(Deadline::never());
      if (r.frame.header.type != wire::FrameType::kData)
        throw FrameError(FrameError::Kind::kBadPayload,
                         str_cat(what, ": a ", wire::frame_type_name(r.frame.header.type),
                                 " frame, expected a data frame carrying a chunk"));
      r.header = parse_chunk_header(r.frame, what);
      const uint64_t total = r.header.original.payload_len;
      if (r.header.index != i || r.header.count != n)
        throw FrameError(FrameError::Kind::kBadPayload,
                         str_cat(what, ": carries chunk ", r.header.index, " of ", r.header.count, ", expected chunk ",
                                 i, " of ", n, " (are both ends pairing the same connections as stream ", i, "?)"));
      if (total > options_.max_payload)
        throw FrameError(FrameError::Kind::kTooLarge, str_cat(what, ": logical frame of ", total,
                                                              " bytes exceeds max_payload ", options_.max_payload));
      const uint64_t expected = chunk_range(total, n, i).second;
      const uint64_t got = r.frame.payload.size() - kChunkHeaderSize;
      if (got != expected)
        throw FrameError(FrameError::Kind::kBadPayload,
                         str_cat(what, ": ", got, " chunk bytes, expected ", expected, " for chunk ", i, " of ", n,
                                 " of a ", total, "-byte frame"));
      // The chunk bytes' CRC from the frame's verified checksum (no second pass over them).
      r.data_crc = wire::crc32_strip_prefix(wire::payload_crc(r.frame.header),
                                            wire::crc32(0, std::span<const uint8_t>(r.frame.payload.data(), kChunkHeaderSize)),
                                            got);
    } catch (const FrameError& e) {
      // Ours (already naming the stream) or the stream's own (a bad frame on the wire).
      r.error = std::string(e.what()).starts_with(what)
                    ? std::current_exception()
                    : with_context(std::current_exception(), "striped link, " + stream_name(i) + ": ");
    } catch (...) {
      r.error = with_context(std::current_exception(), "striped link, " + stream_name(i) + ": ");
    }
    const bool failed = r.error != nullptr;
    {
      MutexLock lock(mu_);
      if (failed) r.error_order = ++errors_seen_;
      s.received.push_back(std::move(r));
    }
    recv_cv_.notify_all();
    if (failed) return;  // the stream is out of step or gone: nothing more to read
  }
}

wire::Frame StripedLink::recv(Deadline deadline) {
  std::unique_lock<std::mutex> recv_lock(recv_mu_, std::try_to_lock);
  NEBULA_CHECK(recv_lock.owns_lock(), "concurrent recv() on the striped link to ", peer(),
               " (one receiving thread per link; see transport/link.h)");
  const size_t n = streams_.size();
  std::vector<Received> got(n);
  {
    MutexLock lock(mu_);
    for (;;) {
      throw_if_unusable_locked("recv from");
      size_t ready = 0;
      Stream* failed = nullptr;  // the stream whose error came first
      for (auto& s : streams_) {
        if (s->received.empty()) continue;
        if (!s->received.front().error) {
          ++ready;
        } else if (!failed || s->received.front().error_order < failed->received.front().error_order) {
          failed = s.get();
        }
      }
      if (failed) {
        // This frame can never be complete.
        auto err = failed->received.front().error;
        const std::string reason = str_cat("receiving on ", stream_name(failed->index), " failed: ", what_of(err));
        lock.unlock();
        // A stream that lost its peer logged that itself (quietly for an orderly close).
        bool lost = false;
        try {
          std::rethrow_exception(err);
        } catch (const PeerLost&) {
          lost = true;
        } catch (...) {
        }
        break_link(reason, lost);
        std::rethrow_exception(err);
      }
      if (ready == n) break;
      if (deadline.expired())
        throw Timeout(peer(), str_cat("recv from ", peer(), ": deadline passed with the next frame's chunks in from ",
                                      ready, " of ", n, " streams"));
      if (deadline.is_never())
        recv_cv_.wait(mu_);
      else
        recv_cv_.wait_until(mu_, deadline.at());
    }
    for (size_t i = 0; i < n; ++i) {
      got[i] = std::move(streams_[i]->received.front());
      streams_[i]->received.pop_front();
    }
  }
  recv_cv_.notify_all();  // room in every read-ahead queue

  auto bad = [&](FrameError::Kind kind, const std::string& msg) -> FrameError {
    const std::string full = str_cat("recv from ", peer(), ": ", msg);
    break_link(full);
    return FrameError(kind, full);
  };
  const wire::FrameHeader& h0 = got[0].header.original;
  for (size_t i = 0; i < n; ++i) {
    const ChunkHeader& c = got[i].header;
    if (c.logical_seq != recv_seq_)
      throw bad(FrameError::Kind::kBadPayload, str_cat(stream_name(i), " carried a chunk of logical frame ",
                                                       c.logical_seq, ", expected frame ", recv_seq_));
    const wire::FrameHeader& o = c.original;
    if (o.type != h0.type || o.flags != h0.flags || o.op_id != h0.op_id || o.seq != h0.seq || o.codec != h0.codec ||
        o.payload_len != h0.payload_len || o.checksum != h0.checksum)
      throw bad(FrameError::Kind::kBadPayload,
                str_cat(stream_name(i), " disagrees with stream 0 about logical frame ", recv_seq_, ": type ",
                        int(o.type), "/", int(h0.type), ", flags ", o.flags, "/", h0.flags, ", op_id ", o.op_id, "/",
                        h0.op_id, ", seq ", o.seq, "/", h0.seq, ", codec ", int(o.codec), "/", int(h0.codec),
                        ", length ", o.payload_len, "/", h0.payload_len, ", checksum ", o.checksum, "/",
                        h0.checksum));
  }
  // Every header field validated as a wire decoder would, before allocating the payload.
  wire::Frame frame;
  try {
    frame.header = wire::decode_header(wire::encode_header(h0), options_.max_payload);
  } catch (const FrameError& e) {
    throw bad(e.kind(), str_cat("rebuilt header of logical frame ", recv_seq_, ": ", e.what()));
  }
  frame.payload.resize(frame.header.payload_len);
  const auto head = wire::encode_header(frame.header);
  uLong crc = wire::crc32(0, std::span<const uint8_t>(head.data(), wire::kChecksumOffset));
  for (size_t i = 0; i < n; ++i) {
    const auto [off, len] = chunk_range(frame.payload.size(), static_cast<uint32_t>(n), static_cast<uint32_t>(i));
    if (len > 0) std::memcpy(frame.payload.data() + off, got[i].frame.payload.data() + kChunkHeaderSize, len);
    crc = crc32_combine(crc, got[i].data_crc, static_cast<z_off_t>(len));
    got[i].frame.payload = {};  // release as we go: the chunks and the frame are both large
  }
  frame.header.checksum = static_cast<uint32_t>(crc);
  if (frame.header.checksum != h0.checksum)
    throw bad(FrameError::Kind::kBadChecksum,
              str_cat("logical frame ", recv_seq_, " (op_id ", h0.op_id, " seq ", h0.seq, ", ", h0.payload_len,
                      " bytes) rebuilt from ", n, " chunks has checksum ", frame.header.checksum,
                      " but the sender's header says ", h0.checksum));
  ++recv_seq_;
  LinkCounters::add(counters_.bytes_received, wire::kHeaderSize + frame.payload.size());
  LinkCounters::add(counters_.frames_received, 1);
  return frame;
}

}  // namespace nebula::transport
