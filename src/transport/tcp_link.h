// TcpLink: a Link over one connected TCP socket, and TcpListener, which accepts them.
//
// The socket is non-blocking; every partial read or write waits in poll() for at most
// the time left on the caller's Deadline, so no call can outlive its deadline by more
// than one poll rounding (1 ms). TCP_NODELAY is set (frames are written whole with one
// sendmsg, so Nagle would only add latency to small control frames) and writes use
// MSG_NOSIGNAL (a dead peer gives PeerLost, never SIGPIPE).
//
// recv() reads exactly wire::kHeaderSize bytes, validates the header -- including
// payload_len against max_payload() and its type's own limit -- then reads the payload into
// memory that grows as the bytes arrive (at most kReadStep ahead of them: a header that
// claims more than the peer sends costs nothing), then checks the CRC. See link.h for the thread-safety contract and the
// error contract; TcpLink detects concurrent recv() calls and throws nebula::Error.
//
// The framing (send/recv) is built on two protected byte-level primitives, read_some()
// and write_some(); TlsLink (tls_link.h) is this class with those two overridden to go
// through OpenSSL, so framing, validation and deadlines are shared, not copied.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "transport/link.h"
#include "util/thread_annotations.h"

namespace nebula::transport {

// Splits "127.0.0.1:4242", "[::1]:4242" or "host:0" into host and port. Throws
// nebula::Error naming `text` when it is malformed (no port, empty host, an IPv6 address
// without brackets, a port that is not a number in 0..65535).
std::pair<std::string, uint16_t> parse_host_port(const std::string& text);

// The inverse: "host:port", with brackets around a host that contains ':'.
std::string format_host_port(const std::string& host, uint16_t port);

// A port on `host` that is free right now (bound and released at once). For local mode and
// tests, which must never use fixed ports. It is drawn at random below the kernel's ephemeral
// range (net.ipv4.ip_local_port_range), where no outgoing connection and no bind to port 0 of
// any process can take it before the caller binds it. Picks do not repeat one another: each
// claims its port for ten minutes in $TMPDIR/nebula-ports-<uid> (shared by this user's
// processes), so two picks in one launcher, or in two jobs started side by side, differ. Port 0's
// pick, in the ephemeral range, if no such port is free.
uint16_t pick_free_port(const std::string& host);

class TcpLink : public Link {
 public:
  // recv() grows a payload by at most this much ahead of the bytes that have arrived.
  static constexpr size_t kReadStep = 1 << 20;

  // Connects to host:port (a name, or an IPv4/IPv6 literal; resolved with getaddrinfo).
  // The peer process may not be listening yet, so refused / timed-out / unreachable
  // attempts are retried with backoff (20 ms doubling to 200 ms) until `deadline`, then
  // Timeout naming host:port and the last error. A host that does not resolve throws
  // nebula::Error. `peer_name` (e.g. the site name) is used in errors; empty means
  // "host:port".
  static std::unique_ptr<TcpLink> connect(const std::string& host, uint16_t port, std::string peer_name,
                                          Deadline deadline, LinkOptions options = {});

  // Takes ownership of a connected stream socket `fd` (made non-blocking here).
  // `address` is the peer's numeric "host:port", for messages.
  TcpLink(int fd, std::string peer_name, std::string address, LinkOptions options = {});
  ~TcpLink() override;
  TcpLink(const TcpLink&) = delete;
  TcpLink& operator=(const TcpLink&) = delete;

  void send(const wire::Frame& frame, Deadline deadline) override;
  // The header and the parts in one writev/sendmsg (TlsLink: SSL_write), no copy.
  void send_parts(const wire::FrameHeader& header, PayloadParts parts, Deadline deadline) override;
  wire::Frame recv(Deadline deadline) override;
  // Shuts the socket down (waking blocked calls); the descriptor itself is released by
  // the destructor, so a concurrent call never touches a reused descriptor number.
  void close() override;
  std::string peer() const override { return peer_name_; }
  LinkStats stats() const override;

  // The peer's numeric address, "127.0.0.1:4242".
  const std::string& address() const { return address_; }
  // "site-b (127.0.0.1:4242)", as used at the start of error messages.
  const std::string& describe() const { return describe_; }
  // The payload limit of later send() and recv() calls (LinkOptions::max_payload at first).
  // A gateway reads the hellos of a connection it has not authenticated yet under a small
  // limit and raises it to wan.max_frame once the peer is known. Any thread.
  void set_max_payload(uint64_t max_payload) { max_payload_.store(max_payload); }
  uint64_t max_payload() const { return max_payload_.load(); }

 protected:
  // Takes over `tcp`'s connected socket, peer name, address and options; `tcp` is
  // destroyed without closing the socket. TlsLink uses this to wrap an accepted or
  // connected TcpLink (the byte stream continues on the same descriptor). Preconditions
  // (NEBULA_CHECK): `tcp` is not null, not closed or broken, and no other thread uses it.
  explicit TcpLink(std::unique_ptr<TcpLink> tcp);

