#include "transport/emulated_link.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <future>
#include <thread>

#include "transport/link_test_util.h"
#include "util/temp_dir.h"

namespace nebula::transport {
namespace {

using namespace nebula::transport::testing;
using wire::Frame;
using wire::FrameType;
using wire::make_frame;

struct EmulatedPair {
  std::unique_ptr<EmulatedLink> client;  // emulated sender side
  std::unique_ptr<TcpLink> server;       // plain receiver side
};

EmulatedPair make_emulated_pair(WanEmulation emu) {
  auto p = make_tcp_pair();
  return {std::make_unique<EmulatedLink>(std::move(p.client), emu), std::move(p.server)};
}

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count());
}

Frame timestamp_frame(uint64_t seq) {
  wire::ByteWriter w;
  w.put_u64(now_ns());
  return make_frame(FrameType::kData, 0, seq, w.take());
}

double age_ms(const Frame& f) {
  wire::ByteReader r(f.payload, "timestamp frame");
  return (static_cast<double>(now_ns()) - static_cast<double>(r.u64())) / 1e6;
}

// The configured rate is a floor on the time a send takes, so ">= 0.9 x" cannot flake.
TEST(EmulatedLinkTest, BandwidthBoundsSendTime) {
  auto p = make_emulated_pair({80e6, std::chrono::nanoseconds(0)});
  constexpr int kFrames = 10;
  constexpr size_t kBytes = 1'000'000;  // 10 MB at 80 Mbit/s = 1.0 s
  auto receiver = std::async(std::launch::async, [&] {
    for (int i = 0; i < kFrames; ++i) {
      Frame f = p.server->recv(Deadline::after(30s));
      EXPECT_EQ(f.header.seq, static_cast<uint64_t>(i));
      EXPECT_TRUE(f.payload == pattern(kBytes, i));
    }
  });
  std::vector<Frame> frames;
  for (int i = 0; i < kFrames; ++i) frames.push_back(make_frame(FrameType::kData, 0, i, pattern(kBytes, i)));
  auto start = Clock::now();
  for (const auto& f : frames) p.client->send(f, Deadline::after(30s));
  double secs = seconds_since(start);
  receiver.get();
  EXPECT_GE(secs, 0.9 * 1.0);
  EXPECT_LT(secs, 5.0);
  std::printf("EmulatedLink 80 Mbit/s: 10 MB sent in %.3f s (ideal 1.000 s)\n", secs);
  EXPECT_EQ(p.client->stats().frames_sent, static_cast<uint64_t>(kFrames));
  EXPECT_EQ(p.client->stats().bytes_sent, kFrames * (kBytes + wire::kHeaderSize));
}

// An EmulatedLink over a GatedLink over the client end of a TCP pair: the gate decides
// when frames leaving the emulator reach the wire.
struct GatedEmulatedPair {
  GatedLink* gate;
  std::unique_ptr<EmulatedLink> client;
  std::unique_ptr<TcpLink> server;
};

GatedEmulatedPair make_gated_emulated_pair(WanEmulation emu) {
  auto p = make_tcp_pair();
  auto gate = std::make_unique<GatedLink>(std::move(p.client));
  GatedLink* g = gate.get();
  return {g, std::make_unique<EmulatedLink>(std::move(gate), emu), std::move(p.server)};
}

// With unlimited bandwidth send() returns once the frame is queued, not once it arrived:
// with the wire held shut under the emulator, send() has returned and nothing has reached
// the wire. The delay is a floor the emulator enforces, so ">= 95 ms" cannot flake. (How
// fast send() returns is a number: bench/wan_bench --latency prints it.)
TEST(EmulatedLinkTest, OneWayDelay) {
  auto p = make_gated_emulated_pair({0, std::chrono::milliseconds(100)});
  p.gate->open_send(false);
  p.client->send(timestamp_frame(0), Deadline::after(5s));
  EXPECT_EQ(p.gate->sent(), 0u);  // returned without waiting for the delivery
  p.gate->open_send(true);
  Frame f = p.server->recv(Deadline::after(10s));
  // (The gate counts a send when the inner link's send returned, which may be after the peer
  // already has the frame: only what entered it is sure here.)
  EXPECT_EQ(p.gate->entered_send(), 1u);
  EXPECT_GE(age_ms(f), 95.0);
}

