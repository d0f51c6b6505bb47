#include "transport/tcp_link.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <chrono>
#include <random>
#include <thread>

namespace nebula::transport {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

void set_nonblocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
    throw Error(str_cat("fcntl(O_NONBLOCK) failed: ", errno_text(errno)));
}

void set_nodelay(int fd) {
  int one = 1;
  // Best effort: a socket type without TCP options (e.g. a socketpair in a test) is fine.
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// LinkOptions::tcp_user_timeout. Best effort like TCP_NODELAY (a socketpair has no TCP).
void set_liveness(int fd, std::chrono::milliseconds user_timeout) {
  if (user_timeout.count() <= 0) return;
  unsigned int ms = static_cast<unsigned int>(std::min<long long>(user_timeout.count(), 0x7fffffff));
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof ms);
  int one = 1;
  int idle = static_cast<int>(std::max<long long>(1, user_timeout.count() / 3000));
  int count = 3;
  (void)::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &idle, sizeof idle);
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
}

// Numeric "host:port" of a socket address.
std::string sockaddr_text(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (::getnameinfo(sa, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "?";
  return format_host_port(host, static_cast<uint16_t>(std::atoi(serv)));
}

// Errors worth retrying while the peer process may still be starting up.
bool retryable_connect_error(int err) {
  return err == ECONNREFUSED || err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH ||
         err == ECONNRESET || err == ECONNABORTED || err == EAGAIN;
}

struct AddrInfo {
  addrinfo* head = nullptr;
  ~AddrInfo() {
    if (head) ::freeaddrinfo(head);
  }
};

// Returns 0 on success, else an errno (or -1 for "deadline passed").
int try_connect(const addrinfo* ai, Deadline deadline, int* out_fd) {
  int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
  if (fd < 0) return errno;
  if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
    *out_fd = fd;
    return 0;
  }
  if (errno != EINPROGRESS) {
    int err = errno;
    ::close(fd);
    return err;
  }
  for (;;) {
    pollfd p{fd, POLLOUT, 0};
    int r = ::poll(&p, 1, deadline.poll_timeout_ms());
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) {
      if (!deadline.expired()) continue;
      ::close(fd);
      return -1;
    }
    break;
  }
  int err = 0;
  socklen_t len = sizeof err;
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
  if (err != 0) {
    ::close(fd);
    return err;
  }
  *out_fd = fd;
  return 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------

std::pair<std::string, uint16_t> parse_host_port(const std::string& text) {
  auto bad = [&](const std::string& why) -> Error {
    return Error(str_cat("bad address \"", text, "\": ", why,
                         " (expected host:port, e.g. 127.0.0.1:4242, gateway.site-b:4242 or [::1]:4242)"));
  };
  std::string host, port_text;
  if (!text.empty() && text[0] == '[') {
    auto close = text.find(']');
    if (close == std::string::npos) throw bad("'[' without a matching ']'");
    host = text.substr(1, close - 1);
    if (close + 1 >= text.size() || text[close + 1] != ':') throw bad("no ':port' after the ']'");
    port_text = text.substr(close + 2);
  } else {
    auto colon = text.rfind(':');
    if (colon == std::string::npos) throw bad("no ':port'");
    if (text.find(':') != colon) throw bad("an IPv6 address needs brackets, as in [::1]:4242");
    host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
  }
  if (host.empty()) throw bad("empty host");
  for (char c : host) {
    if (std::isspace(static_cast<unsigned char>(c)) || c == '[' || c == ']' || c == '/')
      throw bad(str_cat("invalid character '", c, "' in host"));
  }
  if (port_text.empty()) throw bad("empty port");
  if (port_text.size() > 5 || !std::all_of(port_text.begin(), port_text.end(), [](char c) { return c >= '0' && c <= '9'; }))
    throw bad(str_cat("port \"", port_text, "\" is not a number in 0..65535"));
  long port = std::stol(port_text);
  if (port > 65535) throw bad(str_cat("port ", port, " is out of range 0..65535"));
  return {host, static_cast<uint16_t>(port)};
}

std::string format_host_port(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos) return str_cat("[", host, "]:", port);
  return str_cat(host, ":", port);
}

