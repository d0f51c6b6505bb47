// Goodput of one site pair over the WAN emulator: a single TCP stream against a
// StripedLink of 4 and 8 streams, at several bandwidths and round-trip times.
//   build/bench/wan_bench [seconds per cell, default 2] [--plain]
// --estimate: instead, the link's bandwidth estimate (what the adaptive controller reads)
// beside the emulated bandwidth and beside bytes / exchange time, on the demo's [wan]
// (examples/demo.toml: 50 Mbit/s, 80 ms): gateway exchanges as GatewayMesh runs them (both
// sides send, then take the other's frame) over ResilientLink -> EmulatedLink -> TLS, with
// the peer on time and the peer late (still computing) by twice the transfer time.
// --estimate --tiny: one small exchange on a fast path (ctest runs it: the mode works and
// measures something; the numbers of a tiny run are not the result).
// --latency: the emulator's and the resilient session's reaction times, which the unit tests
// (src/transport/*_test.cc) check by the order of events rather than by the clock: how long
// send() takes on an unlimited 100 ms path, 20 pipelined frames' delivery against one delay,
// a window-blocked send's Timeout against its 100 ms deadline, delivery after a stall ends,
// and a black-holed ResilientLink's resumption against liveness_timeout + 2 s. Plaintext
// loopback links; a few seconds in all.
//
// Every stream runs mutual TLS 1.3 (TlsLink, a throwaway CA made in a temp dir), as between
// real gateways; --plain measures plaintext TcpLinks instead.
//
// Every stream is a loopback TcpLink wrapped in an EmulatedLink with the TCP window model
// (4 MiB, a typical Linux maximum); the streams of one cell share one Bottleneck, so the
// configured bandwidth is the site pair's. One stream cannot exceed window / RTT, which is
// what striping is for. Goodput is payload bytes delivered / (time of the last arrival -
// start of sending): it includes one one-way delay of start-up, so it is slightly below the
// steady state. Each cell sends about `seconds` worth of data at the rate it should reach.
// A plain main printing one table: the ratios are the result, not the absolute numbers.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <filesystem>
#include <unistd.h>

#include "transport/certs.h"
#include "transport/emulated_link.h"
#include "transport/link_test_util.h"
#include "transport/resilient_link.h"
#include "transport/tls_link.h"
#include "transport/striped_link.h"
#include "transport/tcp_link.h"