// Twenty frames back to back share one delay (they are in flight together) rather than
// queueing behind each other. Every send() returns while the wire is held shut (none waits
// for an earlier frame's delivery); then all twenty arrive about one delay after they were
// sent. Queued behind each other the last would arrive 20 delays (4 s) after the first was
// sent; the bound, half of that, leaves ~1.8 s for scheduling on a loaded machine.
TEST(EmulatedLinkTest, FramesInFlightArePipelined) {
  constexpr int kFrames = 20;
  constexpr double kDelay = 0.200;
  auto p = make_gated_emulated_pair({0, std::chrono::milliseconds(200)});
  p.gate->open_send(false);
  auto start = Clock::now();
  for (int i = 0; i < kFrames; ++i) p.client->send(timestamp_frame(i), Deadline::after(5s));
  EXPECT_EQ(p.gate->sent(), 0u);
  EXPECT_EQ(p.client->in_flight() + p.gate->entered_send(), static_cast<size_t>(kFrames));  // all in flight at once
  p.gate->open_send(true);
  for (int i = 0; i < kFrames; ++i) {
    Frame f = p.server->recv(Deadline::after(10s));
    EXPECT_EQ(f.header.seq, static_cast<uint64_t>(i));
    EXPECT_GE(age_ms(f), kDelay * 1000 - 5);
  }
  double secs = seconds_since(start);
  std::printf("%d frames, %.0f ms one-way delay: all delivered %.3f s after the first send\n", kFrames, kDelay * 1000,
              secs);
  EXPECT_GE(secs, kDelay - 0.005);
  EXPECT_LT(secs, kFrames * kDelay / 2);
}

