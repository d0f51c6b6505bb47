#include "transport/striped_link.h"

#include <gtest/gtest.h>

#include <functional>
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

// N TCP connections on loopback, stream i of one end paired with stream i of the other.
struct StreamPairs {
  std::vector<std::unique_ptr<Link>> client, server;
};

StreamPairs make_stream_pairs(size_t n) {
  StreamPairs s;
  for (size_t i = 0; i < n; ++i) {
    auto p = make_tcp_pair();
    s.client.push_back(std::move(p.client));
    s.server.push_back(std::move(p.server));
  }
  return s;
}

struct StripedPair {
  std::unique_ptr<StripedLink> client, server;
};

StripedPair make_striped_pair(size_t n) {
  auto s = make_stream_pairs(n);
  return {std::make_unique<StripedLink>(std::move(s.client)), std::make_unique<StripedLink>(std::move(s.server))};
}

void expect_same_frame(const Frame& got, const Frame& want) {
  EXPECT_EQ(got.header.type, want.header.type);
  EXPECT_EQ(got.header.flags, want.header.flags);
  EXPECT_EQ(got.header.op_id, want.header.op_id);
  EXPECT_EQ(got.header.seq, want.header.seq);
  EXPECT_EQ(got.header.codec, want.header.codec);
  EXPECT_EQ(got.header.payload_len, want.header.payload_len);
  EXPECT_EQ(got.header.checksum, want.header.checksum);
  EXPECT_NO_THROW(wire::verify_checksum(got.header, got.payload));
  EXPECT_TRUE(got.payload == want.payload) << "payload of " << want.payload.size() << " bytes differs";
}

TEST(ChunkRangeTest, SplitsAsEquallyAsPossible) {
  EXPECT_EQ(chunk_range(10, 4, 0), std::make_pair(uint64_t(0), uint64_t(3)));
  EXPECT_EQ(chunk_range(10, 4, 1), std::make_pair(uint64_t(3), uint64_t(3)));
  EXPECT_EQ(chunk_range(10, 4, 2), std::make_pair(uint64_t(6), uint64_t(2)));
  EXPECT_EQ(chunk_range(10, 4, 3), std::make_pair(uint64_t(8), uint64_t(2)));
  EXPECT_EQ(chunk_range(1, 4, 0), std::make_pair(uint64_t(0), uint64_t(1)));
  EXPECT_EQ(chunk_range(1, 4, 3), std::make_pair(uint64_t(1), uint64_t(0)));
  EXPECT_EQ(chunk_range(0, 1, 0), std::make_pair(uint64_t(0), uint64_t(0)));
  EXPECT_THROW(chunk_range(10, 4, 4), Error);
}

class StripedLinkTest : public ::testing::TestWithParam<size_t> {};

// Frames of 0, 1, 64 Ki and 100 Mi payload bytes, both directions at once, intact and in order.
TEST_P(StripedLinkTest, DeliversFramesIntactAndInOrderBothWays) {
  const size_t n = GetParam();
  auto p = make_striped_pair(n);
  ASSERT_EQ(p.client->num_streams(), n);
  std::vector<Frame> frames;
  const size_t sizes[] = {0, 1, 64 * 1024, 100u << 20};
  for (size_t i = 0; i < std::size(sizes); ++i)
    frames.push_back(make_frame(i == 1 ? FrameType::kHello : FrameType::kData, 100 + i, 7 * i,
                                pattern(sizes[i], static_cast<uint32_t>(i)), static_cast<uint16_t>(0x100 + i),
                                static_cast<uint8_t>(i)));
  auto sender = [&](StripedLink& link) {
    return std::async(std::launch::async, [&] {
      for (const auto& f : frames) link.send(f, Deadline::after(60s));
    });
  };
  auto receiver = [&](StripedLink& link) {
    return std::async(std::launch::async, [&] {
      for (const auto& want : frames) expect_same_frame(link.recv(Deadline::after(60s)), want);
    });
  };
  auto start = Clock::now();
  auto s1 = sender(*p.client), s2 = sender(*p.server);
  auto r1 = receiver(*p.server), r2 = receiver(*p.client);
  s1.get(), s2.get(), r1.get(), r2.get();
  std::printf("%zu stream(s): 2 x 100 MiB (+ small frames) both ways in %.3f s\n", n, seconds_since(start));

  uint64_t bytes = 0;
  for (const auto& f : frames) bytes += wire::kHeaderSize + f.payload.size();
  for (auto* link : {p.client.get(), p.server.get()}) {
    LinkStats st = link->stats();  // logical: what the callers sent and received
    EXPECT_EQ(st.frames_sent, frames.size());
    EXPECT_EQ(st.frames_received, frames.size());
    EXPECT_EQ(st.bytes_sent, bytes);
    EXPECT_EQ(st.bytes_received, bytes);
    auto per_stream = link->stream_stats();
    ASSERT_EQ(per_stream.size(), n);
    for (const auto& s : per_stream) EXPECT_EQ(s.frames_sent, frames.size());  // one chunk per frame each
  }
  EXPECT_EQ(p.client->peer(), "site-b");
}