// ---------------------------------------------------------------------------------------

std::unique_ptr<TcpLink> TcpLink::connect(const std::string& host, uint16_t port, std::string peer_name,
                                          Deadline deadline, LinkOptions options) {
  const std::string where = format_host_port(host, port);
  if (peer_name.empty()) peer_name = where;
  const auto start = Clock::now();
  auto backoff = std::chrono::milliseconds(20);
  std::string last_error = "none";
  int attempts = 0;
  for (;;) {
    ++attempts;
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    AddrInfo res;
    const std::string port_text = std::to_string(port);
    int gai = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &res.head);
    bool retry = false;
    std::string fatal;
    if (gai == EAI_AGAIN) {
      last_error = str_cat("cannot resolve host: ", ::gai_strerror(gai));
      retry = true;
    } else if (gai != 0) {
      throw Error(str_cat("connect to ", peer_name, " at ", where, ": cannot resolve host \"", host,
                          "\": ", ::gai_strerror(gai), "; check the site's gateway address in the config"));
    } else {
      for (const addrinfo* ai = res.head; ai; ai = ai->ai_next) {
        int fd = -1;
        int err = try_connect(ai, deadline, &fd);
        if (err == 0) {
          auto link = std::make_unique<TcpLink>(fd, peer_name, sockaddr_text(ai->ai_addr, ai->ai_addrlen), options);
          spdlog::debug("connected to {} after {} attempt(s), {:.0f} ms", link->describe(), attempts,
                        ms_since(start));
          return link;
        }
        if (err == -1) break;  // deadline passed during the handshake
        last_error = errno_text(err);
        if (retryable_connect_error(err))
          retry = true;
        else
          fatal = last_error;  // e.g. EAFNOSUPPORT for one family: another address may still work
      }
    }
    if (!retry && !fatal.empty())
      throw PeerLost(peer_name, str_cat("connect to ", peer_name, " at ", where, ": ", fatal));
    if (deadline.expired()) break;
    auto sleep = std::min<Clock::duration>(backoff, deadline.remaining());
    std::this_thread::sleep_for(sleep);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
    if (deadline.expired()) break;
  }
  throw Timeout(peer_name, str_cat("connect to ", peer_name, " at ", where, ": no connection within ",
                                   static_cast<long long>(ms_since(start)), " ms (", attempts,
                                   " attempts, last error: ", last_error,
                                   "); is the peer running and listening there?"));
}

TcpLink::TcpLink(int fd, std::string peer_name, std::string address, LinkOptions options)
    : fd_(fd),
      peer_name_(peer_name.empty() ? address : std::move(peer_name)),
      address_(std::move(address)),
      describe_(peer_name_ == address_ ? address_ : str_cat(peer_name_, " (", address_, ")")),
      options_(options),
      max_payload_(options.max_payload) {
  NEBULA_CHECK(fd >= 0, "invalid socket descriptor ", fd);
  set_nonblocking(fd_);
  set_nodelay(fd_);
  set_liveness(fd_, options_.tcp_user_timeout);
}

TcpLink::TcpLink(std::unique_ptr<TcpLink> tcp)
    : fd_(tcp ? tcp->fd_ : -1),
      peer_name_(tcp ? tcp->peer_name_ : std::string()),
      address_(tcp ? tcp->address_ : std::string()),
      describe_(tcp ? tcp->describe_ : std::string()),
      options_(tcp ? tcp->options_ : LinkOptions{}),
      max_payload_(tcp ? tcp->max_payload_.load() : 0) {
  NEBULA_CHECK(tcp != nullptr, "taking over a null TcpLink");
  NEBULA_CHECK(fd_ >= 0 && !tcp->closed_.load() && !tcp->broken_.load(), "taking over the link to ",
               describe_, ": it is already closed or broken");
  tcp->fd_ = -1;  // its destructor must neither shut down nor close the socket we now own
  tcp->closed_.store(true);
}

