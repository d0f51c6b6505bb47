#include "transport/resilient_link.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <thread>

#include "transport/emulated_link.h"
#include "transport/link_test_util.h"

namespace nebula::transport {
namespace {

using namespace nebula::transport::testing;
using wire::Frame;
using wire::FrameType;
using wire::make_frame;

// The payload of frame `index`: `size` pattern bytes whose first 8 (when there is room)
// hold the index, so a frame can be checked without its (session-owned) seq.
std::vector<uint8_t> payload_for(uint64_t index, size_t size) {
  auto v = pattern(size, static_cast<uint32_t>(index) + 1);
  for (size_t k = 0; k < 8 && k < size; ++k) v[k] = static_cast<uint8_t>(index >> (8 * k));
  return v;
}

// Caller fields the session must leave alone: op_id = index, flags and codec derived from it.
Frame frame_for(uint64_t index, size_t size) {
  return make_frame(FrameType::kData, index, /*seq=*/12345, payload_for(index, size),
                    static_cast<uint16_t>(index & 0xFFFF), static_cast<uint8_t>(index % 7));
}

// Checks that `f` is frame `index` of `size` bytes; returns a description of what differs.
std::string check_frame(const Frame& f, uint64_t index, size_t size) {
  if (f.header.op_id != index) return str_cat("expected frame ", index, ", got op_id ", f.header.op_id);
  if (f.header.flags != static_cast<uint16_t>(index & 0xFFFF) || f.header.codec != index % 7)
    return str_cat("frame ", index, ": flags/codec changed");
  if (f.header.type != FrameType::kData) return str_cat("frame ", index, ": type changed");
  if (f.payload != payload_for(index, size)) return str_cat("frame ", index, ": payload differs");
  try {
    wire::verify_checksum(f.header, f.payload);
  } catch (const std::exception& e) {
    return str_cat("frame ", index, ": ", e.what());
  }
  return {};
}

std::vector<uint8_t> u64s(std::initializer_list<uint64_t> values) {
  wire::ByteWriter w;
  for (uint64_t v : values) w.put_u64(v);
  return w.take();
}

// Forwards to a TcpLink the test keeps a hold of, so it can cut the connection underneath
// a ResilientLink (which owns, and destroys, only this wrapper).
class SharedLink : public Link {
 public:
  explicit SharedLink(std::shared_ptr<TcpLink> inner) : inner_(std::move(inner)) {}
  void send(const Frame& frame, Deadline deadline) override { inner_->send(frame, deadline); }
  Frame recv(Deadline deadline) override { return inner_->recv(deadline); }
  void close() override { inner_->close(); }
  std::string peer() const override { return inner_->peer(); }
  LinkStats stats() const override { return inner_->stats(); }

 private:
  std::shared_ptr<TcpLink> inner_;
};

// Two ResilientLinks on loopback: `a` dials (and redials) the listener, `b` accepts (and
// re-accepts) on it. cut() closes the current connection underneath either side.
class Session {
 public:
  // `link`: the options of the TCP connections underneath (their max_payload).
  explicit Session(ResilientOptions options, LinkOptions link = {}) : link_(link), listener_("127.0.0.1", 0, link) {
    Reconnect dial = [this](Deadline d) { return dial_once(d); };
    Reconnect accept = [this](Deadline d) -> std::unique_ptr<Link> {
      auto link = std::shared_ptr<TcpLink>(listener_.accept(d, "site-a"));
      std::lock_guard<std::mutex> lock(mu_);
      b_conn_ = link;
      return std::make_unique<SharedLink>(link);
    };
    auto first_a = dial(Deadline::after(10s));
    auto first_b = accept(Deadline::after(10s));
    a = std::make_unique<ResilientLink>(std::move(first_a), dial, options);
    b = std::make_unique<ResilientLink>(std::move(first_b), accept, options);
  }
  ~Session() {
    stopping_ = true;
    if (a) a->close();
    if (b) b->close();
    listener_.close();  // a reconnect in flight gives up at once
    a.reset();
    b.reset();
  }

  // Closes the current connection under a (side_a) or b.
  void cut(bool side_a) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& conn = side_a ? a_conn_ : b_conn_;
    if (conn) conn->close();
  }
  // While closed, a's redial waits (bounded by its deadline).
  void set_gate(bool open) { gate_open_ = open; }
  TcpListener& listener() { return listener_; }

  std::unique_ptr<ResilientLink> a, b;

 private:
  std::unique_ptr<Link> dial_once(Deadline d) {
    for (;;) {
      if (stopping_) throw PeerLost("site-b", "test session is stopping");
      if (gate_open_) {
        try {
          auto link = std::shared_ptr<TcpLink>(
              TcpLink::connect("127.0.0.1", listener_.port(), "site-b", d.min(Deadline::after(100ms)), link_));
          std::lock_guard<std::mutex> lock(mu_);
          a_conn_ = link;
          return std::make_unique<SharedLink>(link);
        } catch (const Timeout&) {
          if (d.expired()) throw;
        }
      } else {
        if (d.expired()) throw Timeout("site-b", "test gate closed");
        std::this_thread::sleep_for(5ms);
      }
    }
  }