INSTANTIATE_TEST_SUITE_P(Streams, StripedLinkTest, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "streams"; });

// The receiving end is a StripedLink; the sending end writes chunk frames by hand on raw
// streams, so every check of recv() can be reached.
struct HandFedStripe {
  std::vector<Link*> raw;  // the sending ends (owned by `owned`)
  std::vector<std::unique_ptr<Link>> owned;
  std::unique_ptr<StripedLink> striped;
};

HandFedStripe make_hand_fed(size_t n) {
  auto s = make_stream_pairs(n);
  HandFedStripe h;
  for (auto& c : s.client) h.raw.push_back(c.get());
  h.owned = std::move(s.client);
  h.striped = std::make_unique<StripedLink>(std::move(s.server));
  return h;
}

ChunkHeader chunk_of(const Frame& f, uint16_t index, uint16_t count, uint64_t logical_seq) {
  ChunkHeader h;
  h.index = index;
  h.count = count;
  h.logical_seq = logical_seq;
  h.original = f.header;
  return h;
}

void send_chunk(Link* link, const Frame& f, ChunkHeader h) {
  auto [off, len] = chunk_range(f.payload.size(), h.count, h.index);
  link->send(make_chunk_frame(h, std::span<const uint8_t>(f.payload).subspan(off, len)), Deadline::after(5s));
}

// send_parts cuts each stream's chunk out of the parts where they lie: chunk boundaries that
// fall inside a part, parts that are empty, and a payload shorter than the streams all
// rebuild the frame as send() would have sent it.
TEST(StripedLinkPartsTest, ChunksCutAcrossPartsRebuildTheFrame) {
  auto p = make_striped_pair(3);
  for (size_t size : {size_t{0}, size_t{2}, size_t{1000}, size_t{1 << 20}}) {
    const std::vector<uint8_t> bytes = pattern(size, static_cast<uint32_t>(size));
    const Frame want = make_frame(FrameType::kData, 77, size, bytes, 1, 3);
    const std::span<const uint8_t> all(bytes);
    const size_t a = size / 5, b = size / 2;  // 1000 bytes: chunks [0,334) [334,667) [667,1000)
    const std::vector<std::span<const uint8_t>> parts = {all.subspan(0, a), all.subspan(a, 0), all.subspan(a, b - a),
                                                         all.subspan(b)};
    auto sender = std::async(std::launch::async, [&] { p.client->send_parts(want.header, parts, Deadline::after(30s)); });
    const Frame got = p.server->recv(Deadline::after(30s));
    sender.get();
    expect_same_frame(got, want);
  }
  EXPECT_EQ(p.client->stats().frames_sent, 4u);
}

TEST(StripedLinkErrorsTest, HandMadeChunksRebuildAndTimeoutKeepsLinkUsable) {
  auto h = make_hand_fed(2);
  Frame f = make_frame(FrameType::kData, 9, 3, pattern(1001), 5, 2);
  send_chunk(h.raw[0], f, chunk_of(f, 0, 2, 0));
  // Half a frame: recv times out, and the chunk that arrived is kept.
  EXPECT_THROW(h.striped->recv(Deadline::after(100ms)), Timeout);
  send_chunk(h.raw[1], f, chunk_of(f, 1, 2, 0));
  expect_same_frame(h.striped->recv(Deadline::after(5s)), f);
}