TcpLink::~TcpLink() {
  close();
  if (fd_ >= 0) ::close(fd_);
}

void TcpLink::close() {
  if (closed_.exchange(true)) return;
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

LinkStats TcpLink::stats() const {
  LinkStats s = counters_.snapshot();  // read and written on the socket as they are
  s.wire_bytes_sent = s.bytes_sent;
  s.wire_bytes_received = s.bytes_received;
  return s;
}

void TcpLink::mark_broken(const std::string& reason, bool quiet) {
  {
    MutexLock lock(state_mu_);
    if (broken_.load()) return;
    broken_reason_ = reason;
    broken_.store(true);
  }
  if (quiet)
    spdlog::debug("link to {} ended: {}", describe_, reason);
  else
    spdlog::warn("link to {} broken: {}", describe_, reason);
  // Tell the peer at once (it sees EOF rather than waiting on half a frame) and wake a
  // call blocked in the other direction.
  ::shutdown(fd_, SHUT_RDWR);
}

void TcpLink::check_usable(const char* what) const {
  if (closed_.load()) throw PeerLost(peer_name_, str_cat(what, " ", describe_, ": link was closed locally"));
  if (broken_.load()) {
    MutexLock lock(state_mu_);
    throw PeerLost(peer_name_, str_cat(what, " ", describe_, ": link broken after ", broken_reason_,
                                       "; close it and reconnect"));
  }
}

void TcpLink::throw_lost(const char* what, const std::string& detail, bool quiet, bool refused) {
  check_usable(what);  // closed locally, or broken by the other direction: say so
  std::string msg = str_cat(what, " ", describe_, ": ", detail);
  mark_broken(msg, quiet);
  if (refused) throw AuthError(peer_name_, msg);
  throw PeerLost(peer_name_, msg);
}

void TcpLink::wait_ready(short events, Deadline deadline, const char* what, bool frame_progress, size_t done,
                         size_t total) {
  for (;;) {
    pollfd p{fd_, events, 0};
    int r = ::poll(&p, 1, deadline.poll_timeout_ms());
    if (r > 0) return;  // ready, or POLLHUP/POLLERR: the next read/write reports it
    if (r < 0) {
      if (errno == EINTR) continue;
      throw_lost(what, str_cat("poll failed: ", errno_text(errno)), false);
    }
    if (!deadline.expired()) continue;
    check_usable(what);
    std::string msg = str_cat(what, " ", describe_, ": deadline passed after ", done, " of ", total, " bytes");
    if (frame_progress) {
      mark_broken(msg);
      msg += " (the stream is now out of step; the link is broken)";
    }
    throw Timeout(peer_name_, msg);
  }
}

TcpLink::IoResult TcpLink::read_some(uint8_t* p, size_t n) {
  for (;;) {
    ssize_t r = ::recv(fd_, p, n, 0);
    if (r > 0) return IoResult::moved(static_cast<size_t>(r));
    if (r == 0) return IoResult::eof();
    int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) return IoResult::wait(POLLIN);
    return IoResult::failed(errno_text(err));
  }
}

TcpLink::IoResult TcpLink::write_some(const iovec* iov, int iovcnt) {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = static_cast<size_t>(iovcnt);
  for (;;) {
    ssize_t r = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
    if (r > 0) return IoResult::moved(static_cast<size_t>(r));
    int err = r == 0 ? EAGAIN : errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) return IoResult::wait(POLLOUT);
    return IoResult::failed(err == EPIPE || err == ECONNRESET
                                ? str_cat("peer closed the connection (", errno_text(err), ")")
                                : errno_text(err));
  }
}

