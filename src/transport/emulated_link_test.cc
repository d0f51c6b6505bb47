#include "transport/emulated_link.h"

#include <gtest/gtest.h>

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
}

}  // namespace
}  // namespace nebula::transport