// Each way a chunk can disagree gives FrameError naming the stream, then PeerLost, and the
// sending end learns at once (its streams are closed).
TEST(StripedLinkErrorsTest, MismatchedChunkIsFrameErrorThenPeerLost) {
  Frame f = make_frame(FrameType::kData, 9, 3, pattern(1000), 0, 0);
  Frame other = make_frame(FrameType::kData, 10, 3, pattern(1000, 2), 0, 0);
  struct Case {
    const char* name;
    std::function<void(HandFedStripe&)> feed;
    FrameError::Kind kind;
    std::string must_mention;
  };
  std::vector<Case> cases = {
      {"wrong logical seq", [&](HandFedStripe& h) { send_chunk(h.raw[1], f, chunk_of(f, 1, 2, 7)); },
       FrameError::Kind::kBadPayload, "stream 1/2"},
      {"wrong index", [&](HandFedStripe& h) { send_chunk(h.raw[1], f, chunk_of(f, 0, 2, 0)); },
       FrameError::Kind::kBadPayload, "stream 1/2"},
      {"wrong count", [&](HandFedStripe& h) { send_chunk(h.raw[1], f, chunk_of(f, 1, 3, 0)); },
       FrameError::Kind::kBadPayload, "stream 1/2"},
      {"chunk of another frame", [&](HandFedStripe& h) { send_chunk(h.raw[1], other, chunk_of(other, 1, 2, 0)); },
       FrameError::Kind::kBadPayload, "stream 1/2"},
      {"not a chunk", [&](HandFedStripe& h) { h.raw[1]->send(f, Deadline::after(5s)); },
       FrameError::Kind::kBadPayload, "stream 1/2"},
      {"bad carried checksum",
       [&](HandFedStripe& h) {
         Frame g = f;
         g.header.checksum ^= 1;
         send_chunk(h.raw[1], g, chunk_of(g, 1, 2, 0));
       },
       FrameError::Kind::kBadPayload, "stream 1/2"},  // disagrees with stream 0 first
      {"both checksums wrong",
       [&](HandFedStripe& h) {
         Frame g = f;
         g.header.checksum ^= 1;
         send_chunk(h.raw[1], g, chunk_of(g, 1, 2, 0));
         send_chunk(h.raw[0], g, chunk_of(g, 0, 2, 0));
       },
       FrameError::Kind::kBadChecksum, "rebuilt from 2 chunks"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto h = make_hand_fed(2);
    if (std::string(c.name) != "both checksums wrong") send_chunk(h.raw[0], f, chunk_of(f, 0, 2, 0));
    c.feed(h);
    try {
      h.striped->recv(Deadline::after(5s));
      ADD_FAILURE() << "expected FrameError";
    } catch (const FrameError& e) {
      EXPECT_EQ(e.kind(), c.kind) << e.what();
      EXPECT_NE(std::string(e.what()).find(c.must_mention), std::string::npos) << e.what();
    }
    EXPECT_THROW(h.striped->recv(Deadline::after(1s)), PeerLost);
    EXPECT_THROW(h.striped->send(f, Deadline::after(1s)), PeerLost);
    for (Link* raw : h.raw) EXPECT_THROW(raw->recv(Deadline::after(5s)), PeerLost);
  }
}

TEST(StripedLinkErrorsTest, ClosingOneStreamBreaksTheLogicalLink) {
  auto s = make_stream_pairs(3);
  Link* client_stream1 = s.client[1].get();
  StripedLink client(std::move(s.client)), server(std::move(s.server));
  Frame f = make_frame(FrameType::kData, 1, 0, pattern(5000));
  client.send(f, Deadline::after(5s));
  expect_same_frame(server.recv(Deadline::after(5s)), f);

  auto blocked = std::async(std::launch::async, [&] { server.recv(Deadline::after(20s)); });
  std::this_thread::sleep_for(50ms);
  client_stream1->close();
  // PeerLost, not the Timeout its 20 s deadline would give: the closed stream broke the link.
  EXPECT_THROW(blocked.get(), PeerLost);
  EXPECT_THROW(client.send(f, Deadline::after(5s)), PeerLost);
  EXPECT_THROW(client.recv(Deadline::after(5s)), PeerLost);
  EXPECT_THROW(server.send(f, Deadline::after(5s)), PeerLost);
  EXPECT_THROW(server.recv(Deadline::after(5s)), PeerLost);
}

// The peer sends its last frames and closes: they are all delivered before PeerLost, even
// once every one of the receiver's streams has seen the EOF (waited for, not slept for). One
// frame fewer than a receiver thread reads ahead (it reads a chunk only while it holds fewer
// than kReadAhead), so each thread reads all its chunks and then the EOF before recv() runs.
TEST(StripedLinkErrorsTest, FramesBeforeAnOrderlyCloseAreDelivered) {
  constexpr size_t kStreams = 4;
  constexpr int kFrames = static_cast<int>(StripedLink::kReadAhead) - 1;
  static_assert(kFrames >= 1);
  auto s = make_stream_pairs(kStreams);
  std::vector<GatedLink*> seen;
  std::vector<std::unique_ptr<Link>> counted;
  for (auto& l : s.server) {
    counted.push_back(std::make_unique<GatedLink>(std::move(l)));
    seen.push_back(static_cast<GatedLink*>(counted.back().get()));
  }
  StripedLink client(std::move(s.client)), server(std::move(counted));
  for (int i = 0; i < kFrames; ++i) client.send(make_frame(FrameType::kData, 0, i, pattern(10000, i)), Deadline::after(5s));
  client.close();
  EXPECT_THROW(client.send(make_frame(FrameType::kData, 0, kFrames, {}), Deadline::after(5s)), PeerLost);
  for (size_t i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(seen[i]->wait_recv_failed(1, Deadline::after(30s))) << "stream " << i << " never saw the EOF";
    EXPECT_EQ(seen[i]->received(), static_cast<uint64_t>(kFrames)) << "stream " << i;
  }
  for (int i = 0; i < kFrames; ++i) EXPECT_EQ(server.recv(Deadline::after(5s)).header.seq, uint64_t(i));
  EXPECT_THROW(server.recv(Deadline::after(5s)), PeerLost);
}

TEST(StripedLinkErrorsTest, SendHonoursTheDeadline) {
  // Two streams sharing an emulated 80 kbit/s path: 100 kB cannot go in 200 ms.
  auto s = make_stream_pairs(2);
  auto bottleneck = std::make_shared<Bottleneck>(80e3);
  std::vector<std::unique_ptr<Link>> slow;
  for (auto& c : s.client) slow.push_back(std::make_unique<EmulatedLink>(std::move(c), WanEmulation{80e3, 0ns}, bottleneck));
  StripedLink client(std::move(slow)), server(std::move(s.server));
  // Timeout, and the link broken after: the 10 s the 100 kB need were not waited out (a send
  // that ignored its deadline would have succeeded).
  EXPECT_THROW(client.send(make_frame(FrameType::kData, 0, 0, pattern(100000)), Deadline::after(200ms)), Timeout);
  EXPECT_THROW(client.send(make_frame(FrameType::kData, 0, 1, {}), Deadline::after(1s)), PeerLost);
  // An expired deadline is refused before anything moves: the link stays usable.
  auto p = make_striped_pair(2);
  EXPECT_THROW(p.client->send(make_frame(FrameType::kData, 0, 0, {}), Deadline::after(-1ms)), Timeout);
  p.client->send(make_frame(FrameType::kData, 0, 1, pattern(10)), Deadline::after(5s));
  EXPECT_EQ(p.server->recv(Deadline::after(5s)).header.seq, 1u);
}

TEST(StripedLinkErrorsTest, ConcurrentRecvIsRefused) {
  auto p = make_striped_pair(2);
  auto blocked = std::async(std::launch::async, [&] { EXPECT_THROW(p.server->recv(Deadline::after(600ms)), Timeout); });
  std::this_thread::sleep_for(100ms);
  try {
    p.server->recv(Deadline::after(100ms));
    ADD_FAILURE() << "expected nebula::Error";
  } catch (const NetworkError& e) {
    ADD_FAILURE() << "expected a precondition error, got " << e.what();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("concurrent recv()"), std::string::npos) << e.what();
  }
  blocked.get();
}