  LinkOptions link_;
  TcpListener listener_;
  std::mutex mu_;
  std::shared_ptr<TcpLink> a_conn_, b_conn_;  // GUARDED_BY(mu_): latest connections
  std::atomic<bool> gate_open_{true};
  std::atomic<bool> stopping_{false};
};

// Sends frames [0, n) with the given sizes; receives and checks the peer's.
// `pace` between frames stretches a transfer over many cuts.
void send_all(ResilientLink* link, size_t n, size_t (*size_of)(uint64_t), std::chrono::microseconds pace = {}) {
  for (uint64_t i = 0; i < n; ++i) {
    link->send(frame_for(i, size_of(i)), Deadline::after(60s));
    if (pace.count() > 0) std::this_thread::sleep_for(pace);
  }
}
void recv_all(ResilientLink* link, size_t n, size_t (*size_of)(uint64_t)) {
  for (uint64_t i = 0; i < n; ++i) {
    Frame f = link->recv(Deadline::after(60s));
    std::string bad = check_frame(f, i, size_of(i));
    ASSERT_TRUE(bad.empty()) << bad;
    ASSERT_EQ(f.header.seq, i + 1) << "session seq";
  }
}

void print_stats(const char* name, const ResilienceStats& s) {
  std::printf("%s: %llu frames sent, %llu received, %llu reconnects (%llu attempts), %llu frames resent, %llu "
              "duplicates dropped, %llu acks sent, %llu received\n",
              name, (unsigned long long)s.link.frames_sent, (unsigned long long)s.link.frames_received,
              (unsigned long long)s.reconnects, (unsigned long long)s.reconnect_attempts,
              (unsigned long long)s.frames_resent, (unsigned long long)s.duplicates_dropped,
              (unsigned long long)s.acks_sent, (unsigned long long)s.acks_received);
}

size_t mixed_size(uint64_t i) {
  static const size_t kSizes[] = {0, 1, 7, 100, 1000, 4096, 16384};
  if (i % 50 == 0) return 256 * 1024;
  return kSizes[(i * 2654435761u >> 7) % 7];
}

TEST(ResilientLinkTest, NoFaults10000MixedFramesBothWaysExactlyOnce) {
  ResilientOptions o;
  o.max_pending_bytes = 8 << 20;  // small enough that the senders depend on acks
  Session s(o);
  constexpr size_t kFrames = 10000;
  auto sa = std::async(std::launch::async, send_all, s.a.get(), kFrames, mixed_size, 0us);
  auto sb = std::async(std::launch::async, send_all, s.b.get(), kFrames, mixed_size, 0us);
  auto ra = std::async(std::launch::async, recv_all, s.a.get(), kFrames, mixed_size);
  auto rb = std::async(std::launch::async, recv_all, s.b.get(), kFrames, mixed_size);
  sa.get(), sb.get(), ra.get(), rb.get();
  // Acks drain both pending buffers.
  s.a->flush(Deadline::after(10s));
  s.b->flush(Deadline::after(10s));
  for (auto* link : {s.a.get(), s.b.get()}) {
    auto st = link->stats_ex();
    EXPECT_EQ(st.pending_frames, 0u);
    EXPECT_EQ(st.pending_bytes, 0u);
    EXPECT_EQ(st.link.frames_sent, kFrames);
    EXPECT_EQ(st.link.frames_received, kFrames);
    EXPECT_EQ(st.reconnects, 0u);
    EXPECT_EQ(st.frames_resent, 0u);
    EXPECT_EQ(st.duplicates_dropped, 0u);
    EXPECT_GT(st.acks_received, 0u);
    EXPECT_TRUE(st.connected);
    EXPECT_EQ(link->stats().bytes_sent, link->stats().bytes_received);  // same sizes both ways
  }
  EXPECT_EQ(s.a->peer(), "site-b");
  EXPECT_EQ(s.b->peer(), "site-a");
}

size_t medium_size(uint64_t i) { return (i * 2654435761u) % 60000; }

// Options for sessions that are cut again and again: quick redials, room for the frames.
ResilientOptions cut_options() {
  ResilientOptions o;
  o.reconnect_timeout = 20s;
  o.backoff_initial = 1ms;
  o.backoff_max = 20ms;
  o.attempt_timeout = 2s;
  o.max_pending_bytes = 4 << 20;
  return o;
}

// Sends frames [0, n) both ways (paced), receives and checks them, while the connection is cut
// every 50 ms on alternating sides; then flushes both ends. Returns the number of cuts.
int exchange_both_ways_under_cuts(Session& s, size_t n, size_t (*size_of)(uint64_t), std::chrono::microseconds pace) {
  std::atomic<bool> done{false};
  std::atomic<int> cuts{0};
  std::thread killer([&] {
    for (int k = 0; !done; ++k) {
      std::this_thread::sleep_for(50ms);
      s.cut(k % 2 == 0);
      ++cuts;
    }
  });
  auto sa = std::async(std::launch::async, send_all, s.a.get(), n, size_of, pace);
  auto sb = std::async(std::launch::async, send_all, s.b.get(), n, size_of, pace);
  auto ra = std::async(std::launch::async, recv_all, s.a.get(), n, size_of);
  auto rb = std::async(std::launch::async, recv_all, s.b.get(), n, size_of);
  sa.get(), sb.get(), ra.get(), rb.get();
  done = true;
  killer.join();
  s.a->flush(Deadline::after(20s));
  s.b->flush(Deadline::after(20s));
  return cuts.load();
}

TEST(ResilientLinkTest, ConnectionCutEvery50msBothWaysExactlyOnceInOrder) {
  Session s(cut_options());
  constexpr size_t kFrames = 2000;
  // ~1 ms per frame: the transfer spans a few seconds, so dozens of cuts.
  const int cuts = exchange_both_ways_under_cuts(s, kFrames, medium_size, 1000us);
  auto st_a = s.a->stats_ex(), st_b = s.b->stats_ex();
  print_stats("a", st_a);
  print_stats("b", st_b);
  std::printf("%d cuts\n", cuts);
  EXPECT_GT(cuts, 10);
  EXPECT_GT(st_a.reconnects, 0u);
  EXPECT_GT(st_b.reconnects, 0u);
  EXPECT_EQ(st_a.link.frames_received, kFrames);
  EXPECT_EQ(st_b.link.frames_received, kFrames);
  EXPECT_EQ(st_a.pending_frames, 0u);
  EXPECT_EQ(st_b.pending_frames, 0u);
  // Nothing more arrives: every frame was delivered exactly once.
  EXPECT_THROW(s.a->recv(Deadline::after(100ms)), Timeout);
  EXPECT_THROW(s.b->recv(Deadline::after(100ms)), Timeout);
}

TEST(ResilientLinkTest, CallerTimeoutsDuringAnOutageLoseAndDuplicateNothing) {
  ResilientOptions o;
  o.backoff_initial = 1ms;
  o.backoff_max = 10ms;
  Session s(o);
  for (uint64_t i = 0; i < 10; ++i) s.a->send(frame_for(i, 1000), Deadline::after(5s));
  for (uint64_t i = 0; i < 10; ++i) ASSERT_EQ(check_frame(s.b->recv(Deadline::after(5s)), i, 1000), "");
  s.set_gate(false);
  s.cut(true);
  // Caller deadlines still bound each call while the session reconnects.
  auto t0 = Clock::now();
  try {
    s.b->recv(Deadline::after(200ms));
    ADD_FAILURE() << "recv returned during the outage";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("deadline passed"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_THROW(s.a->recv(Deadline::after(50ms)), Timeout);
  // Sends during the outage are queued and delivered after it.
  for (uint64_t i = 10; i < 20; ++i) s.a->send(frame_for(i, 1000), Deadline::after(1s));
  EXPECT_FALSE(s.a->stats_ex().connected);
  s.set_gate(true);
  for (uint64_t i = 10; i < 20; ++i) ASSERT_EQ(check_frame(s.b->recv(Deadline::after(10s)), i, 1000), "");
  EXPECT_THROW(s.b->recv(Deadline::after(100ms)), Timeout);
  s.b->send(frame_for(7, 10), Deadline::after(5s));
  EXPECT_EQ(check_frame(s.a->recv(Deadline::after(10s)), 7, 10), "");
  EXPECT_GE(s.a->stats_ex().reconnects, 1u);
  EXPECT_GE(s.b->stats_ex().reconnects, 1u);
}

TEST(ResilientLinkTest, PeerGoneRaisesPeerLostOnPendingAndLaterCalls) {
  ResilientOptions o;
  o.reconnect_timeout = 500ms;
  o.max_pending_bytes = 256 * 1024;
  o.goodbye = false;  // b vanishes rather than closing the session
  Session s(o);
  // a: a recv waiting, and a send blocked on a full buffer (b never reads).
  auto pending_recv = std::async(std::launch::async, [&] { return s.a->recv(Deadline::after(30s)); });
  uint64_t i = 0;
  for (;; ++i) {
    try {
      s.a->send(frame_for(i, 64 * 1024), Deadline::after(200ms));
    } catch (const Timeout&) {
      break;
    }
    ASSERT_LT(i, 100u);
  }
  auto blocked_send = std::async(std::launch::async, [&] { s.a->send(frame_for(i, 64 * 1024), Deadline::after(30s)); });
  std::this_thread::sleep_for(50ms);
  auto t0 = Clock::now();
  s.b->close();  // and b never comes back
  try {
    pending_recv.get();
    ADD_FAILURE() << "recv returned a frame";
  } catch (const PeerLost& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("site-b lost: no reconnection within 500 ms (last error: "), std::string::npos) << msg;
    EXPECT_EQ(e.peer(), "site-b");
  }
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_THROW(blocked_send.get(), PeerLost);
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_THROW(s.a->recv(Deadline::after(5s)), PeerLost);
  EXPECT_THROW(s.a->send(frame_for(0, 0), Deadline::after(5s)), PeerLost);
  EXPECT_THROW(s.a->flush(Deadline::after(5s)), PeerLost);
  EXPECT_LT(seconds_since(t0), 5.0);
}

TEST(ResilientLinkTest, PeerKilledWithSigkillRaisesPeerLostWithinTwiceTheTimeout) {
  TcpListener listener("127.0.0.1", 0);
  const uint16_t port = listener.port();
  // Fork before this test creates any thread. The child is a ResilientLink peer that sends
  // frames until it is killed; it never returns into gtest.
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    try {
      Reconnect dial = [port](Deadline d) -> std::unique_ptr<Link> {
        return TcpLink::connect("127.0.0.1", port, "parent", d);
      };
      ResilientLink link(dial(Deadline::after(10s)), dial, ResilientOptions{});
      for (uint64_t i = 0;; ++i) {
        link.send(frame_for(i, 1000), Deadline::after(10s));
        std::this_thread::sleep_for(1ms);
      }
    } catch (...) {
    }
    ::_exit(0);
  }
  ResilientOptions o;
  o.reconnect_timeout = 500ms;
  Reconnect accept = [&](Deadline d) -> std::unique_ptr<Link> { return listener.accept(d, "child"); };
  {
    ResilientLink link(listener.accept(Deadline::after(10s), "child"), accept, o);
    for (uint64_t i = 0; i < 20; ++i) ASSERT_EQ(check_frame(link.recv(Deadline::after(10s)), i, 1000), "");
    auto t0 = Clock::now();
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFSIGNALED(status));
    uint64_t next = 20;
    try {
      for (;; ++next) ASSERT_EQ(check_frame(link.recv(Deadline::after(10s)), next, 1000), "");
    } catch (const PeerLost& e) {
      EXPECT_NE(std::string(e.what()).find("child lost: no reconnection within 500 ms"), std::string::npos)
          << e.what();
    }
    double secs = seconds_since(t0);
    EXPECT_LT(secs, 5.0);
    std::printf("PeerLost %.3f s after SIGKILL (reconnect_timeout 0.5 s), %llu frames received\n", secs,
                (unsigned long long)next);
    EXPECT_THROW(link.recv(Deadline::after(1s)), PeerLost);
    listener.close();
  }
}