void TcpLink::read_exact(uint8_t* p, size_t n, Deadline deadline, const char* what, bool frame_progress) {
  size_t got = 0;
  while (got < n) {
    IoResult io = read_some(p + got, n - got);
    switch (io.kind) {
      case IoResult::Kind::kMoved:
        got += io.bytes;
        LinkCounters::add(counters_.bytes_received, io.bytes);
        break;
      case IoResult::Kind::kWait:
        wait_ready(io.events, deadline, what, frame_progress || got > 0, got, n);
        break;
      case IoResult::Kind::kEof: {
        bool mid_frame = frame_progress || got > 0;
        // EOF between frames is how a peer normally says goodbye: no warning for that.
        throw_lost(what,
                   mid_frame ? str_cat("peer closed the connection mid-frame, after ", got, " of ", n, " bytes")
                             : std::string("peer closed the connection"),
                   /*quiet=*/!mid_frame);
      }
      case IoResult::Kind::kFailed:
      case IoResult::Kind::kRefused:
        throw_lost(what, io.error, false, io.kind == IoResult::Kind::kRefused);
    }
  }
}

void TcpLink::write_all(iovec* iov, int iovcnt, size_t total, Deadline deadline, const char* what) {
  size_t sent = 0;
  while (sent < total) {
    while (iovcnt > 0 && iov->iov_len == 0) {
      ++iov;
      --iovcnt;
    }
    IoResult io = write_some(iov, iovcnt);
    switch (io.kind) {
      case IoResult::Kind::kMoved: {
        size_t k = io.bytes;
        sent += k;
        LinkCounters::add(counters_.bytes_sent, k);
        while (k > 0) {
          size_t step = std::min(k, iov->iov_len);
          iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + step;
          iov->iov_len -= step;
          k -= step;
          if (iov->iov_len == 0 && k > 0) {
            ++iov;
            --iovcnt;
          }
        }
        break;
      }
      case IoResult::Kind::kWait:
        wait_ready(io.events, deadline, what, sent > 0 || io.committed, sent, total);
        break;
      case IoResult::Kind::kEof:
        throw_lost(what, "peer closed the connection", false);
      case IoResult::Kind::kFailed:
      case IoResult::Kind::kRefused:
        throw_lost(what, io.error, false, io.kind == IoResult::Kind::kRefused);
    }
  }
}

void TcpLink::send(const wire::Frame& frame, Deadline deadline) {
  const std::span<const uint8_t> payload(frame.payload);
  send_parts(frame.header, PayloadParts(&payload, 1), deadline);
}

void TcpLink::send_parts(const wire::FrameHeader& frame_header, PayloadParts parts, Deadline deadline) {
  const uint64_t size = parts_size(parts);
  NEBULA_CHECK(size == frame_header.payload_len, "send to ", describe_, ": payload has ", size,
               " bytes but header.payload_len is ", frame_header.payload_len);
  NEBULA_CHECK(frame_header.payload_len <= max_payload(), "send to ", describe_, ": payload of ",
               frame_header.payload_len, " bytes exceeds LinkOptions.max_payload ", max_payload());
  NEBULA_CHECK(parts.size() < IOV_MAX, "send to ", describe_, ": ", parts.size(), " payload parts (at most ",
               IOV_MAX - 1, ")");
  std::lock_guard<std::mutex> lock(send_mu_);
  check_usable("send to");
  auto header = wire::encode_header(frame_header);
  std::vector<iovec> iov(1 + parts.size());
  iov[0].iov_base = header.data();
  iov[0].iov_len = header.size();
  for (size_t i = 0; i < parts.size(); ++i) {
    iov[i + 1].iov_base = const_cast<uint8_t*>(parts[i].data());
    iov[i + 1].iov_len = parts[i].size();
  }
  write_all(iov.data(), static_cast<int>(iov.size()), header.size() + size, deadline, "send to");
  LinkCounters::add(counters_.frames_sent, 1);
}