// A stand-in stream with a chosen authenticated identity.
class IdentityLink : public Link {
 public:
  explicit IdentityLink(std::string id) : id_(std::move(id)) {}
  void send(const Frame&, Deadline) override {}
  Frame recv(Deadline) override { throw PeerLost("fake", "closed"); }
  void close() override {}
  std::string peer() const override { return "fake"; }
  LinkStats stats() const override { return {}; }
  std::string peer_identity() const override { return id_; }
  std::string peer_fingerprint() const override { return "fp-" + id_; }

 private:
  std::string id_;
};

TEST(StripedLinkErrorsTest, StreamsMustShareOneIdentity) {
  std::vector<std::unique_ptr<Link>> mixed;
  mixed.push_back(std::make_unique<IdentityLink>("site-b"));
  mixed.push_back(std::make_unique<IdentityLink>("site-c"));
  EXPECT_THROW(StripedLink(std::move(mixed)), AuthError);
  std::vector<std::unique_ptr<Link>> same;
  same.push_back(std::make_unique<IdentityLink>("site-b"));
  same.push_back(std::make_unique<IdentityLink>("site-b"));
  StripedLink link(std::move(same));
  EXPECT_EQ(link.peer_identity(), "site-b");
  EXPECT_EQ(link.peer_fingerprint(), "fp-site-b");
  EXPECT_THROW(StripedLink(std::vector<std::unique_ptr<Link>>{}), Error);
}