// The peer is a plain TcpLink driven by the test: it completes the resume exchange and then
// neither reads nor acknowledges until told to.
TEST(ResilientLinkTest, FullPendingBufferBlocksSendUntilDeadlineWithoutLosingFrames) {
  auto p = make_tcp_pair();
  ResilientOptions o;
  o.max_pending_bytes = 1 << 20;
  o.liveness_timeout = 0ms;  // the raw peer below sends no heartbeats
  Reconnect none = [](Deadline) -> std::unique_ptr<Link> { throw PeerLost("site-b", "test: no reconnection"); };
  ResilientLink link(std::move(p.client), none, o);
  auto& peer = *p.server;
  Frame resume = peer.recv(Deadline::after(10s));
  ASSERT_EQ(resume.header.type, FrameType::kResume);
  ASSERT_EQ(resume.payload, u64s({link.session_id(), 0, 0}));
  peer.send(make_frame(FrameType::kResume, 0, 0, u64s({42, 0, 0})), Deadline::after(10s));

  constexpr size_t kSize = 64 * 1024;
  const uint64_t fit = o.max_pending_bytes / (kSize + wire::kHeaderSize);  // 15
  for (uint64_t i = 0; i < fit; ++i) link.send(frame_for(i, kSize), Deadline::after(5s));
  auto t0 = Clock::now();
  try {
    link.send(frame_for(fit, kSize), Deadline::after(300ms));
    ADD_FAILURE() << "send did not block on a full pending buffer";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("max_pending_bytes"), std::string::npos) << e.what();
  }
  double secs = seconds_since(t0);
  EXPECT_GE(secs, 0.25);
  EXPECT_LT(secs, 5.0);
  EXPECT_EQ(link.stats_ex().pending_frames, fit);
  EXPECT_EQ(link.stats().frames_sent, fit);  // the timed-out frame was not sent
  EXPECT_THROW(link.flush(Deadline::after(50ms)), Timeout);

  // Now the peer reads: exactly the frames that were accepted, in order, nothing else but
  // one RTT probe (one in flight at a time; this peer never answers it).
  int pings = 0;
  auto next_data = [&]() {
    for (;;) {
      Frame f = peer.recv(Deadline::after(10s));
      if (f.header.type != FrameType::kPing) return f;
      EXPECT_EQ(f.payload.size(), 8u);
      ++pings;
    }
  };
  for (uint64_t i = 0; i < fit; ++i) {
    Frame f = next_data();
    ASSERT_EQ(check_frame(f, i, kSize), "");
    ASSERT_EQ(f.header.seq, i + 1);
  }
  if (pings == 0) {  // written after the last data frame
    EXPECT_EQ(peer.recv(Deadline::after(5s)).header.type, FrameType::kPing);
    ++pings;
  }
  EXPECT_EQ(pings, 1);
  EXPECT_THROW(peer.recv(Deadline::after(200ms)), Timeout);
  // An ack frees the buffer; the next frame goes out with the next seq.
  peer.send(make_frame(FrameType::kAck, 0, 0, u64s({fit})), Deadline::after(5s));
  link.flush(Deadline::after(5s));
  EXPECT_EQ(link.stats_ex().pending_bytes, 0u);
  EXPECT_EQ(link.stats_ex().acks_received, 1u);
  link.send(frame_for(fit, kSize), Deadline::after(5s));
  Frame f = next_data();
  EXPECT_EQ(pings, 1);
  EXPECT_EQ(check_frame(f, fit, kSize), "");
  EXPECT_EQ(f.header.seq, fit + 1);
  // Acks are consumed internally; data from the peer is delivered.
  peer.send(make_frame(FrameType::kAck, 0, 0, u64s({fit + 1})), Deadline::after(5s));
  Frame from_peer = make_frame(FrameType::kData, 9, 1, payload_for(9, 10));
  peer.send(from_peer, Deadline::after(5s));
  Frame got = link.recv(Deadline::after(5s));
  EXPECT_EQ(got.header.op_id, 9u);
  EXPECT_EQ(got.payload, from_peer.payload);
  link.flush(Deadline::after(5s));
}