namespace {

using namespace nebula;
using namespace nebula::transport;
using namespace std::chrono_literals;

constexpr uint64_t kWindow = 4ull << 20;

// TLS contexts of the two ends (null = plaintext).
std::shared_ptr<TlsContext> g_tls_a, g_tls_b;

// One connected stream: (sender side at site-a, receiver side at site-b).
std::pair<std::unique_ptr<Link>, std::unique_ptr<Link>> connect_stream(TcpListener& listener) {
  auto accepted = std::async(std::launch::async, [&]() -> std::unique_ptr<Link> {
    auto tcp = listener.accept(Deadline::after(10s), "site-a");
    if (!g_tls_b) return tcp;
    return TlsLink::server(std::move(tcp), g_tls_b, Deadline::after(10s));
  });
  auto tcp = TcpLink::connect("127.0.0.1", listener.port(), "site-b", Deadline::after(10s));
  std::unique_ptr<Link> client;
  if (g_tls_a) client = TlsLink::client(std::move(tcp), g_tls_a, "site-b", Deadline::after(10s));
  else client = std::move(tcp);
  return {std::move(client), accepted.get()};
}

struct Cell {
  double goodput_bits = 0;  // payload bits per second
  double seconds = 0;
  uint64_t bytes = 0;
};

// One measurement: `streams` connections (1 = a plain EmulatedLink, no striping).
Cell run_cell(double bandwidth, std::chrono::milliseconds rtt, size_t streams, double seconds) {
  const double window_bound = double(streams) * double(kWindow) * 8 / std::chrono::duration<double>(rtt).count();
  const double expected = std::min(bandwidth, window_bound);  // bit/s
  // Frames of ~20 ms at the link's bandwidth, so a cell is many frames and no frame is huge.
  const size_t frame_bytes = std::clamp<size_t>(size_t(bandwidth / 8 * 0.020), 64 << 10, 4 << 20);
  const size_t frames = std::max<size_t>(8, size_t(expected / 8 * seconds / double(frame_bytes)));

  auto bottleneck = std::make_shared<Bottleneck>(bandwidth);
  std::vector<std::unique_ptr<Link>> tx_streams, rx_streams;
  TcpListener listener("127.0.0.1", 0);
  for (size_t i = 0; i < streams; ++i) {
    auto [client, server] = connect_stream(listener);
    rx_streams.push_back(std::move(server));
    WanEmulation emu;
    emu.bandwidth_bits_per_s = bandwidth;
    emu.one_way_delay = rtt / 2;
    emu.window_bytes = kWindow;
    emu.seed = i + 1;
    tx_streams.push_back(std::make_unique<EmulatedLink>(std::move(client), emu, bottleneck));
  }
  std::unique_ptr<Link> tx, rx;
  if (streams == 1) {
    tx = std::move(tx_streams[0]);
    rx = std::move(rx_streams[0]);
  } else {
    tx = std::make_unique<StripedLink>(std::move(tx_streams));
    rx = std::make_unique<StripedLink>(std::move(rx_streams));
  }

  std::vector<uint8_t> payload(frame_bytes);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = uint8_t(i * 131 + 7);
  const wire::Frame frame = wire::make_frame(wire::FrameType::kData, 1, 0, payload);
  const auto deadline = Deadline::after(std::chrono::seconds(int(seconds * 10) + 60));

  const auto start = Clock::now();
  auto receiver = std::async(std::launch::async, [&] {
    uint64_t bytes = 0;
    for (size_t i = 0; i < frames; ++i) bytes += rx->recv(deadline).payload.size();
    return std::make_pair(bytes, Clock::now());
  });
  for (size_t i = 0; i < frames; ++i) tx->send(frame, deadline);
  auto [bytes, end] = receiver.get();
  Cell c;
  c.bytes = bytes;
  c.seconds = std::chrono::duration<double>(end - start).count();
  c.goodput_bits = double(bytes) * 8 / c.seconds;
  return c;
}

// One gateway exchange of `bytes` each way: site a sends at once, site b `late` seconds
// later (it was still computing), and each takes the other's frame.
struct Exchange {
  double exchange_seconds = 0;  // site a: from its send to having b's frame
  double exchange_bits = 0;     // bytes / that time: what the controller used to read
  double estimate_bits = 0;     // a's link estimate after the exchange
  bool estimate_at_least = false;  // ... only a lower bound (smaller than the bandwidth-delay product)
  double rtt_s = 0;
};

Exchange run_exchanges(double bandwidth, std::chrono::milliseconds rtt, size_t bytes, double late, int rounds) {
  TcpListener listener("127.0.0.1", 0);
  auto [client, server] = connect_stream(listener);
  WanEmulation emu;
  emu.bandwidth_bits_per_s = bandwidth;
  emu.one_way_delay = rtt / 2;
  emu.window_bytes = kWindow;
  Reconnect none = [](Deadline) -> std::unique_ptr<Link> { throw PeerLost("peer", "no reconnection in this bench"); };
  ResilientLink a(std::make_unique<EmulatedLink>(std::move(client), emu), none);
  emu.seed = 2;
  ResilientLink b(std::make_unique<EmulatedLink>(std::move(server), emu), none);
  std::vector<uint8_t> payload(bytes);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = uint8_t(i * 131 + 7);
  const wire::Frame frame = wire::make_frame(wire::FrameType::kData, 1, 0, payload);
  const auto deadline = Deadline::after(std::chrono::seconds(120));
  Exchange x;
  for (int r = 0; r < rounds; ++r) {
    auto peer = std::async(std::launch::async, [&] {
      std::this_thread::sleep_for(std::chrono::duration<double>(late));
      b.send(frame, deadline);
      b.recv(deadline);
    });
    const auto start = Clock::now();
    a.send(frame, deadline);
    a.recv(deadline);
    x.exchange_seconds = std::chrono::duration<double>(Clock::now() - start).count();
    peer.get();
    a.flush(deadline);
    b.flush(deadline);
  }
  x.exchange_bits = double(wire::kHeaderSize + bytes) * 8 / x.exchange_seconds;
  x.estimate_bits = a.estimates().bandwidth_bits_per_s;
  x.estimate_at_least = a.estimates().bandwidth_at_least;
  x.rtt_s = a.estimates().rtt_s;
  return x;
}

std::string rate(double bits) {
  char buf[32];
  if (bits >= 1e9)
    std::snprintf(buf, sizeof buf, "%.2f Gbit/s", bits / 1e9);
  else
    std::snprintf(buf, sizeof buf, "%.1f Mbit/s", bits / 1e6);
  return buf;
}

}  // namespace

int estimate_table(bool plain, bool tiny);