// Over window-limited emulated streams (128 KiB window, RTT 100 ms), four stripes move
// 1 MiB several times faster than one stream, which needs >= 7.5 RTTs (physics).
TEST(StripedLinkEmulatedTest, StripingBeatsOneWindow) {
  WanEmulation emu;
  emu.one_way_delay = 50ms;
  emu.window_bytes = 128 * 1024;
  constexpr int kFrames = 4;
  constexpr size_t kBytes = 256 * 1024;
  std::vector<Frame> frames;
  for (int i = 0; i < kFrames; ++i) frames.push_back(make_frame(FrameType::kData, 0, i, pattern(kBytes, i)));
  auto run = [&](size_t n) {
    auto s = make_stream_pairs(n);
    auto bottleneck = std::make_shared<Bottleneck>(0);
    std::vector<std::unique_ptr<Link>> emulated;
    for (size_t i = 0; i < n; ++i) {
      WanEmulation e = emu;
      e.seed = i;
      emulated.push_back(std::make_unique<EmulatedLink>(std::move(s.client[i]), e, bottleneck));
    }
    std::unique_ptr<Link> tx, rx;
    if (n == 1) {
      tx = std::move(emulated[0]);
      rx = std::move(s.server[0]);
    } else {
      tx = std::make_unique<StripedLink>(std::move(emulated));
      rx = std::make_unique<StripedLink>(std::move(s.server));
    }
    auto start = Clock::now();
    auto receiver = std::async(std::launch::async, [&] {
      for (const auto& f : frames) expect_same_frame(rx->recv(Deadline::after(30s)), f);
      return seconds_since(start);
    });
    for (const auto& f : frames) tx->send(f, Deadline::after(30s));
    return receiver.get();
  };
  const double one = run(1);
  const double four = run(4);
  std::printf("1 MiB over a 128 KiB window, RTT 100 ms: 1 stream %.3f s, 4 stripes %.3f s\n", one, four);
  EXPECT_GE(one, 0.9 * 0.75);  // (8 windows - 1) x RTT + one way
  EXPECT_LT(four, 0.6 * one);
}

}  // namespace
}  // namespace nebula::transport