// A raw peer that replays a frame and then skips one: the replay is delivered once; the
// gap breaks the connection, and with no way back the peer is lost, saying why.
TEST(ResilientLinkTest, DuplicatesAreDroppedAndAGapBreaksTheConnection) {
  auto p = make_tcp_pair();
  ResilientOptions o;
  o.reconnect_timeout = 300ms;
  o.liveness_timeout = 0ms;  // the raw peer below sends no heartbeats
  Reconnect none = [](Deadline) -> std::unique_ptr<Link> { throw PeerLost("site-b", "test: no reconnection"); };
  ResilientLink link(std::move(p.client), none, o);
  auto& peer = *p.server;
  ASSERT_EQ(peer.recv(Deadline::after(10s)).header.type, FrameType::kResume);
  peer.send(make_frame(FrameType::kResume, 0, 0, u64s({42, 0, 0})), Deadline::after(10s));
  auto data = [](uint64_t index, uint64_t seq) {
    Frame f = frame_for(index, 100);
    f.header.seq = seq;
    f.header.checksum = wire::compute_checksum(f.header, f.payload);
    return f;
  };
  peer.send(data(0, 1), Deadline::after(5s));
  peer.send(data(0, 1), Deadline::after(5s));  // a replay
  peer.send(data(1, 2), Deadline::after(5s));
  EXPECT_EQ(check_frame(link.recv(Deadline::after(5s)), 0, 100), "");
  EXPECT_EQ(check_frame(link.recv(Deadline::after(5s)), 1, 100), "");
  EXPECT_EQ(link.stats_ex().duplicates_dropped, 1u);
  peer.send(data(3, 4), Deadline::after(5s));  // seq 3 is missing
  try {
    link.recv(Deadline::after(10s));
    ADD_FAILURE() << "recv returned a frame after a gap";
  } catch (const PeerLost& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("no reconnection within 300 ms"), std::string::npos) << msg;
    EXPECT_NE(msg.find("test: no reconnection"), std::string::npos) << msg;
    EXPECT_NE(msg.find("frames missing"), std::string::npos) << msg;
  }
  EXPECT_EQ(link.stats().frames_received, 2u);
}

// A raw peer sends a frame in pieces (joined, with the whole's checksum right), then pieces
// that do not add up to the whole they claim: the connection breaks, saying why (found by
// fuzz/session_fuzzer: a short last piece was delivered with the claimed length).
TEST(ResilientLinkTest, PiecesAreJoinedAndPiecesThatDoNotAddUpBreakTheConnection) {
  auto p = make_tcp_pair();
  ResilientOptions o;
  o.reconnect_timeout = 300ms;
  o.liveness_timeout = 0ms;  // the raw peer below sends no heartbeats
  Reconnect none = [](Deadline) -> std::unique_ptr<Link> { throw PeerLost("site-b", "test: no reconnection"); };
  ResilientLink link(std::move(p.client), none, o);
  auto& peer = *p.server;
  ASSERT_EQ(peer.recv(Deadline::after(10s)).header.type, FrameType::kResume);
  peer.send(make_frame(FrameType::kResume, 0, 0, u64s({42, 0, 0})), Deadline::after(10s));
  const Frame whole = frame_for(3, 10);
  peer.send(make_frame(FrameType::kPart, 10, 1, std::vector<uint8_t>(whole.payload.begin(), whole.payload.begin() + 4)),
            Deadline::after(5s));
  peer.send(make_frame(FrameType::kData, 3, 1, std::vector<uint8_t>(whole.payload.begin() + 4, whole.payload.end()),
                       whole.header.flags, whole.header.codec),
            Deadline::after(5s));
  Frame got = link.recv(Deadline::after(5s));
  EXPECT_EQ(check_frame(got, 3, 10), "");  // verify_checksum included
  EXPECT_EQ(got.header.seq, 1u);
  peer.send(make_frame(FrameType::kPart, 10, 2, {1, 2, 3, 4}), Deadline::after(5s));
  peer.send(make_frame(FrameType::kPart, 10, 2, {5, 6, 7}), Deadline::after(5s));
  peer.send(make_frame(FrameType::kData, 0, 2, {}), Deadline::after(5s));  // 7 of 10 bytes
  try {
    link.recv(Deadline::after(10s));
    ADD_FAILURE() << "recv returned a frame whose pieces do not add up";
  } catch (const PeerLost& e) {
    EXPECT_NE(std::string(e.what()).find("does not fit: 7 + 0 bytes of a whole of 10"), std::string::npos) << e.what();
  }
}

