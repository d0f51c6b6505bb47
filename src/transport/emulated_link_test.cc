#include "transport/emulated_link.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <thread>

#include "transport/link_test_util.h"

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

TEST(EmulatedLinkTest, OneWayDelay) {
  auto p = make_emulated_pair({0, std::chrono::milliseconds(100)});
  auto start = Clock::now();
  p.client->send(timestamp_frame(0), Deadline::after(5s));
  EXPECT_LT(seconds_since(start), 0.05);  // unlimited bandwidth: send returns at once
  Frame f = p.server->recv(Deadline::after(10s));
  double ms = age_ms(f);
  EXPECT_GE(ms, 95.0);
  EXPECT_LT(ms, 5000.0);
}

// Ten frames back to back share one delay (they are in flight together) rather than
// queueing behind each other.
TEST(EmulatedLinkTest, FramesInFlightArePipelined) {
  auto p = make_emulated_pair({0, std::chrono::milliseconds(100)});
  auto start = Clock::now();
  for (int i = 0; i < 10; ++i) p.client->send(timestamp_frame(i), Deadline::after(5s));
  EXPECT_GE(p.client->in_flight(), 1u);
  for (int i = 0; i < 10; ++i) {
    Frame f = p.server->recv(Deadline::after(10s));
    EXPECT_EQ(f.header.seq, static_cast<uint64_t>(i));
    EXPECT_GE(age_ms(f), 95.0);
  }
  double secs = seconds_since(start);
  EXPECT_GE(secs, 0.095);
  EXPECT_LT(secs, 3 * 0.100);
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
TEST(EmulatedLinkTest, WindowWaitHonoursTheDeadline) {
  WanEmulation emu;
  emu.one_way_delay = 200ms;
  emu.window_bytes = 2000;
  auto p = make_emulated_pair(emu);
  p.client->send(make_frame(FrameType::kData, 0, 0, pattern(1900)), Deadline::after(5s));  // fills the window
  auto start = Clock::now();
  EXPECT_THROW(p.client->send(make_frame(FrameType::kData, 0, 1, pattern(100)), Deadline::after(100ms)), Timeout);
  EXPECT_LT(seconds_since(start), 0.35);  // the ACK would come back after 400 ms
  // Usable: the next frame goes once the window has room, and arrives after the first.
  p.client->send(make_frame(FrameType::kData, 0, 2, pattern(100)), Deadline::after(5s));
  EXPECT_EQ(p.server->recv(Deadline::after(5s)).header.seq, 0u);
  EXPECT_EQ(p.server->recv(Deadline::after(5s)).header.seq, 2u);
  // 10 kB through a 2 kB window takes 5 round trips: a 500 ms deadline runs out mid-frame.
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

TEST(EmulatedLinkTest, StallHoldsFramesForItsDuration) {
  constexpr size_t kWire = 8 + wire::kHeaderSize;  // a timestamp frame
  auto p = make_emulated_pair(with_fault(10ms, {WanFault::Kind::kStall, std::nullopt, kWire, 300ms}));
  p.client->send(timestamp_frame(0), Deadline::after(5s));  // before the stall
  EXPECT_LT(age_ms(p.server->recv(Deadline::after(5s))), 250.0);
  p.client->send(timestamp_frame(1), Deadline::after(5s));  // fires the stall
  p.client->send(timestamp_frame(2), Deadline::after(5s));
  Frame f1 = p.server->recv(Deadline::after(5s));
  Frame f2 = p.server->recv(Deadline::after(5s));
  EXPECT_EQ(f1.header.seq, 1u);
  EXPECT_EQ(f2.header.seq, 2u);
  EXPECT_GE(age_ms(f1), 300.0);
  EXPECT_GE(age_ms(f2), 290.0);
  std::this_thread::sleep_for(100ms);  // the stall is over: delivery is back to normal
  p.client->send(timestamp_frame(3), Deadline::after(5s));
  EXPECT_LT(age_ms(p.server->recv(Deadline::after(5s))), 250.0);
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

}  // namespace
}  // namespace nebula::transport