// --latency (see the top of the file). Each line: what was measured, the number, the ideal or bound.
int latency_table() {
  auto pair = [] {
    TcpListener listener("127.0.0.1", 0);
    auto accepted = std::async(std::launch::async, [&] { return listener.accept(Deadline::after(10s), "site-a"); });
    auto client = TcpLink::connect("127.0.0.1", listener.port(), "site-b", Deadline::after(10s));
    return std::make_pair(std::move(client), accepted.get());
  };
  auto secs = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  auto frame = [](uint64_t seq, size_t bytes) { return wire::make_frame(wire::FrameType::kData, 0, seq, std::vector<uint8_t>(bytes, 7)); };
  std::printf("WAN emulator and resilient session reaction times (plaintext loopback)\n");
  {
    auto [c, s] = pair();
    EmulatedLink link(std::move(c), {0, 100ms});
    const auto t = Clock::now();
    link.send(frame(0, 8), Deadline::after(5s));
    const double sent = secs(t);
    s->recv(Deadline::after(5s));
    std::printf("  unlimited bandwidth, 100 ms delay: send() returned after %.3f ms (ideal 0), frame arrived after %.1f ms (ideal 100)\n",
                sent * 1e3, secs(t) * 1e3);
  }
  {
    auto [c, s] = pair();
    EmulatedLink link(std::move(c), {0, 200ms});
    const auto t = Clock::now();
    for (uint64_t i = 0; i < 20; ++i) link.send(frame(i, 8), Deadline::after(5s));
    for (int i = 0; i < 20; ++i) s->recv(Deadline::after(10s));
    std::printf("  20 frames, 200 ms delay: all delivered after %.3f s (pipelined ideal 0.200; queued 4.0)\n", secs(t));
  }
  {
    auto [c, s] = pair();
    WanEmulation emu;
    emu.one_way_delay = 200ms;
    emu.window_bytes = 2000;
    EmulatedLink link(std::move(c), emu);
    link.send(frame(0, 1900), Deadline::after(5s));
    const auto t = Clock::now();
    double took = -1;
    try {
      link.send(frame(1, 100), Deadline::after(100ms));
    } catch (const Timeout&) {
      took = secs(t);
    }
    std::printf("  full window, 100 ms deadline: Timeout after %.1f ms (ideal 100; the ACK comes at 400)\n", took * 1e3);
  }
  {
    auto [c, s] = pair();
    WanEmulation emu;
    emu.one_way_delay = 10ms;
    emu.faults.push_back({WanFault::Kind::kStall, std::nullopt, 0, 300ms});
    EmulatedLink link(std::move(c), emu);
    const auto t = Clock::now();
    link.send(frame(0, 8), Deadline::after(5s));  // fires the stall
    s->recv(Deadline::after(5s));
    const double held = secs(t);
    const auto t2 = Clock::now();
    link.send(frame(1, 8), Deadline::after(5s));
    s->recv(Deadline::after(5s));
    std::printf("  300 ms stall: stalled frame after %.1f ms (ideal 300), the next after %.1f ms (ideal 10)\n", held * 1e3,
                secs(t2) * 1e3);
  }
  {
    transport::testing::BlackHoledSession session(1s);
    session.a->send(frame(0, 100), Deadline::after(5s));
    session.b->recv(Deadline::after(5s));
    std::this_thread::sleep_for(600ms);  // the hole is open
    for (uint64_t i = 1; i < 20; ++i) session.a->send(frame(i, 1000), Deadline::after(5s));
    for (int i = 1; i < 20; ++i) session.b->recv(Deadline::after(10s));
    std::printf("  black hole at 0.5 s, liveness_timeout 1 s: resumed %.3f s after the start (bound 0.5 + 1 + 2 = 3.5)\n",
                secs(session.created));
  }
  return 0;
}