wire::Frame TcpLink::recv(Deadline deadline) {
  std::unique_lock<std::mutex> lock(recv_mu_, std::try_to_lock);
  NEBULA_CHECK(lock.owns_lock(), "concurrent recv() on the link to ", describe_,
               " (one receiving thread per link; see transport/link.h)");
  check_usable("recv from");
  wire::Frame frame;
  std::array<uint8_t, wire::kHeaderSize> header;
  read_exact(header.data(), header.size(), deadline, "recv header from", false);
  try {
    frame.header = wire::decode_header(header, max_payload());
  } catch (const FrameError& e) {
    std::string msg = str_cat("recv header from ", describe_, ": ", e.what());
    mark_broken(msg);
    throw FrameError(e.kind(), msg);
  }
  // Only now, with payload_len validated, is the payload allocated, and only as its bytes
  // arrive: a peer that claims more than it sends holds at most kReadStep of our memory.
  const size_t len = frame.header.payload_len;
  frame.payload.reserve(std::min(len, kReadStep));
  for (size_t got = 0; got < len;) {
    const size_t step = std::min(len - got, kReadStep);
    frame.payload.resize(got + step);
    read_exact(frame.payload.data() + got, step, deadline, "recv payload from", true);
    got += step;
  }
  try {
    wire::verify_checksum(frame.header, frame.payload);
  } catch (const FrameError& e) {
    std::string msg = str_cat("recv payload from ", describe_, ": ", e.what());
    mark_broken(msg);
    throw FrameError(e.kind(), msg);
  }
  LinkCounters::add(counters_.frames_received, 1);
  return frame;
}

// ---------------------------------------------------------------------------------------

TcpListener::TcpListener(const std::string& host, uint16_t port, LinkOptions options) : options_(options) {
  const std::string where = format_host_port(host.empty() ? "0.0.0.0" : host, port);
  addrinfo hints{};
  hints.ai_family = host.empty() ? AF_INET : AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  AddrInfo res;
  const std::string port_text = std::to_string(port);
  int gai = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints, &res.head);
  if (gai != 0)
    throw Error(str_cat("listen on ", where, ": cannot resolve host \"", host, "\": ", ::gai_strerror(gai)));
  int err = 0;
  const char* op = "";
  for (const addrinfo* ai = res.head; ai; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      err = errno;
      op = "socket";
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      err = errno;
      op = "bind";
      ::close(fd);
      continue;
    }
    if (::listen(fd, 128) != 0) {
      err = errno;
      op = "listen";
      ::close(fd);
      continue;
    }
    fd_ = fd;
    break;
  }
  if (fd_ < 0) {
    std::string hint;
    if (err == EADDRINUSE)
      hint = "; another process (perhaps an earlier nebula run) holds this port: stop it, choose another port, "
             "or use port 0 for a free one";
    else if (err == EACCES)
      hint = "; ports below 1024 need privileges: choose a port >= 1024";
    else if (err == EADDRNOTAVAIL)
      hint = "; that address does not belong to this host: use one of its addresses or 0.0.0.0";
    throw Error(str_cat("listen on ", where, ": ", op, " failed: ", errno_text(err), hint));
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  ::getsockname(fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  port_ = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                   : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  address_ = format_host_port(host.empty() ? "0.0.0.0" : host, port_);
  spdlog::debug("listening on {}", address_);
}

TcpListener::~TcpListener() {
  close();
  if (fd_ >= 0) ::close(fd_);
}

void TcpListener::close() {
  if (closed_.exchange(true)) return;
  // Wakes a poll() in accept() on Linux; the descriptor is released by the destructor.
  ::shutdown(fd_, SHUT_RDWR);
}

std::unique_ptr<TcpLink> TcpListener::accept(Deadline deadline, std::string peer_name_hint) {
  const std::string who = peer_name_hint.empty() ? address_ : peer_name_hint;
  for (;;) {
    if (closed_.load()) throw PeerLost(who, str_cat("accept on ", address_, ": listener was closed"));
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    int fd = ::accept4(fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      std::string addr = sockaddr_text(reinterpret_cast<sockaddr*>(&ss), len);
      auto link = std::make_unique<TcpLink>(fd, std::move(peer_name_hint), addr, options_);
      spdlog::debug("accepted {} on {}", link->describe(), address_);
      return link;
    }
    int err = errno;
    if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      pollfd p{fd_, POLLIN, 0};
      int r = ::poll(&p, 1, deadline.poll_timeout_ms());
      if (r < 0 && errno != EINTR)
        throw Error(str_cat("accept on ", address_, ": poll failed: ", errno_text(errno)));
      if (r == 0 && deadline.expired())
        throw Timeout(who, str_cat("accept on ", address_, ": no peer", peer_name_hint.empty() ? "" : " (", peer_name_hint,
                                   peer_name_hint.empty() ? "" : ")", " connected before the deadline"));
      continue;
    }
    if (closed_.load()) continue;
    if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM)
      throw AcceptExhausted(str_cat("accept on ", address_, ": ", errno_text(err),
                                    err == EMFILE ? " (this process's descriptor limit, ulimit -n)" : ""));
    throw Error(str_cat("accept on ", address_, ": ", errno_text(err)));
  }
}

