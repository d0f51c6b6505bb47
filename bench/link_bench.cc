// Loopback throughput of the same bytes four ways, side by side in one run:
//   plaintext TcpLink, mutual-TLS TlsLink, the whole WAN session stack a gateway uses
//   (ResilientLink in pieces over a StripedLink of 2 mutual-TLS streams), and c10d
//   ProcessGroupGloo send/recv.
//   build/bench/link_bench [MiB per frame, default 16] [seconds per row, default 2]
// One sender thread and one receiver thread per row, one frame (or tensor) at a time.
// The TLS cost is the ratio TLS / plaintext; Gloo is the intra-site engine for reference.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <future>
#include <string>

#include "transport/certs.h"
#include "transport/resilient_link.h"
#include "transport/striped_link.h"
#include "transport/tcp_link.h"
#include "transport/tls_link.h"

namespace {

using namespace nebula;
using namespace nebula::transport;
using namespace std::chrono_literals;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Bytes per second moving `bytes`-sized frames from tx to rx for about `seconds`.
double link_rate(Link& tx, Link& rx, size_t bytes, double seconds) {
  std::vector<uint8_t> payload(bytes, 0x5a);
  // Shared, as the gateway mesh sends: a ResilientLink keeps it instead of a copy.
  const auto frame = std::make_shared<const wire::Frame>(wire::make_frame(wire::FrameType::kData, 1, 0, payload));
  const auto deadline = Deadline::after(std::chrono::seconds(int(seconds) + 60));
  size_t frames = 0;
  const auto start = Clock::now();
  while (seconds_since(start) < seconds || frames < 4) {
    auto got = std::async(std::launch::async, [&] { return rx.recv(deadline).payload.size(); });
    tx.send_shared(frame, deadline);
    got.get();
    ++frames;
  }
  return double(frames * bytes) / seconds_since(start);
}

double gloo_rate(size_t bytes, double seconds) {
  c10d::TCPStoreOptions so;
  so.port = 0;
  so.isServer = true;
  so.numWorkers = 2;
  so.waitWorkers = false;
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  auto rank = [&](int r) {
    c10d::TCPStoreOptions o;
    o.port = server->getPort();
    auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
    auto opts = c10d::ProcessGroupGloo::Options::create();
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, r, 2, opts);
  };
  auto pg1_future = std::async(std::launch::async, rank, 1);
  auto pg0 = rank(0);
  auto pg1 = pg1_future.get();
  std::vector<at::Tensor> tx{at::full({int64_t(bytes / 4)}, 1.0f)}, rx{at::empty({int64_t(bytes / 4)})};
  size_t n = 0;
  const auto start = Clock::now();
  while (seconds_since(start) < seconds || n < 4) {
    auto got = std::async(std::launch::async, [&] { pg1->recv(rx, 0, 7)->wait(); });
    pg0->send(tx, 1, 7)->wait();
    got.get();
    ++n;
  }
  return double(n * bytes) / seconds_since(start);
}

}  // namespace

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::stoul(argv[1]) : 16;
  const double seconds = argc > 2 ? std::stod(argv[2]) : 2.0;
  const size_t bytes = mib << 20;

  auto certs = std::filesystem::temp_directory_path() / ("nebula-link-bench-" + std::to_string(::getpid()));
  std::filesystem::create_directories(certs);
  create_ca(certs.string());
  issue_site_certificate(certs.string(), "site-a", "bench");
  issue_site_certificate(certs.string(), "site-b", "bench");
  auto ctx_a = TlsContext::create(TlsFiles::for_site(certs.string(), "site-a"));
  auto ctx_b = TlsContext::create(TlsFiles::for_site(certs.string(), "site-b"));

  auto pair = [&](bool tls) {
    TcpListener listener("127.0.0.1", 0);
    auto accepted = std::async(std::launch::async, [&]() -> std::unique_ptr<Link> {
      auto tcp = listener.accept(Deadline::after(10s), "site-a");
      if (!tls) return tcp;
      return TlsLink::server(std::move(tcp), ctx_b, Deadline::after(10s));
    });
    auto tcp = TcpLink::connect("127.0.0.1", listener.port(), "site-b", Deadline::after(10s));
    std::unique_ptr<Link> client;
    if (tls) client = TlsLink::client(std::move(tcp), ctx_a, "site-b", Deadline::after(10s));
    else client = std::move(tcp);
    return std::make_pair(std::move(client), accepted.get());
  };

  // The gateway's stack: 2 TLS streams, striped, under a session (pieces, acks, heartbeats).
  auto session_pair = [&]() {
    std::vector<std::unique_ptr<Link>> a, b;
    for (int k = 0; k < 2; ++k) {
      auto [x, y] = pair(true);
      a.push_back(std::move(x));
      b.push_back(std::move(y));
    }
    LinkOptions lo;
    lo.max_payload = 4 << 20;  // wan.max_frame's default
    Reconnect none = [](Deadline) -> std::unique_ptr<Link> { throw PeerLost("peer", "no reconnection in the bench"); };
    ResilientOptions ro;
    ro.fragment_bytes = 256 * 1024;  // WanConfig::piece_bytes() with the default max_frame
    auto tx = std::make_unique<ResilientLink>(std::make_unique<StripedLink>(std::move(a), lo), none, ro);
    auto rx = std::make_unique<ResilientLink>(std::make_unique<StripedLink>(std::move(b), lo), none, ro);
    return std::make_pair(std::move(tx), std::move(rx));
  };

  std::printf("loopback throughput, %zu MiB per frame, ~%.0f s per row\n", mib, seconds);
  auto [ptx, prx] = pair(false);
  const double plain = link_rate(*ptx, *prx, bytes, seconds);
  auto [ttx, trx] = pair(true);
  const double tls = link_rate(*ttx, *trx, bytes, seconds);
  auto [stx, srx] = session_pair();
  const double session = link_rate(*stx, *srx, bytes, seconds);
  const LinkStats wire = stx->stats();
  const double gloo = gloo_rate(bytes, seconds);
  std::printf("  %-34s %8.2f GB/s\n", "TcpLink (plaintext)", plain / 1e9);
  std::printf("  %-34s %8.2f GB/s   %.0f %% of plaintext\n", "TlsLink (mutual TLS 1.3)", tls / 1e9, 100 * tls / plain);
  std::printf("  %-34s %8.2f GB/s   %.0f %% of plaintext; wire/frame bytes %.4f\n",
              "session (resilient+striped 2+TLS)", session / 1e9, 100 * session / plain,
              double(wire.wire_bytes_sent) / double(wire.bytes_sent));
  std::printf("  %-34s %8.2f GB/s   TLS is %.0f %% of Gloo\n", "c10d Gloo send/recv", gloo / 1e9, 100 * tls / gloo);
  stx->close();
  srx->close();
  std::filesystem::remove_all(certs);
  return 0;
}