TEST(EmulatedLinkTest, SerializationPastDeadlineTimesOut) {
  auto p = make_emulated_pair({8000, std::chrono::nanoseconds(0)});  // 1 kB/s
  auto start = Clock::now();
  try {
    p.client->send(make_frame(FrameType::kData, 0, 0, pattern(10000)), Deadline::after(100ms));  // needs 10 s
    FAIL() << "expected Timeout";
  } catch (const Timeout& e) {
    EXPECT_EQ(e.peer(), "site-b");
    EXPECT_NE(std::string(e.what()).find("past the deadline"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(start), 1.0);  // refused up front, not after waiting
  // Nothing was sent, so the link is still usable: 50 bytes take 50 ms.
  p.client->send(make_frame(FrameType::kData, 0, 1, pattern(10)), Deadline::after(5s));
  EXPECT_EQ(p.server->recv(Deadline::after(5s)).header.seq, 1u);
  EXPECT_EQ(p.client->stats().frames_sent, 1u);
}

TEST(EmulatedLinkTest, RecvPassesThrough) {
  auto p = make_emulated_pair({1e9, std::chrono::milliseconds(10)});
  p.server->send(make_frame(FrameType::kHello, 7, 0, pattern(100)), Deadline::after(5s));
  Frame f = p.client->recv(Deadline::after(5s));
  EXPECT_EQ(f.header.op_id, 7u);
  EXPECT_EQ(f.payload, pattern(100));
  EXPECT_EQ(p.client->stats().frames_received, 1u);
  EXPECT_EQ(p.client->stats().bytes_received, 140u);
  EXPECT_THROW(p.client->recv(Deadline::after(50ms)), Timeout);
}

TEST(EmulatedLinkTest, CloseDeliversFramesInFlight) {
  auto p = make_emulated_pair({0, std::chrono::milliseconds(100)});
  for (int i = 0; i < 3; ++i) p.client->send(timestamp_frame(i), Deadline::after(5s));
  p.client->close();  // returns once the three have reached the inner link
  EXPECT_THROW(p.client->send(timestamp_frame(9), Deadline::after(1s)), PeerLost);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(p.server->recv(Deadline::after(5s)).header.seq, static_cast<uint64_t>(i));
  EXPECT_THROW(p.server->recv(Deadline::after(5s)), PeerLost);
}

// A Link whose sends fail, to check that the background thread's error comes back typed.
class FailingLink : public Link {
 public:
  void send(const Frame&, Deadline) override { throw Timeout("fake-peer", "fake send timed out"); }
  Frame recv(Deadline) override { throw PeerLost("fake-peer", "fake recv"); }
  void close() override {}
  std::string peer() const override { return "fake-peer"; }
  LinkStats stats() const override { return {}; }
};

TEST(EmulatedLinkTest, BackgroundErrorIsRethrownTyped) {
  EmulatedLink link(std::make_unique<FailingLink>(), {0, std::chrono::milliseconds(10)});
  link.send(make_frame(FrameType::kData, 0, 0, {}), Deadline::after(1s));  // queued: no error yet
  auto start = Clock::now();
  bool got = false;
  while (!got && seconds_since(start) < 5.0) {
    try {
      link.send(make_frame(FrameType::kData, 0, 1, {}), Deadline::after(1s));
      std::this_thread::sleep_for(5ms);
    } catch (const Timeout& e) {
      EXPECT_EQ(e.peer(), "fake-peer");
      EXPECT_STREQ(e.what(), "fake send timed out");
      got = true;
    }
  }
  ASSERT_TRUE(got);
  EXPECT_THROW(link.recv(Deadline::after(1s)), Timeout);  // sticky, in both directions
}

TEST(EmulatedLinkTest, PeerLossReachesTheSender) {
  auto p = make_emulated_pair({0, std::chrono::milliseconds(1)});
  p.server.reset();
  auto start = Clock::now();
  EXPECT_THROW(
      {
        while (seconds_since(start) < 5.0) {
          p.client->send(make_frame(FrameType::kData, 0, 0, pattern(1000)), Deadline::after(1s));
          std::this_thread::sleep_for(2ms);
        }
      },
      PeerLost);
}

TEST(EmulatedLinkTest, RejectsBadSettings) {
  auto p = make_tcp_pair();
  EXPECT_THROW(EmulatedLink(std::move(p.client), {-1, std::chrono::nanoseconds(0)}), Error);
  WanEmulation no_trigger;
  no_trigger.faults.push_back({WanFault::Kind::kCut, std::nullopt, std::nullopt, {}});
  EXPECT_THROW(EmulatedLink(make_tcp_pair().client, no_trigger), Error);
  WanEmulation negative_jitter;
  negative_jitter.jitter = -1ms;
  EXPECT_THROW(EmulatedLink(make_tcp_pair().client, negative_jitter), Error);
  // A shared bottleneck and the link's own settings must agree on the bandwidth.
  EXPECT_THROW(EmulatedLink(make_tcp_pair().client, {10e6, 0ns}, std::make_shared<Bottleneck>(20e6)), Error);
  EXPECT_THROW(Bottleneck(std::nan("")), Error);
}

// Two links sharing a 40 Mbit/s bottleneck, 5 MB each: 10 MB need >= 2 s, whoever sends
// them, and the two interleave (neither finishes at the 1 s it would take alone).
TEST(EmulatedLinkTest, SharedBottleneckIsForTheSitePair) {
  constexpr double kBandwidth = 40e6;
  auto bottleneck = std::make_shared<Bottleneck>(kBandwidth);
  constexpr int kFrames = 5;
  constexpr size_t kBytes = 1'000'000;
  std::vector<EmulatedPair> pairs;
  for (int i = 0; i < 2; ++i) {
    auto p = make_tcp_pair();
    pairs.push_back({std::make_unique<EmulatedLink>(std::move(p.client), WanEmulation{kBandwidth, 0ns}, bottleneck),
                     std::move(p.server)});
  }
  std::vector<Frame> frames;
  for (int i = 0; i < kFrames; ++i) frames.push_back(make_frame(FrameType::kData, 0, i, pattern(kBytes, i)));
  const auto start = Clock::now();
  std::vector<std::future<double>> senders, receivers;
  for (auto& p : pairs) {
    senders.push_back(std::async(std::launch::async, [&] {
      for (const auto& f : frames) p.client->send(f, Deadline::after(30s));
      return seconds_since(start);
    }));
    receivers.push_back(std::async(std::launch::async, [&] {
      for (int i = 0; i < kFrames; ++i) EXPECT_EQ(p.server->recv(Deadline::after(30s)).header.seq, uint64_t(i));
      return seconds_since(start);
    }));
  }
  double first = 1e9, last = 0;
  for (auto& f : senders) {
    double t = f.get();
    first = std::min(first, t);
    last = std::max(last, t);
  }
  for (auto& f : receivers) f.get();
  const double ideal = 2 * kFrames * (kBytes + wire::kHeaderSize) * 8 / kBandwidth;  // 2.0 s
  std::printf("shared 40 Mbit/s bottleneck, 2 x 5 MB: links done after %.3f and %.3f s (ideal %.3f s)\n", first,
              last, ideal);
  EXPECT_GE(last, 0.9 * ideal);
  EXPECT_GE(first, 0.6 * ideal);  // interleaved; one after the other would give 0.5 x
  EXPECT_LT(last, 10.0);
}

// A 256 KiB window over a 200 ms RTT allows 1.25 MiB/s whatever the bandwidth: 2 MiB need
// 8 round trips.
TEST(EmulatedLinkTest, WindowLimitsOneLinkToWindowPerRtt) {
  WanEmulation emu;
  emu.one_way_delay = 100ms;
  emu.window_bytes = 256 * 1024;
  auto p = make_emulated_pair(emu);
  constexpr int kFrames = 32;
  constexpr size_t kBytes = 64 * 1024;
  auto start = Clock::now();
  auto receiver = std::async(std::launch::async, [&] {
    for (int i = 0; i < kFrames; ++i) {
      Frame f = p.server->recv(Deadline::after(30s));
      EXPECT_EQ(f.header.seq, uint64_t(i));
      EXPECT_EQ(f.payload.size(), kBytes);
    }
    return seconds_since(start);
  });
  for (int i = 0; i < kFrames; ++i) p.client->send(make_frame(FrameType::kData, 0, i, pattern(kBytes, i)), Deadline::after(30s));
  double secs = receiver.get();
  const double windows = double(kFrames * kBytes) / double(emu.window_bytes);  // 8
  std::printf("window 256 KiB, RTT 200 ms: 2 MiB delivered in %.3f s (window/RTT bound %.3f s)\n", secs, windows * 0.2);
  EXPECT_GE(secs, 0.9 * windows * 0.2);
  EXPECT_LT(secs, 10.0);
}

// Waiting for the window is bounded by the deadline: before the frame started it is a
// plain Timeout (link usable); once part of it left, the link is broken.
// The RTT (1 s) is ten times the short deadline, so the window is still full when that
// deadline passes however slowly this thread runs (a send that waited for the ACK instead
// would succeed, not throw).
TEST(EmulatedLinkTest, WindowWaitHonoursTheDeadline) {
  WanEmulation emu;
  emu.one_way_delay = 500ms;
  emu.window_bytes = 2000;
  auto p = make_emulated_pair(emu);
  p.client->send(make_frame(FrameType::kData, 0, 0, pattern(1900)), Deadline::after(5s));  // fills the window
  EXPECT_THROW(p.client->send(make_frame(FrameType::kData, 0, 1, pattern(100)), Deadline::after(100ms)), Timeout);
  // Usable: the next frame goes once the window has room, and arrives after the first.
  p.client->send(make_frame(FrameType::kData, 0, 2, pattern(100)), Deadline::after(5s));
  EXPECT_EQ(p.server->recv(Deadline::after(5s)).header.seq, 0u);
  EXPECT_EQ(p.server->recv(Deadline::after(5s)).header.seq, 2u);
  // 10 kB through a 2 kB window takes 5 round trips (5 s): a 500 ms deadline runs out mid-frame.
  try {
    p.client->send(make_frame(FrameType::kData, 0, 3, pattern(10000)), Deadline::after(500ms));
    FAIL() << "expected Timeout";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("now broken"), std::string::npos) << e.what();
  }
  EXPECT_THROW(p.client->send(make_frame(FrameType::kData, 0, 4, {}), Deadline::after(1s)), PeerLost);
  EXPECT_THROW(p.server->recv(Deadline::after(5s)), PeerLost);  // the peer is told
}

// Jitter delays frames by up to `jitter` but never lets one overtake another.
TEST(EmulatedLinkTest, JitterNeverReorders) {
  WanEmulation emu;
  emu.one_way_delay = 20ms;
  emu.jitter = 20ms;
  emu.seed = 42;
  auto p = make_emulated_pair(emu);
  constexpr int kFrames = 1000;
  auto receiver = std::async(std::launch::async, [&] {
    std::vector<double> ages;
    for (int i = 0; i < kFrames; ++i) {
      Frame f = p.server->recv(Deadline::after(30s));
      EXPECT_EQ(f.header.seq, uint64_t(i));
      if (f.header.seq != uint64_t(i)) break;
      ages.push_back(age_ms(f));
    }
    return ages;
  });
  for (int i = 0; i < kFrames; ++i) p.client->send(timestamp_frame(i), Deadline::after(30s));
  auto ages = receiver.get();
  ASSERT_EQ(ages.size(), size_t(kFrames));
  const double lo = *std::min_element(ages.begin(), ages.end());
  const double hi = *std::max_element(ages.begin(), ages.end());
  std::printf("jitter 20 ms on 20 ms: one-way delays %.2f .. %.2f ms over %d frames\n", lo, hi, kFrames);
  EXPECT_GE(lo, 19.9);
  EXPECT_LE(hi, 20 + 20 + 250.0);  // generous slack for scheduling
  EXPECT_GE(hi, 25.0);             // the jitter is there
}

WanEmulation with_fault(std::chrono::nanoseconds delay, WanFault fault) {
  WanEmulation emu;
  emu.one_way_delay = delay;
  emu.faults.push_back(fault);
  return emu;
}

TEST(EmulatedLinkTest, CutAfterBytes) {
  constexpr size_t kWire = 1000 + wire::kHeaderSize;
  auto p = make_emulated_pair(with_fault(5ms, {WanFault::Kind::kCut, std::nullopt, 3 * kWire, {}}));
  for (int i = 0; i < 3; ++i) p.client->send(make_frame(FrameType::kData, 0, i, pattern(1000)), Deadline::after(5s));
  try {
    p.client->send(make_frame(FrameType::kData, 0, 3, pattern(1000)), Deadline::after(5s));
    FAIL() << "expected PeerLost";
  } catch (const PeerLost& e) {
    EXPECT_EQ(e.peer(), "site-b");
    EXPECT_NE(std::string(e.what()).find("cut by WAN emulation fault"), std::string::npos) << e.what();
  }
  // The receiver gets at most the frames sent before the cut, in order, then PeerLost.
  auto start = Clock::now();
  uint64_t next = 0;
  EXPECT_THROW(
      {
        for (;;) EXPECT_EQ(p.server->recv(Deadline::after(5s)).header.seq, next++);
      },
      PeerLost);
  EXPECT_LE(next, 4u);
  EXPECT_LT(seconds_since(start), 5.0);
  EXPECT_THROW(p.client->recv(Deadline::after(1s)), PeerLost);
  EXPECT_THROW(p.client->send(make_frame(FrameType::kData, 0, 9, {}), Deadline::after(1s)), PeerLost);
}

TEST(EmulatedLinkTest, CutAtTimeWakesTheReceiver) {
  auto p = make_emulated_pair(with_fault(5ms, {WanFault::Kind::kCut, 200ms, std::nullopt, {}}));
  auto start = Clock::now();
  EXPECT_THROW(p.server->recv(Deadline::after(10s)), PeerLost);
  EXPECT_GE(seconds_since(start), 0.19);
  EXPECT_LT(seconds_since(start), 5.0);
  try {
    p.client->send(make_frame(FrameType::kData, 0, 0, pattern(10)), Deadline::after(1s));
    FAIL() << "expected PeerLost";
  } catch (const PeerLost& e) {
    EXPECT_NE(std::string(e.what()).find("cut by WAN emulation fault"), std::string::npos) << e.what();
  }
}

// Frames sent during the stall arrive after it (a floor the emulator enforces), and not much
// later; frames before and after it take the 10 ms delay. The upper bounds are half the 2 s
// stall away from what they check, which leaves ~1 s for scheduling on a loaded machine.
TEST(EmulatedLinkTest, StallHoldsFramesForItsDuration) {
  constexpr size_t kWire = 8 + wire::kHeaderSize;  // a timestamp frame
  constexpr double kStallMs = 2000;
  auto p = make_emulated_pair(with_fault(10ms, {WanFault::Kind::kStall, std::nullopt, kWire, 2000ms}));
  p.client->send(timestamp_frame(0), Deadline::after(5s));  // before the stall
  EXPECT_LT(age_ms(p.server->recv(Deadline::after(5s))), kStallMs / 2);
  p.client->send(timestamp_frame(1), Deadline::after(5s));  // fires the stall
  p.client->send(timestamp_frame(2), Deadline::after(5s));
  Frame f1 = p.server->recv(Deadline::after(10s));
  Frame f2 = p.server->recv(Deadline::after(10s));
  EXPECT_EQ(f1.header.seq, 1u);
  EXPECT_EQ(f2.header.seq, 2u);
  EXPECT_GE(age_ms(f1), kStallMs);
  EXPECT_LT(age_ms(f1), kStallMs * 1.5);  // released when the stall ends, not later
  EXPECT_GE(age_ms(f2), kStallMs - 10);
  // f2 came at the end of the stall: it is over, and delivery is back to normal.
  p.client->send(timestamp_frame(3), Deadline::after(5s));
  EXPECT_LT(age_ms(p.server->recv(Deadline::after(5s))), kStallMs / 2);
}

TEST(EmulatedLinkTest, CorruptFlipsAPayloadByte) {
  auto p = make_emulated_pair(with_fault(1ms, {WanFault::Kind::kCorrupt, std::nullopt, 0, {}}));
  p.client->send(make_frame(FrameType::kHeartbeat, 0, 0, {}), Deadline::after(5s));  // no payload: spared
  EXPECT_EQ(p.server->recv(Deadline::after(5s)).header.seq, 0u);
  p.client->send(make_frame(FrameType::kData, 0, 1, pattern(100)), Deadline::after(5s));
  try {
    p.server->recv(Deadline::after(5s));
    FAIL() << "expected FrameError";
  } catch (const FrameError& e) {
    EXPECT_EQ(e.kind(), FrameError::Kind::kBadChecksum) << e.what();
  }
}

// A black hole: from its firing on, nothing crosses either way and nothing says so. The
// sender's frame never arrives and its next send() blocks (a window never acknowledged) until
// its deadline; what the peer sends is read and dropped. No error anywhere: only silence.
TEST(EmulatedLinkTest, BlackholeSilencesBothWaysWithoutAnError) {
  auto p = make_emulated_pair(with_fault(1ms, {WanFault::Kind::kBlackhole, std::nullopt, 2 * (wire::kHeaderSize + 8), {}}));
  p.client->send(timestamp_frame(1), Deadline::after(5s));
  p.client->send(timestamp_frame(2), Deadline::after(5s));
  EXPECT_EQ(p.server->recv(Deadline::after(5s)).header.seq, 1u);
  EXPECT_EQ(p.server->recv(Deadline::after(5s)).header.seq, 2u);
  // The third send fires the fault: it and everything after vanish.
  EXPECT_THROW(p.client->send(timestamp_frame(3), Deadline::after(200ms)), Timeout);
  EXPECT_THROW(p.server->recv(Deadline::after(300ms)), Timeout);
  p.server->send(make_frame(FrameType::kData, 0, 9, pattern(10)), Deadline::after(5s));  // the peer is fine...
  EXPECT_THROW(p.client->recv(Deadline::after(300ms)), Timeout);  // ...and is not heard
  EXPECT_THROW(p.client->send(timestamp_frame(4), Deadline::after(100ms)), Timeout);
  p.client->close();  // close() still ends it at once
  EXPECT_THROW(p.client->send(timestamp_frame(5), Deadline::after(1s)), PeerLost);
}

// ---------------------------------------------------------------------------------------
// Bottleneck slot arithmetic, with explicit moments (no timing).

const Clock::time_point kT0 = Clock::time_point(std::chrono::hours(1));

double secs_after_t0(Clock::time_point t) { return std::chrono::duration<double>(t - kT0).count(); }

// Two mappings of one file hand out the slots one Bottleneck would: back to back.
TEST(BottleneckFileTest, MappingsOfOneFileShareTheClock) {
  nebula::testing::TempDir dir("bottleneck_test");
  const std::string path = dir.file("pair.clock");
  auto a = Bottleneck::in_file(80e6, path);
  auto b = Bottleneck::in_file(80e6, path);
  EXPECT_EQ(std::filesystem::file_size(path), 8u);
  EXPECT_EQ(a->free_at(kT0), kT0);  // a new file is free
  Bottleneck one(80e6);
  constexpr uint64_t kBytes = 100'000;
  const auto t = a->serialization_time(kBytes);
  EXPECT_EQ(t, one.serialization_time(kBytes));
  for (int i = 0; i < 3; ++i) {
    const auto slot = (i % 2 == 0 ? a : b)->reserve(kBytes, kT0);
    const auto expected = one.reserve(kBytes, kT0);
    EXPECT_EQ(slot.start, kT0 + i * t) << "reservation " << i;
    EXPECT_EQ(slot.start, expected.start);
    EXPECT_EQ(slot.end, expected.end);
  }
  EXPECT_EQ(b->free_at(kT0), kT0 + 3 * t);
  // A later opener finds the clock where the others left it; the file keeps its size.
  EXPECT_EQ(Bottleneck::in_file(80e6, path)->free_at(kT0), kT0 + 3 * t);
  EXPECT_EQ(std::filesystem::file_size(path), 8u);
  EXPECT_EQ(Bottleneck::in_file(80e6, dir.file("other.clock"))->free_at(kT0), kT0);
}

TEST(BottleneckFileTest, BadPathThrowsNamingIt) {
  nebula::testing::TempDir dir("bottleneck_test");
  const std::string path = dir.file("no-such-dir/pair.clock");
  try {
    Bottleneck::in_file(80e6, path);
    FAIL() << "expected nebula::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("No such file or directory"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Bottleneck::in_file(-1, dir.file("ok.clock")), Error);
}

// A forked process opens the same file and reserves at the same time as this one: however
// they interleave, together they get every slot exactly once, back to back (none lost to a
// race, none overlapping).
TEST(BottleneckFileTest, ProcessesShareTheClock) {
  nebula::testing::TempDir dir("bottleneck_test");
  const std::string path = dir.file("pair.clock");
  constexpr int kEach = 20'000;
  constexpr uint64_t kBytes = 1000;
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // the child reserves, sends its slot starts up the pipe, and never returns into gtest
    ::close(fds[0]);
    int rc = 0;
    try {
      auto b = Bottleneck::in_file(80e6, path);
      std::vector<int64_t> starts;
      for (int i = 0; i < kEach; ++i) starts.push_back(b->reserve(kBytes, kT0).start.time_since_epoch().count());
      const char* p = reinterpret_cast<const char*>(starts.data());
      for (size_t left = starts.size() * sizeof(int64_t); left > 0 && rc == 0;) {
        const ssize_t n = ::write(fds[1], p, left);
        if (n <= 0) rc = 3;
        else p += n, left -= size_t(n);
      }
    } catch (...) {
      rc = 2;
    }
    ::_exit(rc);
  }
  ::close(fds[1]);
  auto b = Bottleneck::in_file(80e6, path);
  std::vector<Clock::time_point> starts;
  for (int i = 0; i < kEach; ++i) starts.push_back(b->reserve(kBytes, kT0).start);
  int64_t ns = 0;
  size_t got = 0;  // bytes of `ns` read so far
  for (ssize_t n; (n = ::read(fds[0], reinterpret_cast<char*>(&ns) + got, sizeof(ns) - got)) > 0;) {
    got += size_t(n);
    if (got == sizeof(ns)) {
      starts.push_back(Clock::time_point(Clock::duration(ns)));
      got = 0;
    }
  }
  ::close(fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  ASSERT_EQ(starts.size(), size_t(2 * kEach));
  std::sort(starts.begin(), starts.end());
  const auto t = b->serialization_time(kBytes);
  for (int i = 0; i < 2 * kEach; ++i) ASSERT_EQ(starts[i], kT0 + i * t) << "slot " << i;
  EXPECT_EQ(b->free_at(kT0), kT0 + 2 * kEach * t);
}

// Two hosts of 50 Mbit/s egress each, sending over one site pair of 80 Mbit/s.
struct TwoHosts {
  std::shared_ptr<Bottleneck> pair = std::make_shared<Bottleneck>(80e6);
  std::shared_ptr<Bottleneck> host1 = std::make_shared<Bottleneck>(50e6, pair);
  std::shared_ptr<Bottleneck> host2 = std::make_shared<Bottleneck>(50e6, pair);
};

TEST(BottleneckChainTest, OneHostAloneMovesAtItsOwnRate) {
  TwoHosts c;
  constexpr uint64_t kBytes = 1'000'000;
  EXPECT_EQ(c.host1->bandwidth_bits_per_s(), 50e6);
  EXPECT_EQ(c.host1->next(), c.pair);
  EXPECT_EQ(c.host1->serialization_time(kBytes), Bottleneck(50e6).serialization_time(kBytes));  // the slower stage
  const auto slot = c.host1->reserve(kBytes, kT0);
  EXPECT_EQ(slot.start, kT0);
  EXPECT_NEAR(secs_after_t0(slot.end), kBytes * 8 / 50e6, 1e-9);
  // Segments back to back, each reserved once the previous one started (as EmulatedLink does):
  // the host's 50 Mbit/s, not the pair's 80.
  auto now = slot.start;
  auto end = slot.end;
  for (int i = 1; i < 10; ++i) {
    const auto s = c.host1->reserve(kBytes, now);
    now = s.start;
    end = s.end;
  }
  EXPECT_NEAR(secs_after_t0(end), 10 * kBytes * 8 / 50e6, 1e-6);
}

TEST(BottleneckChainTest, HostsShareThePair) {
  TwoHosts c;
  constexpr uint64_t kBytes = 1'000'000;
  const auto a = c.host1->reserve(kBytes, kT0);
  const auto b = c.host2->reserve(kBytes, kT0);
  EXPECT_EQ(a.start, kT0);
  EXPECT_NEAR(secs_after_t0(b.start), kBytes * 8 / 80e6, 1e-9);  // its host was free, the pair was not
  EXPECT_NEAR(secs_after_t0(a.end), kBytes * 8 / 50e6, 1e-9);
  EXPECT_GE(secs_after_t0(b.end), 2 * kBytes * 8 / 80e6 - 1e-9);
  EXPECT_NEAR(secs_after_t0(b.end), 2 * kBytes * 8 / 80e6, 1e-9);
  // The next slot of either host waits for the pair, the busier stage.
  EXPECT_NEAR(secs_after_t0(c.pair->free_at(kT0)), 2 * kBytes * 8 / 80e6, 1e-9);
  EXPECT_EQ(c.host1->free_at(kT0), c.pair->free_at(kT0));
  EXPECT_EQ(c.host2->free_at(kT0), c.pair->free_at(kT0));
}

// Both hosts streaming: 100 Mbit/s offered, the pair's 80 delivered.
TEST(BottleneckChainTest, TwoStreamingHostsGetThePairRate) {
  TwoHosts c;
  constexpr uint64_t kBytes = 64 * 1024;
  constexpr int kSegments = 100;
  Clock::time_point now1 = kT0, now2 = kT0, end = kT0;
  for (int i = 0; i < kSegments; ++i) {
    const auto s1 = c.host1->reserve(kBytes, now1);
    const auto s2 = c.host2->reserve(kBytes, now2);
    now1 = s1.start;
    now2 = s2.start;
    end = std::max({end, s1.end, s2.end});
  }
  EXPECT_NEAR(secs_after_t0(end), 2 * kSegments * kBytes * 8 / 80e6, 1e-6);
}

TEST(BottleneckChainTest, UnlimitedStageInFrontIsTransparent) {
  auto pair = std::make_shared<Bottleneck>(80e6);
  Bottleneck host(0, pair);
  Bottleneck alone(80e6);
  constexpr uint64_t kBytes = 100'000;
  EXPECT_EQ(host.serialization_time(kBytes), alone.serialization_time(kBytes));
  for (const auto now : {kT0, kT0, kT0 + 1ms, kT0 + 1s}) {
    const auto s = host.reserve(kBytes, now);
    const auto expected = alone.reserve(kBytes, now);
    EXPECT_EQ(s.start, expected.start);
    EXPECT_EQ(s.end, expected.end);
    EXPECT_EQ(host.free_at(now), alone.free_at(now));
  }
}

}  // namespace
}  // namespace nebula::transport