namespace {

// Ports handed out by pick_free_port on this machine, shared by every process of this user: one
// empty file per port in a private directory, created with O_EXCL. A claim younger than
// kClaimLife stands, so two picks (in one launcher, or in two jobs started side by side) never
// return the same port in the seconds before its worker binds it; an older one is stale (the job
// bound it long ago, and a bound port fails the probe anyway) and is taken over.
constexpr auto kClaimLife = std::chrono::minutes(10);

std::string claim_directory() {
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = str_cat(tmp && *tmp ? tmp : "/tmp", "/nebula-ports-", std::to_string(::getuid()));
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return {};
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid()) return {};
  return dir;
}

// True when this call holds the claim on `port` now.
bool claim_port(const std::string& dir, uint16_t port) {
  if (dir.empty()) return true;  // no shared directory: the probe alone decides
  const std::string path = str_cat(dir, "/", std::to_string(port));
  int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
  if (fd >= 0) {
    ::close(fd);
    return true;
  }
  if (errno != EEXIST) return true;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return false;
  const auto age = std::chrono::system_clock::now() - std::chrono::system_clock::from_time_t(st.st_mtime);
  if (age < kClaimLife) return false;
  // Stale: take it over by renewing its time. Two processes taking over the same stale claim at
  // once is possible but needs both to draw this one port out of ~20,000 in the same instant.
  return ::utimensat(AT_FDCWD, path.c_str(), nullptr, 0) == 0;
}

}  // namespace

uint16_t pick_free_port(const std::string& host) {
  int ephemeral_low = 32768;  // Linux's default, when /proc does not say
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d", &ephemeral_low) != 1) ephemeral_low = 32768;
    std::fclose(f);
  }
  constexpr int kLowest = 10000;  // above the well-known and common service ports
  if (ephemeral_low - kLowest >= 1000) {
    const std::string claims = claim_directory();
    std::random_device seed;
    std::mt19937 rng(seed());
    std::uniform_int_distribution<int> draw(kLowest, ephemeral_low - 1);
    for (int attempt = 0; attempt < 256; ++attempt) {
      const auto port = static_cast<uint16_t>(draw(rng));
      try {
        TcpListener probe(host, port);
      } catch (const Error&) {
        continue;  // taken: draw again
      }
      if (claim_port(claims, port)) return port;
    }
  }
  TcpListener probe(host, 0);
  return probe.port();
}

}  // namespace nebula::transport
