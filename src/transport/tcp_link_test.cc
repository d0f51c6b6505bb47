#include "transport/tcp_link.h"

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <future>
#include <thread>

#include "transport/link_test_util.h"

namespace nebula::transport {
namespace {

using namespace nebula::transport::testing;
using wire::Frame;
using wire::FrameType;
using wire::make_frame;

TEST(TcpLinkTest, DeliversFramesIntactAndInOrder) {
  auto p = make_tcp_pair();
  EXPECT_EQ(p.client->peer(), "site-b");
  EXPECT_EQ(p.server->peer(), "site-a");
  const std::vector<size_t> sizes = {0, 1, 64 * 1024, 100 * 1024 * 1024};
  std::vector<Frame> frames;
  for (size_t i = 0; i < sizes.size(); ++i)
    frames.push_back(make_frame(FrameType::kData, 100 + i, i, pattern(sizes[i], static_cast<uint32_t>(i)), 0, 1));
  auto sender = std::async(std::launch::async, [&] {
    for (const auto& f : frames) p.client->send(f, Deadline::after(60s));
  });
  for (size_t i = 0; i < sizes.size(); ++i) {
    Frame got = p.server->recv(Deadline::after(60s));
    EXPECT_EQ(got.header.op_id, 100 + i);
    EXPECT_EQ(got.header.seq, i);
    EXPECT_EQ(got.header.codec, 1);
    ASSERT_EQ(got.payload.size(), sizes[i]);
    EXPECT_TRUE(got.payload == frames[i].payload) << "payload " << i << " differs";
  }
  sender.get();
}

// send_parts writes the frame of the joined parts: same bytes, same checksum, for parts of any
// sizes (empty ones too); a length that does not match is refused before anything moves.
TEST(TcpLinkTest, SendPartsSendsTheFrameOfTheJoinedParts) {
  auto p = make_tcp_pair();
  const std::vector<uint8_t> bytes = pattern(300 * 1024 + 7);
  const Frame want = make_frame(FrameType::kData, 9, 4, bytes, 3, 2);
  const std::span<const uint8_t> all(bytes);
  const std::vector<std::span<const uint8_t>> parts = {all.subspan(0, 1), all.subspan(1, 0),
                                                       all.subspan(1, 200 * 1024), all.subspan(1 + 200 * 1024)};
  wire::FrameHeader bad = want.header;
  bad.payload_len -= 1;
  EXPECT_THROW(p.client->send_parts(bad, parts, Deadline::after(10s)), nebula::Error);
  auto sender = std::async(std::launch::async, [&] { p.client->send_parts(want.header, parts, Deadline::after(60s)); });
  const Frame got = p.server->recv(Deadline::after(60s));  // checksum verified by recv
  sender.get();
  EXPECT_EQ(got.header.op_id, 9u);
  EXPECT_EQ(got.header.seq, 4u);
  EXPECT_EQ(got.header.flags, 3);
  EXPECT_EQ(got.header.codec, 2);
  EXPECT_EQ(got.header.checksum, want.header.checksum);
  EXPECT_TRUE(got.payload == bytes);
  EXPECT_EQ(p.client->stats().frames_sent, 1u);  // the refused call sent nothing
}

// Not a timed assertion: prints the loopback throughput for large frames (checksums included).
TEST(TcpLinkTest, Throughput100MiBFrames) {
  auto p = make_tcp_pair();
  constexpr size_t kSize = 100 * 1024 * 1024;
  constexpr int kFrames = 4;
  Frame f = make_frame(FrameType::kData, 1, 0, pattern(kSize));
  auto start = Clock::now();
  auto sender = std::async(std::launch::async, [&] {
    for (int i = 0; i < kFrames; ++i) p.client->send(f, Deadline::after(60s));
  });
  for (int i = 0; i < kFrames; ++i) {
    Frame got = p.server->recv(Deadline::after(60s));
    ASSERT_EQ(got.header.checksum, f.header.checksum);
    ASSERT_EQ(got.payload.size(), kSize);
  }
  sender.get();
  double secs = seconds_since(start);
  double mbps = kFrames * kSize / 1e6 / secs;
  std::printf("TcpLink loopback: %d x 100 MiB frames in %.3f s = %.0f MB/s\n", kFrames, secs, mbps);
  RecordProperty("loopback_MBps", static_cast<int>(mbps));
}

TEST(TcpLinkTest, BothDirectionsAtOnce) {
  auto p = make_tcp_pair();
  constexpr int kFrames = 200;
  auto send_all = [](TcpLink* link, uint32_t seed) {
    for (int i = 0; i < kFrames; ++i)
      link->send(make_frame(FrameType::kData, seed, i, pattern(64 * 1024 + i, seed + i)), Deadline::after(30s));
  };
  auto recv_all = [](TcpLink* link, uint32_t seed) {
    for (int i = 0; i < kFrames; ++i) {
      Frame f = link->recv(Deadline::after(30s));
      ASSERT_EQ(f.header.op_id, seed);
      ASSERT_EQ(f.header.seq, static_cast<uint64_t>(i));
      ASSERT_TRUE(f.payload == pattern(64 * 1024 + i, seed + i));
    }
  };
  auto s1 = std::async(std::launch::async, send_all, p.client.get(), 1000);
  auto s2 = std::async(std::launch::async, send_all, p.server.get(), 2000);
  auto r1 = std::async(std::launch::async, recv_all, p.server.get(), 1000);
  auto r2 = std::async(std::launch::async, recv_all, p.client.get(), 2000);
  s1.get();
  s2.get();
  r1.get();
  r2.get();
}

TEST(TcpLinkTest, ConcurrentSendsAreSerialized) {
  auto p = make_tcp_pair();
  constexpr int kThreads = 4, kFrames = 50;
  std::vector<std::future<void>> senders;
  for (int t = 0; t < kThreads; ++t)
    senders.push_back(std::async(std::launch::async, [&, t] {
      for (int i = 0; i < kFrames; ++i)
        p.client->send(make_frame(FrameType::kData, t, i, pattern(10000, t * 1000 + i)), Deadline::after(30s));
    }));
  std::vector<uint64_t> next(kThreads, 0);
  for (int n = 0; n < kThreads * kFrames; ++n) {
    Frame f = p.server->recv(Deadline::after(30s));  // a checksum error would mean interleaving
    ASSERT_LT(f.header.op_id, static_cast<uint64_t>(kThreads));
    EXPECT_EQ(f.header.seq, next[f.header.op_id]++);
  }
  for (auto& s : senders) s.get();
}

TEST(TcpLinkTest, RecvTimeoutThenStillUsable) {
  auto p = make_tcp_pair();
  auto start = Clock::now();
  try {
    p.server->recv(Deadline::after(100ms));
    FAIL() << "expected Timeout";
  } catch (const Timeout& e) {
    EXPECT_EQ(e.peer(), "site-a");
    EXPECT_NE(std::string(e.what()).find("recv header from site-a (127.0.0.1:"), std::string::npos) << e.what();
  }
  double secs = seconds_since(start);
  EXPECT_GE(secs, 0.09);
  EXPECT_LT(secs, 5.0);
  // Nothing of a frame had arrived, so the link is still in step.
  p.client->send(make_frame(FrameType::kHeartbeat, 0, 1, {}), Deadline::after(5s));
  EXPECT_EQ(p.server->recv(Deadline::after(5s)).header.type, FrameType::kHeartbeat);
}

TEST(TcpLinkTest, PeerClosesGivesPeerLost) {
  auto p = make_tcp_pair();
  p.server->close();
  try {
    p.client->recv(Deadline::after(5s));
    FAIL() << "expected PeerLost";
  } catch (const PeerLost& e) {
    EXPECT_EQ(e.peer(), "site-b");
    EXPECT_NE(std::string(e.what()).find("peer closed the connection"), std::string::npos) << e.what();
  }
  // Writes to a closed peer end in PeerLost too (the first may still fit in the buffer).
  p.server.reset();
  auto frame = make_frame(FrameType::kData, 0, 0, pattern(1000));
  EXPECT_THROW(
      {
        for (int i = 0; i < 1000; ++i) p.client->send(frame, Deadline::after(5s));
      },
      PeerLost);
}

TEST(TcpLinkTest, CloseWakesBlockedRecv) {
  auto p = make_tcp_pair();
  auto start = Clock::now();
  auto r = std::async(std::launch::async, [&] { p.client->recv(Deadline::never()); });
  std::this_thread::sleep_for(50ms);
  p.client->close();
  ASSERT_EQ(r.wait_for(5s), std::future_status::ready);
  EXPECT_THROW(r.get(), PeerLost);
  EXPECT_LT(seconds_since(start), 5.0);
  EXPECT_THROW(p.client->send(make_frame(FrameType::kBye, 0, 0, {}), Deadline::after(1s)), PeerLost);
}

TEST(TcpLinkTest, GarbageGivesBadMagicAndBreaksLink) {
  TcpListener listener("127.0.0.1", 0);
  int fd = raw_connect(listener.port());
  ASSERT_GE(fd, 0);
  auto link = listener.accept(Deadline::after(5s), "site-x");
  auto junk = pattern(40, 99);
  raw_write(fd, junk.data(), junk.size());
  try {
    link->recv(Deadline::after(5s));
    FAIL() << "expected FrameError";
  } catch (const FrameError& e) {
    EXPECT_EQ(e.kind(), FrameError::Kind::kBadMagic);
    EXPECT_NE(std::string(e.what()).find("recv header from site-x"), std::string::npos) << e.what();
  }
  try {
    link->recv(Deadline::after(1s));
    FAIL() << "expected PeerLost";
  } catch (const PeerLost& e) {
    EXPECT_NE(std::string(e.what()).find("broken"), std::string::npos) << e.what();
  }
  ::close(fd);
}

TEST(TcpLinkTest, OversizedHeaderGivesTooLargeWithoutAllocating) {
  LinkOptions small;
  small.max_payload = 1 << 20;
  TcpListener listener("127.0.0.1", 0, small);
  int fd = raw_connect(listener.port());
  ASSERT_GE(fd, 0);
  auto link = listener.accept(Deadline::after(5s));
  wire::FrameHeader h;
  h.payload_len = 1ull << 40;  // 1 TiB: allocating it first would throw bad_alloc, not FrameError
  auto bytes = wire::encode_header(h);
  raw_write(fd, bytes.data(), bytes.size());
  try {
    link->recv(Deadline::after(5s));
    FAIL() << "expected FrameError";
  } catch (const FrameError& e) {
    EXPECT_EQ(e.kind(), FrameError::Kind::kTooLarge);
    EXPECT_NE(std::string(e.what()).find("1099511627776"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("1048576"), std::string::npos) << e.what();
  }
  ::close(fd);
}

TEST(TcpLinkTest, CorruptPayloadGivesBadChecksum) {
  TcpListener listener("127.0.0.1", 0);
  int fd = raw_connect(listener.port());
  ASSERT_GE(fd, 0);
  auto link = listener.accept(Deadline::after(5s));
  auto bytes = wire::encode_frame(make_frame(FrameType::kData, 1, 1, pattern(1000)));
  bytes[wire::kHeaderSize + 500] ^= 0x01;
  raw_write(fd, bytes.data(), bytes.size());
  try {
    link->recv(Deadline::after(5s));
    FAIL() << "expected FrameError";
  } catch (const FrameError& e) {
    EXPECT_EQ(e.kind(), FrameError::Kind::kBadChecksum);
  }
  ::close(fd);
}

TEST(TcpLinkTest, TimeoutMidFrameBreaksLink) {
  TcpListener listener("127.0.0.1", 0);
  int fd = raw_connect(listener.port());
  ASSERT_GE(fd, 0);
  auto link = listener.accept(Deadline::after(5s), "site-x");
  auto bytes = wire::encode_frame(make_frame(FrameType::kData, 1, 1, pattern(100)));
  raw_write(fd, bytes.data(), wire::kHeaderSize + 10);  // header and 10 of 100 payload bytes
  EXPECT_THROW(link->recv(Deadline::after(200ms)), Timeout);
  try {
    link->recv(Deadline::after(1s));
    FAIL() << "expected PeerLost";
  } catch (const PeerLost& e) {
    EXPECT_NE(std::string(e.what()).find("broken after"), std::string::npos) << e.what();
  }
  ::close(fd);
}

TEST(TcpLinkTest, PartialSendTimeoutBreaksLink) {
  auto p = make_tcp_pair();
  // Far more than the socket buffers hold, and the server never reads.
  auto big = make_frame(FrameType::kData, 1, 1, std::vector<uint8_t>(64 << 20));
  auto start = Clock::now();
  EXPECT_THROW(p.client->send(big, Deadline::after(100ms)), Timeout);
  EXPECT_LT(seconds_since(start), 5.0);
  try {
    p.client->send(make_frame(FrameType::kHeartbeat, 0, 0, {}), Deadline::after(1s));
    FAIL() << "expected PeerLost";
  } catch (const PeerLost& e) {
    EXPECT_NE(std::string(e.what()).find("link broken after"), std::string::npos) << e.what();
  }
  // The broken side shut the socket down, so the peer learns at once.
  EXPECT_THROW(
      {
        for (;;) p.server->recv(Deadline::after(5s));
      },
      PeerLost);
}

TEST(TcpLinkTest, ConnectToNobodyTimesOut) {
  uint16_t port;
  {
    TcpListener l("127.0.0.1", 0);
    port = l.port();
  }  // closed: nobody listens there now
  auto start = Clock::now();
  try {
    TcpLink::connect("127.0.0.1", port, "site-z", Deadline::after(300ms));
    FAIL() << "expected Timeout";
  } catch (const Timeout& e) {
    EXPECT_EQ(e.peer(), "site-z");
    EXPECT_NE(std::string(e.what()).find(str_cat("127.0.0.1:", port)), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("refused"), std::string::npos) << e.what();
  }
  double secs = seconds_since(start);
  EXPECT_GE(secs, 0.25);
  EXPECT_LT(secs, 5.0);
}

TEST(TcpLinkTest, ConnectRetriesUntilListenerAppears) {
  uint16_t port;
  {
    TcpListener l("127.0.0.1", 0);
    port = l.port();
  }
  auto client = std::async(std::launch::async,
                           [&] { return TcpLink::connect("127.0.0.1", port, "late", Deadline::after(10s)); });
  std::this_thread::sleep_for(300ms);
  TcpListener listener("127.0.0.1", port);
  auto server = listener.accept(Deadline::after(10s));
  auto link = client.get();
  link->send(make_frame(FrameType::kHello, 0, 0, pattern(5)), Deadline::after(5s));
  EXPECT_EQ(server->recv(Deadline::after(5s)).payload, pattern(5));
}

TEST(TcpLinkTest, UnresolvableHostIsAnError) {
  EXPECT_THROW(TcpLink::connect("no-such-host.invalid", 1, "x", Deadline::after(2s)), Error);
}

TEST(TcpLinkTest, AcceptTimesOutAndCloseWakesAccept) {
  TcpListener listener("127.0.0.1", 0);
  auto start = Clock::now();
  EXPECT_THROW(listener.accept(Deadline::after(100ms)), Timeout);
  EXPECT_LT(seconds_since(start), 5.0);
  auto a = std::async(std::launch::async, [&] { listener.accept(Deadline::never()); });
  std::this_thread::sleep_for(50ms);
  listener.close();
  ASSERT_EQ(a.wait_for(5s), std::future_status::ready);
  EXPECT_THROW(a.get(), PeerLost);
}

TEST(TcpLinkTest, PortInUseNamesThePort) {
  TcpListener first("127.0.0.1", 0);
  try {
    TcpListener second("127.0.0.1", first.port());
    FAIL() << "expected Error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find(str_cat("127.0.0.1:", first.port())), std::string::npos) << m;
    EXPECT_NE(m.find("in use"), std::string::npos) << m;
    EXPECT_NE(m.find("port 0"), std::string::npos) << m;
  }
}

// A launcher picks every port of a job before any worker binds one: the picks must differ, in
// one process and across processes (each claims its port in $TMPDIR/nebula-ports-<uid>). Without
// the claims, 400 draws from ~22,000 ports repeat one with probability ~97 %.
TEST(TcpLinkTest, PickedPortsDoNotRepeatBeforeTheyAreBound) {
  char dir_template[] = "/tmp/nebula-pick-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const char* old = std::getenv("TMPDIR");
  const std::string saved = old ? old : "";
  ::setenv("TMPDIR", dir.c_str(), 1);
  std::set<uint16_t> picked;
  for (int i = 0; i < 400; ++i) {
    const uint16_t port = pick_free_port("127.0.0.1");
    EXPECT_TRUE(picked.insert(port).second) << "port " << port << " picked twice";
  }
  // The claims are files a second process sees: a fresh claim blocks, a stale one is taken over.
  const std::string claims = dir + "/nebula-ports-" + std::to_string(::getuid());
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(claims)) {
    ++files;
    EXPECT_TRUE(picked.count(static_cast<uint16_t>(std::stoi(e.path().filename().string()))));
  }
  EXPECT_EQ(files, picked.size());
  if (old) ::setenv("TMPDIR", saved.c_str(), 1); else ::unsetenv("TMPDIR");
  std::filesystem::remove_all(dir);
}

TEST(TcpLinkTest, Ipv6Loopback) {
  std::unique_ptr<TcpListener> listener;
  try {
    listener = std::make_unique<TcpListener>("::1", 0);
  } catch (const Error& e) {
    GTEST_SKIP() << "no IPv6 loopback here: " << e.what();
  }
  auto client = TcpLink::connect("::1", listener->port(), "v6", Deadline::after(5s));
  auto server = listener->accept(Deadline::after(5s));
  EXPECT_EQ(client->address(), str_cat("[::1]:", listener->port()));
  client->send(make_frame(FrameType::kData, 1, 2, pattern(3)), Deadline::after(5s));
  EXPECT_EQ(server->recv(Deadline::after(5s)).payload, pattern(3));
}

TEST(TcpLinkTest, SendChecksPreconditions) {
  auto p = make_tcp_pair();
  Frame f = make_frame(FrameType::kData, 1, 1, pattern(10));
  f.payload.push_back(0);
  try {
    p.client->send(f, Deadline::after(1s));
    FAIL();
  } catch (const NetworkError&) {
    FAIL() << "a precondition is not a network error";
  } catch (const Error&) {
  }
  // The link is unharmed.
  p.client->send(make_frame(FrameType::kData, 1, 1, pattern(10)), Deadline::after(1s));
  EXPECT_EQ(p.server->recv(Deadline::after(5s)).payload.size(), 10u);
}

TEST(TcpLinkTest, StatsAddUp) {
  auto p = make_tcp_pair();
  const std::vector<size_t> sizes = {0, 1, 1000, 70000};
  uint64_t bytes = 0;
  for (size_t n : sizes) {
    p.client->send(make_frame(FrameType::kData, 0, 0, pattern(n)), Deadline::after(5s));
    bytes += wire::kHeaderSize + n;
  }
  for (size_t i = 0; i < sizes.size(); ++i) p.server->recv(Deadline::after(5s));
  p.server->send(make_frame(FrameType::kBye, 0, 0, {}), Deadline::after(5s));
  p.client->recv(Deadline::after(5s));
  LinkStats c = p.client->stats(), s = p.server->stats();
  EXPECT_EQ(c.frames_sent, sizes.size());
  EXPECT_EQ(c.bytes_sent, bytes);
  EXPECT_EQ(s.frames_received, sizes.size());
  EXPECT_EQ(s.bytes_received, bytes);
  EXPECT_EQ(s.frames_sent, 1u);
  EXPECT_EQ(s.bytes_sent, wire::kHeaderSize);
  EXPECT_EQ(c.frames_received, 1u);
  EXPECT_EQ(c.bytes_received, wire::kHeaderSize);
}

TEST(ParseHostPortTest, Valid) {
  EXPECT_EQ(parse_host_port("127.0.0.1:4242"), std::make_pair(std::string("127.0.0.1"), uint16_t{4242}));
  EXPECT_EQ(parse_host_port("[::1]:4242"), std::make_pair(std::string("::1"), uint16_t{4242}));
  EXPECT_EQ(parse_host_port("host:0"), std::make_pair(std::string("host"), uint16_t{0}));
  EXPECT_EQ(parse_host_port("gw.site-b.example:65535"),
            std::make_pair(std::string("gw.site-b.example"), uint16_t{65535}));
  EXPECT_EQ(format_host_port("::1", 5), "[::1]:5");
  EXPECT_EQ(format_host_port("h", 5), "h:5");
}

TEST(ParseHostPortTest, Malformed) {
  for (const char* bad : {"", "host", "host:", ":4242", "host:65536", "host:99999999", "host:-1", "host:42x",
                          "::1:4242", "[::1]4242", "[::1", "[]:1", "a b:1", "host:+42"}) {
    try {
      parse_host_port(bad);
      ADD_FAILURE() << "accepted \"" << bad << "\"";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(str_cat("\"", bad, "\"")), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace nebula::transport