TEST(ResilientLinkTest, CloseWakesBlockedCallsWithPeerLost) {
  Session s(ResilientOptions{});
  auto pending = std::async(std::launch::async, [&] { return s.a->recv(Deadline::after(30s)); });
  std::this_thread::sleep_for(50ms);
  auto t0 = Clock::now();
  s.a->close();
  try {
    pending.get();
    ADD_FAILURE() << "recv returned a frame";
  } catch (const PeerLost& e) {
    EXPECT_NE(std::string(e.what()).find("closed locally"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(t0), 2.0);
  EXPECT_THROW(s.a->send(frame_for(0, 10), Deadline::after(1s)), PeerLost);
  EXPECT_THROW(s.a->flush(Deadline::after(1s)), PeerLost);
  s.a->close();  // idempotent
}

// An orderly close says goodbye: the peer gets PeerLost at once instead of trying to
// reconnect for reconnect_timeout.
TEST(ResilientLinkTest, OrderlyCloseEndsThePeersSessionAtOnce) {
  ResilientOptions o;
  o.reconnect_timeout = 30s;
  Session s(o);
  for (uint64_t i = 0; i < 5; ++i) s.a->send(frame_for(i, 100), Deadline::after(5s));
  for (uint64_t i = 0; i < 5; ++i) ASSERT_EQ(check_frame(s.b->recv(Deadline::after(5s)), i, 100), "");
  s.a->flush(Deadline::after(5s));  // everything acknowledged: an orderly end
  auto t0 = Clock::now();
  s.a->close();
  try {
    s.b->recv(Deadline::after(20s));
    ADD_FAILURE() << "recv returned a frame";
  } catch (const PeerLost& e) {
    EXPECT_NE(std::string(e.what()).find("closed the session"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(t0), 5.0);  // far below the 30 s reconnect_timeout
  EXPECT_THROW(s.b->send(frame_for(0, 10), Deadline::after(1s)), PeerLost);
}

TEST(ResilientLinkTest, PeerThatRestartedIsLostNotResumed) {
  ResilientOptions o;
  o.backoff_initial = 1ms;
  o.goodbye = false;  // the old b crashes: no goodbye
  Session s(o);
  s.a->send(frame_for(0, 10), Deadline::after(5s));
  ASSERT_EQ(check_frame(s.b->recv(Deadline::after(5s)), 0, 10), "");
  s.b->send(frame_for(0, 10), Deadline::after(5s));
  ASSERT_EQ(check_frame(s.a->recv(Deadline::after(5s)), 0, 10), "");
  const uint64_t old_session = s.b->session_id();
  s.b.reset();  // the peer process "restarts": a new ResilientLink accepts a's redial
  Reconnect accept = [&](Deadline d) -> std::unique_ptr<Link> { return s.listener().accept(d, "site-a"); };
  ResilientLink restarted(nullptr, accept, o);
  EXPECT_NE(restarted.session_id(), old_session);
  try {
    s.a->recv(Deadline::after(10s));
    ADD_FAILURE() << "recv returned a frame";
  } catch (const PeerLost& e) {
    EXPECT_NE(std::string(e.what()).find("new session"), std::string::npos) << e.what();
  }
  restarted.close();
}

TEST(ResilientLinkTest, RejectsReservedFrameTypesAndBadOptions) {
  Session s(ResilientOptions{});
  EXPECT_THROW(s.a->send(make_frame(FrameType::kAck, 0, 0, {}), Deadline::after(1s)), Error);
  EXPECT_THROW(s.a->send(make_frame(FrameType::kResume, 0, 0, {}), Deadline::after(1s)), Error);
  EXPECT_THROW(s.a->send(make_frame(FrameType::kPing, 0, 0, u64s({1})), Deadline::after(1s)), Error);
  EXPECT_THROW(s.a->send(make_frame(FrameType::kPong, 0, 0, u64s({1, 0})), Deadline::after(1s)), Error);
  EXPECT_THROW(s.a->send(make_frame(FrameType::kHeartbeat, 0, 0, {}), Deadline::after(1s)), Error);
  EXPECT_THROW(s.a->send(make_frame(FrameType::kPart, 0, 0, {}), Deadline::after(1s)), Error);
  Frame bad = make_frame(FrameType::kData, 0, 0, {1, 2, 3});
  bad.payload.pop_back();
  EXPECT_THROW(s.a->send(bad, Deadline::after(1s)), Error);
  ResilientOptions o;
  o.reconnect_timeout = 0ms;
  EXPECT_THROW(ResilientLink(nullptr, [](Deadline) -> std::unique_ptr<Link> { return nullptr; }, o), Error);
  EXPECT_THROW(ResilientLink(nullptr, Reconnect{}, ResilientOptions{}), Error);
  o = ResilientOptions{};
  o.fragment_bytes = 0;
  EXPECT_THROW(ResilientLink(nullptr, [](Deadline) -> std::unique_ptr<Link> { return nullptr; }, o), Error);
  o = ResilientOptions{};
  o.liveness_timeout = -1ms;
  EXPECT_THROW(ResilientLink(nullptr, [](Deadline) -> std::unique_ptr<Link> { return nullptr; }, o), Error);
  // Other caller frame types pass through, with the session seq.
  s.a->send(make_frame(FrameType::kHello, 5, 0, {}), Deadline::after(1s));
  Frame f = s.b->recv(Deadline::after(5s));
  EXPECT_EQ(f.header.type, FrameType::kHello);
  EXPECT_EQ(f.header.op_id, 5u);
  EXPECT_EQ(f.header.seq, 1u);
}

size_t piece_size(uint64_t i) { return i % 3 == 0 ? 200 * 1024 + i : (i * 2654435761u) % 60000; }

// Frames far above the connection's max_payload (16 KiB here, as wan.max_frame bounds every
// frame on the wire) travel in pieces, through cuts every 50 ms, and arrive whole, exactly
// once, with their checksum (combined from the pieces') right.
TEST(ResilientLinkTest, FramesAboveTheLinksMaxPayloadTravelInPiecesExactlyOnceThroughCuts) {
  ResilientOptions o = cut_options();
  o.fragment_bytes = 16 * 1024;
  LinkOptions link;
  link.max_payload = 16 * 1024;
  Session s(o, link);
  constexpr size_t kFrames = 300;
  const int cuts = exchange_both_ways_under_cuts(s, kFrames, piece_size, 2000us);
  for (auto* l : {s.a.get(), s.b.get()}) {
    auto st = l->stats_ex();
    print_stats("link", st);
    EXPECT_EQ(st.link.frames_received, kFrames);
    EXPECT_GT(st.pieces_sent, kFrames / 3 * 13);  // 200 KiB in 16 KiB pieces: 13 each at least
    EXPECT_EQ(st.pending_frames, 0u);
    // On the wire: every frame once at least, plus pieces' headers, acks, probes, resumes and
    // re-sends, over every connection of the session.
    const LinkStats ls = l->stats();
    EXPECT_GT(ls.wire_bytes_sent, ls.bytes_sent + (kFrames / 3 * 13) * wire::kHeaderSize);
    EXPECT_GT(ls.wire_bytes_received, ls.bytes_received);
  }
  EXPECT_GT(cuts, 3);
  EXPECT_GT(s.a->stats_ex().reconnects + s.b->stats_ex().reconnects, 0u);
  EXPECT_THROW(s.a->recv(Deadline::after(100ms)), Timeout);
  EXPECT_THROW(s.b->recv(Deadline::after(100ms)), Timeout);
}

// send_shared keeps the caller's frame itself until the peer acknowledges it (no copy: the
// pending queue holds a second reference), sends it in pieces from where it lies, and lets
// go of it once acknowledged. The peer acknowledges only what its caller received. The
// writer thread holds a third reference while it writes a piece (and may still hold it for
// a moment after the peer's ack), so the counts are read as "at least 2" before the ack and
// waited for (bounded) after it, never compared at one instant.
TEST(ResilientLinkTest, SharedFramesAreKeptNotCopiedUntilAcknowledged) {
  ResilientOptions o;
  o.fragment_bytes = 16 * 1024;
  Session s(o);
  auto big = std::make_shared<const Frame>(frame_for(5, 100 * 1024));  // 7 pieces
  auto small = std::make_shared<const Frame>(frame_for(6, 10));
  s.a->send_shared(big, Deadline::after(10s));
  s.a->send_shared(small, Deadline::after(10s));
  EXPECT_GE(big.use_count(), 2);
  EXPECT_GE(small.use_count(), 2);
  const Frame got_big = s.b->recv(Deadline::after(10s));
  const Frame got_small = s.b->recv(Deadline::after(10s));
  EXPECT_EQ(check_frame(got_big, 5, 100 * 1024), "");
  EXPECT_EQ(check_frame(got_small, 6, 10), "");
  EXPECT_EQ(got_big.header.seq, 1u);
  EXPECT_EQ(got_small.header.seq, 2u);
  s.a->flush(Deadline::after(10s));  // both acknowledged
  const auto give_up = Clock::now() + 10s;
  while (Clock::now() < give_up && (big.use_count() > 1 || small.use_count() > 1))
    std::this_thread::sleep_for(1ms);
  EXPECT_EQ(big.use_count(), 1);
  EXPECT_EQ(small.use_count(), 1);
  EXPECT_GE(s.a->stats_ex().pieces_sent, 7u);
  EXPECT_THROW(s.a->send_shared(nullptr, Deadline::after(1s)), nebula::Error);
}

// Idle sessions write heartbeats, so neither side takes the other's silence for a dead path.
// Waits for the heartbeats to be counted (bounded) rather than sleeping a fixed time; a
// liveness failure would need 4 s with nothing arriving, three heartbeat periods late.
TEST(ResilientLinkTest, IdleSessionsHeartbeatAndStayConnected) {
  ResilientOptions o;
  o.liveness_timeout = 4s;  // a heartbeat every 1 s
  Session s(o);
  const auto give_up = Clock::now() + 60s;
  while (Clock::now() < give_up &&
         (s.a->stats_ex().heartbeats_sent < 4 || s.b->stats_ex().heartbeats_sent < 4))
    std::this_thread::sleep_for(50ms);
  for (auto* l : {s.a.get(), s.b.get()}) {
    auto st = l->stats_ex();
    EXPECT_GE(st.heartbeats_sent, 4u);
    EXPECT_EQ(st.liveness_failures, 0u);
    EXPECT_EQ(st.reconnects, 0u);
    EXPECT_TRUE(st.connected);
  }
  s.a->send(frame_for(0, 10), Deadline::after(5s));
  EXPECT_EQ(check_frame(s.b->recv(Deadline::after(5s)), 0, 10), "");
}

// A black-holed path (bytes vanish both ways; no FIN, no RST, no error from any layer) is the
// common failure of a real WAN. Without liveness the session hangs on it for good; with
// liveness_timeout = 1 s both sides notice within it, reconnect on a fresh connection, and
// deliver every frame exactly once.
TEST(ResilientLinkTest, ABlackHoledPathIsDetectedWithinTheLivenessTimeoutAndReconnected) {
  for (const bool liveness : {false, true}) {
    SCOPED_TRACE(liveness ? "liveness 1 s" : "no liveness");
    BlackHoledSession session(liveness ? 1s : 0s);
    ResilientLink& a = *session.a;
    ResilientLink& b = *session.b;
    a.send(frame_for(0, 100), Deadline::after(5s));
    EXPECT_EQ(check_frame(b.recv(Deadline::after(5s)), 0, 100), "");
    std::this_thread::sleep_for(600ms);  // the hole is open now
    for (uint64_t i = 1; i < 20; ++i) a.send(frame_for(i, 1000), Deadline::after(5s));
    b.send(frame_for(100, 1000), Deadline::after(5s));
    if (!liveness) {
      // Nothing notices: the frames sit in the hole and the session believes it is connected.
      EXPECT_THROW(b.recv(Deadline::after(2500ms)), Timeout);
      EXPECT_EQ(a.stats_ex().reconnects, 0u);
      EXPECT_TRUE(a.stats_ex().connected);
      continue;
    }
    for (uint64_t i = 1; i < 20; ++i) ASSERT_EQ(check_frame(b.recv(Deadline::after(10s)), i, 1000), "");
    EXPECT_EQ(check_frame(a.recv(Deadline::after(10s)), 100, 1000), "");
    // Resumed because liveness noticed (counted below), not by luck. How long it took is a
    // number, not an assertion here (a loaded machine only adds to it): bench/wan_bench
    // --latency prints it beside liveness_timeout + 2 s, the bound of the issue.
    std::printf("black hole at 0.5 s, liveness_timeout 1 s: resumed %.3f s after the start\n",
                seconds_since(session.created));
    const auto sa = a.stats_ex(), sb = b.stats_ex();
    EXPECT_GE(sa.reconnects, 1u);
    EXPECT_GE(sb.reconnects, 1u);
    EXPECT_GE(sa.liveness_failures + sb.liveness_failures, 1u);
    EXPECT_THROW(b.recv(Deadline::after(100ms)), Timeout);  // exactly once
  }
}

// The estimates on a path whose physics are known: 20 Mbit/s, 25 ms each way. The bounds
// are physical (the RTT cannot be below 50 ms; the rate cannot exceed the bottleneck by
// more than timing noise), not tight timings.
TEST(ResilientLinkTest, EstimatesRttAndBandwidthOfAnEmulatedWanPath) {
  WanEmulation wan;
  wan.bandwidth_bits_per_s = 20e6;
  wan.one_way_delay = 25ms;
  wan.window_bytes = 0;
  auto tcp = make_tcp_pair();
  Reconnect none = [](Deadline) -> std::unique_ptr<Link> { throw PeerLost("peer", "no reconnection in this test"); };
  ResilientLink a(std::make_unique<EmulatedLink>(std::move(tcp.client), wan), none);
  ResilientLink b(std::make_unique<EmulatedLink>(std::move(tcp.server), wan), none);
  EXPECT_EQ(a.estimates().rtt_samples, 0u);
  EXPECT_EQ(a.estimates().bandwidth_bits_per_s, 0);

  constexpr size_t kFrames = 64, kSize = 64 * 1024;  // 4 MiB: about 1.7 s at 20 Mbit/s
  auto receiver = std::async(std::launch::async, [&]() -> std::string {
    for (uint64_t i = 0; i < kFrames; ++i) {
      std::string bad = check_frame(b.recv(Deadline::after(20s)), i, kSize);
      if (!bad.empty()) return bad;
    }
    return {};
  });
  const auto t0 = Clock::now();
  for (uint64_t i = 0; i < kFrames; ++i) a.send(frame_for(i, kSize), Deadline::after(20s));
  a.flush(Deadline::after(20s));
  const double elapsed = seconds_since(t0);
  ASSERT_EQ(receiver.get(), "");

  const LinkEstimates e = a.estimates();
  std::printf("%zu x %zu bytes in %.3f s: rtt %.1f ms (smoothed %.1f ms, %llu samples), bandwidth %.2f Mbit/s "
              "(%llu samples)\n",
              kFrames, kSize, elapsed, e.rtt_s * 1e3, e.rtt_smoothed_s * 1e3, (unsigned long long)e.rtt_samples,
              e.bandwidth_bits_per_s / 1e6, (unsigned long long)e.bandwidth_samples);
  // RTT samples come from pings stamped before their write: every error adds delay, so the
  // path's 50 ms is a hard floor (a CI run saw 43.3 ms when samples ran from a data frame's
  // write returning; WriterScheduledLateAfterItsWrites... checks that case).
  EXPECT_GE(e.rtt_s, 0.050);
  EXPECT_LE(e.rtt_s, 0.2);
  EXPECT_GE(e.rtt_smoothed_s, e.rtt_s);
  EXPECT_LE(e.rtt_smoothed_s, 1.0);
  EXPECT_GE(e.bandwidth_bits_per_s, 0.5 * 20e6);
  EXPECT_LE(e.bandwidth_bits_per_s, 1.5 * 20e6);
  EXPECT_FALSE(e.bandwidth_at_least);  // back-to-back frames filled the path
  EXPECT_GT(e.rtt_samples, 0u);
  EXPECT_GT(e.bandwidth_samples, 0u);
  // The receiving side sent only acks, which nobody acknowledges: it measured nothing.
  EXPECT_EQ(b.estimates().rtt_samples, 0u);
  EXPECT_EQ(b.estimates().bandwidth_bits_per_s, 0);
}

// Frames far below the path's bandwidth-delay product (16 KiB against 20 Mbit/s x 200 ms =
// 500 kB), between pauses, as a small model's exchanges are: a transfer (6.6 ms) shorter than
// the round trip it waits for keeps the round trip in its sample, which can only say the path
// is at least that fast (a sample loses the flag only if its interval reaches two round trips,
// 400 ms, which a loaded machine would have to add) (issue [4/7], finding 5: the controller read a 50 Mbit/s path
// as 6.1 Mbit/s and decided on it as if measured).
TEST(ResilientLinkTest, AFrameSmallerThanTheBandwidthDelayProductGivesALowerBound) {
  WanEmulation wan;
  wan.bandwidth_bits_per_s = 20e6;
  wan.one_way_delay = 100ms;
  auto tcp = make_tcp_pair();
  Reconnect none = [](Deadline) -> std::unique_ptr<Link> { throw PeerLost("peer", "no reconnection in this test"); };
  ResilientLink a(std::make_unique<EmulatedLink>(std::move(tcp.client), wan), none);
  ResilientLink b(std::make_unique<EmulatedLink>(std::move(tcp.server), wan), none);
  constexpr size_t kSize = 16 * 1024;
  for (uint64_t i = 0; i < 2; ++i) {
    auto received = std::async(std::launch::async, [&] { return check_frame(b.recv(Deadline::after(20s)), i, kSize); });
    a.send(frame_for(i, kSize), Deadline::after(20s));
    a.flush(Deadline::after(20s));
    ASSERT_EQ(received.get(), "");
    std::this_thread::sleep_for(100ms);  // a pause: the next frame starts on an idle link
  }
  const LinkEstimates e = a.estimates();
  std::printf("2 x %zu bytes, one at a time: bandwidth %.2f Mbit/s (at least: %d), rtt %.1f ms\n", kSize,
              e.bandwidth_bits_per_s / 1e6, int(e.bandwidth_at_least), e.rtt_s * 1e3);
  ASSERT_GT(e.bandwidth_samples, 0u);
  EXPECT_TRUE(e.bandwidth_at_least);
  EXPECT_LT(e.bandwidth_bits_per_s, 20e6);  // the round trip is in each sample's interval
}

// An exchange as the gateways run it: both sites send one exchange-sized frame and take the
// other's, but site b is still computing and starts 1.5 s late (it sends late and takes a's
// frame late). 1 MiB over 20 Mbit/s, 25 ms each way: 0.42 s of transfer. Site a's own
// exchange takes ~2 s, so bytes / exchange time (what the controller used to see) is ~4
// Mbit/s, and an ack-to-write interval that counted b's wait (the estimator before acks
// carried held_ns) gave ~1 MiB / 1.97 s = 4.3 Mbit/s. The path did not get slower: a's
// estimate must stay near 20 Mbit/s. Bounds are generous (0.5x .. 1.5x), not timings.
TEST(ResilientLinkTest, BandwidthEstimateLeavesOutThePeersWaitBeforeItTakesTheFrame) {
  WanEmulation wan;
  wan.bandwidth_bits_per_s = 20e6;
  wan.one_way_delay = 25ms;
  auto tcp = make_tcp_pair();
  Reconnect none = [](Deadline) -> std::unique_ptr<Link> { throw PeerLost("peer", "no reconnection in this test"); };
  ResilientLink a(std::make_unique<EmulatedLink>(std::move(tcp.client), wan), none);
  ResilientLink b(std::make_unique<EmulatedLink>(std::move(tcp.server), wan), none);
  constexpr size_t kSize = 1 << 20;
  constexpr auto kPeerWait = 1500ms;
  auto late_site = std::async(std::launch::async, [&]() -> std::string {
    std::this_thread::sleep_for(kPeerWait);  // still computing
    b.send(frame_for(1, kSize), Deadline::after(20s));
    std::string bad = check_frame(b.recv(Deadline::after(20s)), 0, kSize);
    b.flush(Deadline::after(20s));
    return bad;
  });
  const auto t0 = Clock::now();
  a.send(frame_for(0, kSize), Deadline::after(20s));
  ASSERT_EQ(check_frame(a.recv(Deadline::after(20s)), 1, kSize), "");
  const double exchange_s = seconds_since(t0);
  a.flush(Deadline::after(20s));
  ASSERT_EQ(late_site.get(), "");

  const double exchange_rate = (kSize + wire::kHeaderSize) * 8.0 / exchange_s;
  const LinkEstimates e = a.estimates();
  std::printf("exchange %.3f s (%.2f Mbit/s by bytes / time), estimate %.2f Mbit/s, rtt %.1f ms\n", exchange_s,
              exchange_rate / 1e6, e.bandwidth_bits_per_s / 1e6, e.rtt_s * 1e3);
  EXPECT_GE(exchange_s, 1.5);  // the wait is real
  EXPECT_GE(e.bandwidth_bits_per_s, 0.5 * 20e6) << "the peer's wait counted as transfer time";
  EXPECT_LE(e.bandwidth_bits_per_s, 1.5 * 20e6);
  EXPECT_GE(e.rtt_s, 0.050);  // the RTT leaves the wait out too, but is never below the path's
  EXPECT_LE(e.rtt_s, 0.5);
  // The late site waited for nothing: its estimate of its own direction is the path's too.
  EXPECT_GE(b.estimates().bandwidth_bits_per_s, 0.5 * 20e6);
  EXPECT_LE(b.estimates().bandwidth_bits_per_s, 1.5 * 20e6);
}

// A sender whose writer thread is scheduled late after each write returns (as on a loaded
// 2-core machine: a CI run measured 17.1 ms on a 20 ms path). Timing a data frame from its
// write's return would give about 50 - 20 = 30 ms here; the pings are stamped before their
// write, so the estimate cannot go below the path's 50 ms, however late the writer runs.
class LateAfterWrite : public Link {
 public:
  explicit LateAfterWrite(std::unique_ptr<Link> inner) : inner_(std::move(inner)) {}
  void send(const Frame& frame, Deadline deadline) override {
    inner_->send(frame, deadline);
    std::this_thread::sleep_for(20ms);
  }
  Frame recv(Deadline deadline) override { return inner_->recv(deadline); }
  void close() override { inner_->close(); }
  std::string peer() const override { return inner_->peer(); }
  LinkStats stats() const override { return inner_->stats(); }

 private:
  std::unique_ptr<Link> inner_;
};

TEST(ResilientLinkTest, WriterScheduledLateAfterItsWritesNeverMakesTheRttShorterThanThePath) {
  WanEmulation wan;
  wan.bandwidth_bits_per_s = 100e6;
  wan.one_way_delay = 25ms;
  auto tcp = make_tcp_pair();
  Reconnect none = [](Deadline) -> std::unique_ptr<Link> { throw PeerLost("peer", "no reconnection in this test"); };
  ResilientLink a(std::make_unique<LateAfterWrite>(std::make_unique<EmulatedLink>(std::move(tcp.client), wan)), none);
  ResilientLink b(std::make_unique<EmulatedLink>(std::move(tcp.server), wan), none);
  constexpr uint64_t kFrames = 20;
  for (uint64_t i = 0; i < kFrames; ++i) {
    a.send(frame_for(i, 4096), Deadline::after(20s));
    ASSERT_EQ(check_frame(b.recv(Deadline::after(20s)), i, 4096), "");
  }
  a.flush(Deadline::after(20s));
  const LinkEstimates e = a.estimates();
  std::printf("rtt %.1f ms over %llu samples (path 50 ms)\n", e.rtt_s * 1e3, (unsigned long long)e.rtt_samples);
  EXPECT_GT(e.rtt_samples, 0u);
  EXPECT_GE(e.rtt_s, 0.050);
  EXPECT_LE(e.rtt_s, 0.5);
}

}  // namespace
}  // namespace nebula::transport

namespace nebula::transport {
namespace {

// The same black hole in the kernel (issue [4/5]): two network namespaces joined by a veth
// pair; the dialing side's end goes down mid-session, so the path drops every packet both ways
// with no FIN and no RST. Liveness notices within liveness_timeout, the session reconnects once
// the path is back, and every frame arrives exactly once. Needs root and `ip netns`; skipped
// where they are not available.
class NetnsPair {
 public:
  NetnsPair() {
    const std::string id = std::to_string(::getpid() % 100000);
    a_ = "nebA" + id;
    b_ = "nebB" + id;
    const std::string va = "nva" + id, vb = "nvb" + id;
    const std::string net = "10.199." + std::to_string(::getpid() % 250) + ".";
    address_a_ = net + "1";
    ok_ = sh("ip netns add " + a_) && sh("ip netns add " + b_) &&
          sh("ip link add " + va + " type veth peer name " + vb) && sh("ip link set " + va + " netns " + a_) &&
          sh("ip link set " + vb + " netns " + b_) && sh("ip -n " + a_ + " addr add " + net + "1/30 dev " + va) &&
          sh("ip -n " + b_ + " addr add " + net + "2/30 dev " + vb) && sh("ip -n " + a_ + " link set " + va + " up") &&
          sh("ip -n " + b_ + " link set " + vb + " up");
    vb_ = vb;
  }
  ~NetnsPair() {
    sh("ip netns del " + a_);
    sh("ip netns del " + b_);
  }
  bool ok() const { return ok_; }
  const std::string& address_a() const { return address_a_; }
  // Cuts (down) or restores (up) namespace B's end of the path.
  bool set_b(bool up) { return sh("ip -n " + b_ + " link set " + vb_ + (up ? " up" : " down")); }
  // Runs f on a thread inside namespace A or B (sockets made there stay there).
  template <typename F>
  auto in(bool a, F f) {
    const std::string path = "/var/run/netns/" + (a ? a_ : b_);
    return std::async(std::launch::async, [path, f]() mutable {
             const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
             if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) throw Error("cannot enter network namespace " + path);
             ::close(fd);
             return f();
           })
        .get();
  }

 private:
  static bool sh(const std::string& cmd) { return std::system((cmd + " > /dev/null 2>&1").c_str()) == 0; }
  std::string a_, b_, vb_, address_a_;
  bool ok_ = false;
};

TEST(ResilientLinkKernelTest, AVethPathThatGoesSilentIsDetectedAndTheSessionResumesWhenItIsBack) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root for network namespaces";
  NetnsPair ns;
  if (!ns.ok()) GTEST_SKIP() << "`ip netns` / veth not available here";
  LinkOptions lo;
  lo.tcp_user_timeout = 1s;
  auto listener = ns.in(true, [&] { return std::make_unique<TcpListener>(ns.address_a(), 0, lo); });
  const uint16_t port = listener->port();
  Reconnect dial = [&](Deadline d) -> std::unique_ptr<Link> {
    return ns.in(false, [&]() -> std::unique_ptr<Link> { return TcpLink::connect(ns.address_a(), port, "site-a", d, lo); });
  };
  Reconnect accept = [&](Deadline d) -> std::unique_ptr<Link> { return listener->accept(d, "site-b"); };
  ResilientOptions o;
  o.liveness_timeout = 1s;
  o.reconnect_timeout = 20s;
  o.backoff_initial = 10ms;
  o.backoff_max = 200ms;
  o.attempt_timeout = 2s;
  auto first_b = dial(Deadline::after(10s));
  auto first_a = accept(Deadline::after(10s));
  ResilientLink b(std::move(first_b), dial, o);  // in namespace B, dials A
  ResilientLink a(std::move(first_a), accept, o);
  b.send(frame_for(0, 100), Deadline::after(5s));
  ASSERT_EQ(check_frame(a.recv(Deadline::after(5s)), 0, 100), "");

  ASSERT_TRUE(ns.set_b(false));  // the path goes silent: no FIN, no RST
  for (uint64_t i = 1; i < 10; ++i) b.send(frame_for(i, 5000), Deadline::after(5s));
  a.send(frame_for(100, 5000), Deadline::after(5s));
  std::this_thread::sleep_for(2500ms);  // > liveness_timeout: both sides have given the connection up
  const auto during_a = a.stats_ex(), during_b = b.stats_ex();
  EXPECT_FALSE(during_a.connected);
  EXPECT_FALSE(during_b.connected);
  EXPECT_GE(during_a.liveness_failures + during_b.liveness_failures, 1u);
  ASSERT_TRUE(ns.set_b(true));  // back: the next redial gets through
  for (uint64_t i = 1; i < 10; ++i) ASSERT_EQ(check_frame(a.recv(Deadline::after(20s)), i, 5000), "");
  EXPECT_EQ(check_frame(b.recv(Deadline::after(20s)), 100, 5000), "");
  EXPECT_THROW(a.recv(Deadline::after(100ms)), Timeout);  // exactly once
  EXPECT_GE(a.stats_ex().reconnects, 1u);
  EXPECT_GE(b.stats_ex().reconnects, 1u);
  b.close();
  a.close();
  listener->close();
}

}  // namespace
}  // namespace nebula::transport