  // What one non-blocking attempt of read_some() / write_some() did.
  struct IoResult {
    enum class Kind {
      kMoved,    // `bytes` (> 0) were read or written
      kWait,     // nothing moved; poll(2) for `events` (POLLIN/POLLOUT), then try again
      kEof,      // the peer ended the stream (a read saw end of file)
      kFailed,   // a hard failure, described by `error` -> PeerLost
      kRefused,  // the peer refused to authenticate us (e.g. a TLS alert), `error` -> AuthError
    };
    Kind kind = Kind::kFailed;
    size_t bytes = 0;
    short events = 0;
    std::string error;
    // kWait from write_some(): the layer below already holds bytes of these iovecs that it
    // has not reported as written (TLS: an encrypted record waiting for the socket), so
    // the next attempt must be this same write. A deadline passing now breaks the link,
    // as if part of the frame had been sent.
    bool committed = false;
    static IoResult moved(size_t n) { return {Kind::kMoved, n, 0, {}}; }
    static IoResult wait(short events, bool committed = false) { return {Kind::kWait, 0, events, {}, committed}; }
    static IoResult eof() { return {Kind::kEof, 0, 0, {}}; }
    static IoResult failed(std::string why) { return {Kind::kFailed, 0, 0, std::move(why)}; }
    static IoResult refused(std::string why) { return {Kind::kRefused, 0, 0, std::move(why)}; }
  };

  // The byte-level primitives under send() and recv(), like gloo's Pair read()/write()
  // that its TLS pair overrides. Each makes ONE non-blocking attempt and never waits (the
  // framing code polls, honouring the caller's Deadline). All framing -- header
  // validation before allocation, CRC, counters, the broken/closed state and the error
  // messages -- is written once on top of them. TcpLink uses recv(2) / sendmsg(2) with
  // MSG_NOSIGNAL; TlsLink overrides them with SSL_read / SSL_write on the same socket.
  // read_some() is called with the receive lock held, write_some() with the send lock
  // held, so each direction has one caller at a time; n > 0 and the iovecs hold > 0 bytes.
  virtual IoResult read_some(uint8_t* p, size_t n);
  virtual IoResult write_some(const iovec* iov, int iovcnt);

  // The connected socket (non-blocking). Valid for the link's lifetime.
  int fd() const { return fd_; }

 private:
  // Reads exactly n bytes. `frame_progress` is true when bytes of the current frame were
  // already read before this call, so a timeout or EOF now leaves the stream out of step.
  void read_exact(uint8_t* p, size_t n, Deadline deadline, const char* what, bool frame_progress);
  // Writes all iovecs (modified in place).
  void write_all(iovec* iov, int iovcnt, size_t total, Deadline deadline, const char* what);
  // Waits in poll() for `events`; throws Timeout when the deadline passes (marking the
  // link broken if `frame_progress`).
  void wait_ready(short events, Deadline deadline, const char* what, bool frame_progress, size_t done,
                  size_t total);
  void check_usable(const char* what) const;
  // Marks the link broken and throws PeerLost (AuthError when `refused`), or the
  // closed/broken message if another thread got there first. `quiet` logs at debug
  // instead of warn (orderly EOF).
  [[noreturn]] void throw_lost(const char* what, const std::string& detail, bool quiet, bool refused = false);
  // Records the first failure and shuts the socket down, so the peer sees EOF at once and
  // a call blocked in the other direction wakes up.
  void mark_broken(const std::string& reason, bool quiet = false);

  // Set at construction and never changed afterwards, except that a TcpLink taken over
  // by the protected constructor is left with -1 (and is then only destroyed).
  int fd_;
  const std::string peer_name_;
  const std::string address_;
  const std::string describe_;
  const LinkOptions options_;
  std::atomic<uint64_t> max_payload_;

  std::mutex send_mu_;  // held for a whole send(): frames go out whole and in order
  std::mutex recv_mu_;  // try-locked by recv() to detect concurrent receivers

  std::atomic<bool> closed_{false};
  std::atomic<bool> broken_{false};
  mutable Mutex state_mu_;
  std::string broken_reason_ GUARDED_BY(state_mu_);  // set once, when broken_ becomes true

  LinkCounters counters_;
};

// accept() ran out of a resource (EMFILE, ENFILE, ENOBUFS, ENOMEM): the connection waits in
// the backlog, and the listener works again once the resource is back. Back off and call
// accept() again; do not stop listening.
class AcceptExhausted : public Error {
 public:
  using Error::Error;
};

// A listening TCP socket (SO_REUSEADDR) that accepts TcpLinks.
// accept() may be called from one thread while close() is called from another.
class TcpListener {
 public:
  // Binds host:port and listens. host "" or "0.0.0.0" = every IPv4 interface, "::" =
  // every interface; port 0 = an ephemeral port (see port()). Bind errors (port in use,
  // privileged port, address not on this host) throw nebula::Error naming host:port,
  // strerror and what to do about it.
  TcpListener(const std::string& host, uint16_t port, LinkOptions options = {});
  ~TcpListener();
  TcpListener(const TcpListener&) = delete;
  TcpListener& operator=(const TcpListener&) = delete;

  // The bound port (the ephemeral one when constructed with 0).
  uint16_t port() const { return port_; }
  const std::string& address() const { return address_; }

  // Waits for one connection. The link's peer() is `peer_name_hint`, or the peer's
  // numeric address when the hint is empty (the layer above learns the real site name
  // from the hello frame / certificate). Throws Timeout when the deadline passes,
  // AcceptExhausted when the process or system is out of descriptors or memory (transient),
  // and PeerLost when the listener is closed meanwhile.
  std::unique_ptr<TcpLink> accept(Deadline deadline, std::string peer_name_hint = "");

  // Stops listening; idempotent; wakes a blocked accept().
  void close();

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
  std::string address_;  // "host:port" as bound, for messages
  LinkOptions options_;
  std::atomic<bool> closed_{false};
};

}  // namespace nebula::transport
