// Helpers shared by the transport tests.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "transport/tcp_link.h"

namespace nebula::transport::testing {

using namespace std::chrono_literals;

// Deterministic pseudo-random bytes.
inline std::vector<uint8_t> pattern(size_t n, uint32_t seed = 1) {
  std::vector<uint8_t> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    for (int k = 0; k < 8; ++k) v[i + k] = static_cast<uint8_t>(x >> (8 * k));
  }
  for (; i < n; ++i) v[i] = static_cast<uint8_t>(i * 31 + seed);
  return v;
}

struct TcpPair {
  std::unique_ptr<TcpLink> client;  // connected to "site-b"
  std::unique_ptr<TcpLink> server;  // accepted, named "site-a"
};

// A connected pair over 127.0.0.1 on an ephemeral port. Loopback connect completes in
// the kernel's backlog, so no second thread is needed.
inline TcpPair make_tcp_pair(LinkOptions client_options = {}, LinkOptions server_options = {}) {
  TcpListener listener("127.0.0.1", 0, server_options);
  TcpPair p;
  p.client = TcpLink::connect("127.0.0.1", listener.port(), "site-b", Deadline::after(10s), client_options);
  p.server = listener.accept(Deadline::after(10s), "site-a");
  return p;
}

// A plain blocking socket connected to 127.0.0.1:port, for writing raw bytes.
// `from`: the local source address (any of 127.0.0.0/8 is this host), e.g. to look like
// another host to the gateway; empty = the kernel's choice.
inline int raw_connect(uint16_t port, const char* from = nullptr) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (from) {
    sockaddr_in src{};
    src.sin_family = AF_INET;
    ::inet_pton(AF_INET, from, &src.sin_addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0) {
      ::close(fd);
      return -1;
    }
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

inline void raw_write(int fd, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  while (n > 0) {
    ssize_t r = ::send(fd, b, n, MSG_NOSIGNAL);
    if (r <= 0) return;
    b += r;
    n -= static_cast<size_t>(r);
  }
}

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace nebula::transport::testing