int main(int argc, char** argv) {
  double seconds = 2.0;
  bool plain = false, estimate = false, tiny = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--plain") plain = true;
    else if (std::string(argv[i]) == "--estimate") estimate = true;
    else if (std::string(argv[i]) == "--tiny") tiny = true;
    else if (std::string(argv[i]) == "--latency") return latency_table();
    else seconds = std::atof(argv[i]);
  }
  if (!(seconds > 0)) {
    std::fprintf(stderr, "usage: %s [seconds per cell > 0] [--plain] [--estimate [--tiny]] [--latency]\n", argv[0]);
    return 2;
  }
  std::filesystem::path certs;
  if (!plain) {
    certs = std::filesystem::temp_directory_path() / ("nebula-wan-bench-" + std::to_string(::getpid()));
    std::filesystem::create_directories(certs);
    create_ca(certs.string());
    issue_site_certificate(certs.string(), "site-a", "bench");
    issue_site_certificate(certs.string(), "site-b", "bench");
    g_tls_a = TlsContext::create(TlsFiles::for_site(certs.string(), "site-a"));
    g_tls_b = TlsContext::create(TlsFiles::for_site(certs.string(), "site-b"));
  }
  if (estimate) {
    const int rc = estimate_table(plain, tiny);
    if (!certs.empty()) std::filesystem::remove_all(certs);
    return rc;
  }
  const double bandwidths[] = {10e6, 100e6, 1e9};
  const std::chrono::milliseconds rtts[] = {50ms, 200ms};
  const size_t stream_counts[] = {1, 4, 8};

  std::printf("WAN emulator goodput (%s): window %llu MiB per stream, streams share one bottleneck, ~%.1f s per cell\n",
              plain ? "plaintext" : "mutual TLS 1.3", static_cast<unsigned long long>(kWindow >> 20), seconds);
  std::printf("%-13s %-7s %-13s", "bandwidth", "RTT", "window/RTT");
  for (size_t n : stream_counts) std::printf(" | %-21s", (std::to_string(n) + (n == 1 ? " stream" : " streams")).c_str());
  std::printf("\n");
  const auto bench_start = Clock::now();
  for (double bw : bandwidths) {
    for (auto rtt : rtts) {
      const double one_window = double(kWindow) * 8 / std::chrono::duration<double>(rtt).count();
      std::printf("%-13s %-7s %-13s", rate(bw).c_str(), (std::to_string(rtt.count()) + " ms").c_str(),
                  rate(one_window).c_str());
      std::fflush(stdout);
      for (size_t n : stream_counts) {
        Cell c = run_cell(bw, rtt, n, seconds);
        std::printf(" | %-12s %6.1f %%", rate(c.goodput_bits).c_str(), 100 * c.goodput_bits / bw);
        std::fflush(stdout);
      }
      std::printf("\n");
    }
  }
  std::printf("(%% = goodput / configured bandwidth; whole run %.1f s)\n",
              std::chrono::duration<double>(Clock::now() - bench_start).count());
  if (!certs.empty()) std::filesystem::remove_all(certs);
  return 0;
}

int estimate_table(bool plain, bool tiny) {
  // The demo's [wan] (examples/demo.toml); tiny: a fast, short path and a small exchange.
  const double bandwidth = tiny ? 200e6 : 50e6;
  const auto rtt = tiny ? 10ms : 80ms;
  // 64 KiB: about the demo model's int4 exchange, below the path's bandwidth-delay product
  // (500 kB): its estimate can only be a lower bound, marked ">=".
  const std::vector<size_t> sizes = tiny ? std::vector<size_t>{256 << 10} : std::vector<size_t>{64 << 10, 1 << 20, 4 << 20};
  const int rounds = tiny ? 1 : 3;
  std::printf("Bandwidth estimate vs emulated %s, RTT %lld ms (%s), %d exchange(s) per row\n", rate(bandwidth).c_str(),
              static_cast<long long>(rtt.count()), plain ? "plaintext" : "mutual TLS 1.3", rounds);
  std::printf("%-10s %-9s | %-12s | %-12s %7s | %-15s %7s | %s\n", "exchange", "peer late", "emulated", "bytes/time",
              "ratio", "estimate", "ratio", "est. RTT");
  bool measured = true;
  for (size_t bytes : sizes) {
    const double transfer = double(bytes) * 8 / bandwidth;
    for (double late : {0.0, 2 * transfer}) {
      const Exchange x = run_exchanges(bandwidth, rtt, bytes, late, rounds);
      char size[16], wait[16];
      std::snprintf(size, sizeof size, "%.2f MiB", double(bytes) / (1 << 20));
      std::snprintf(wait, sizeof wait, "%.0f ms", late * 1e3);
      std::printf("%-10s %-9s | %-12s | %-12s %6.0f%% | %-15s %6.0f%% | %.1f ms\n", size, wait, rate(bandwidth).c_str(),
                  rate(x.exchange_bits).c_str(), 100 * x.exchange_bits / bandwidth,
                  ((x.estimate_at_least ? ">= " : "") + rate(x.estimate_bits)).c_str(),
                  100 * x.estimate_bits / bandwidth, x.rtt_s * 1e3);
      std::fflush(stdout);
      measured = measured && x.estimate_bits > 0;
    }
  }
  std::printf("(ratio = figure / emulated bandwidth; bytes/time includes the round trip and the wait for the peer; "
              "\">=\": an exchange too small to fill the path gives only a lower bound)\n");
  if (!measured) {
    std::fprintf(stderr, "wan_bench: an exchange left the link without a bandwidth estimate\n");
    return 1;
  }
  return 0;
}
