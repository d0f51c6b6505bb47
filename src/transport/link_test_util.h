// Helpers shared by the transport tests.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include "transport/emulated_link.h"
#include "transport/resilient_link.h"
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

// A Link around another that counts the frames passing through it and can hold them back,
// so a test observes an order of events instead of timing it ("every request reached the
// peer before any answer came back"). While a direction's gate is closed, a call in that
// direction waits for it to open (or for the call's deadline, then goes on to the inner link,
// which throws Timeout) before passing on. Counters: `entered_send()` counts send() calls that
// began (before the gate), `sent()` those that returned, `received()` frames recv() returned, `recv_failed()`
// recv() calls that threw (the peer's EOF, a timeout).
// Thread-safe; close() opens both gates and closes the inner link.
class GatedLink : public Link {
 public:
  explicit GatedLink(std::unique_ptr<Link> inner) : inner_(std::move(inner)) {}
  void send(const wire::Frame& frame, Deadline deadline) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      ++entered_send_;
      cv_.notify_all();
      wait_until(lock, deadline, [&] { return send_open_; });
    }
    inner_->send(frame, deadline);
    std::lock_guard<std::mutex> lock(mu_);
    ++sent_;
    cv_.notify_all();
  }
  wire::Frame recv(Deadline deadline) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wait_until(lock, deadline, [&] { return recv_open_; });
    }
    wire::Frame f;
    try {
      f = inner_->recv(deadline);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      ++recv_failed_;
      cv_.notify_all();
      throw;
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++received_;
    cv_.notify_all();
    return f;
  }
  void close() override {
    open_send(true);
    open_recv(true);
    inner_->close();
  }
  std::string peer() const override { return inner_->peer(); }
  LinkStats stats() const override { return inner_->stats(); }

  void open_send(bool open) { set(send_open_, open); }
  void open_recv(bool open) { set(recv_open_, open); }
  uint64_t entered_send() const { return get(entered_send_); }
  uint64_t sent() const { return get(sent_); }
  uint64_t received() const { return get(received_); }
  uint64_t recv_failed() const { return get(recv_failed_); }
  // Waits (at most until `deadline`) until `counter()` >= n; returns whether it got there.
  bool wait_entered_send(uint64_t n, Deadline deadline) { return wait_for(entered_send_, n, deadline); }
  bool wait_received(uint64_t n, Deadline deadline) { return wait_for(received_, n, deadline); }
  bool wait_recv_failed(uint64_t n, Deadline deadline) { return wait_for(recv_failed_, n, deadline); }

 private:
  template <typename Pred>
  bool wait_until(std::unique_lock<std::mutex>& lock, Deadline deadline, Pred pred) {
    if (deadline.is_never()) {
      cv_.wait(lock, pred);
      return true;
    }
    return cv_.wait_until(lock, deadline.at(), pred);
  }
  void set(bool& gate, bool open) {
    std::lock_guard<std::mutex> lock(mu_);
    gate = open;
    cv_.notify_all();
  }
  uint64_t get(const uint64_t& counter) const {
    std::lock_guard<std::mutex> lock(mu_);
    return counter;
  }
  bool wait_for(const uint64_t& counter, uint64_t n, Deadline deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return wait_until(lock, deadline, [&] { return counter >= n; });
  }

  const std::unique_ptr<Link> inner_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool send_open_ = true;      // guarded by mu_
  bool recv_open_ = true;      // guarded by mu_
  uint64_t entered_send_ = 0;  // guarded by mu_
  uint64_t sent_ = 0;          // guarded by mu_
  uint64_t received_ = 0;      // guarded by mu_
  uint64_t recv_failed_ = 0;   // guarded by mu_
};

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Two ResilientLinks on loopback, "site-a" dialling "site-b", whose first connection is
// black-holed `after` it was made (every byte vanishes both ways: no FIN, no RST, no error from
// any layer), the connections after it clean: the liveness test's path and wan_bench --latency's.
struct BlackHoledSession {
  explicit BlackHoledSession(std::chrono::milliseconds liveness_timeout,
                             std::chrono::milliseconds after = std::chrono::milliseconds(500)) {
    using namespace std::chrono_literals;
    hole.faults.push_back({WanFault::Kind::kBlackhole, after, std::nullopt, {}});
    Reconnect dial = [this](Deadline d) -> std::unique_ptr<Link> {
      auto tcp = TcpLink::connect("127.0.0.1", listener.port(), "site-b", d);
      if (dials++ == 0) return std::make_unique<EmulatedLink>(std::move(tcp), hole);  // the first path dies silently
      return tcp;
    };
    Reconnect accept = [this](Deadline d) -> std::unique_ptr<Link> { return listener.accept(d, "site-a"); };
    ResilientOptions o;
    o.liveness_timeout = liveness_timeout;
    o.backoff_initial = 1ms;
    o.backoff_max = 20ms;
    o.reconnect_timeout = 10s;
    auto first_a = std::async(std::launch::async, [&] { return dial(Deadline::after(10s)); });
    auto first_b = accept(Deadline::after(10s));
    a = std::make_unique<ResilientLink>(first_a.get(), dial, o);
    b = std::make_unique<ResilientLink>(std::move(first_b), accept, o);
  }
  ~BlackHoledSession() { close(); }
  void close() {
    if (a) a->close();
    if (b) b->close();
    listener.close();  // b may be waiting for a to dial again
  }

  TcpListener listener{"127.0.0.1", 0};
  std::atomic<int> dials{0};
  const Clock::time_point created = Clock::now();
  WanEmulation hole;
  std::unique_ptr<ResilientLink> a, b;
};

}  // namespace nebula::transport::testing
