// SiteConnector: builds a gateway's links to every other site's gateway, and rebuilds them
// when they break. Per site pair it makes `streams` TCP connections, each one:
//
//   TcpLink → TlsLink (mutual TLS, unless insecure) → hellos: the acceptor greets, the dialer
//           names itself (job, sites, stream, generation), the acceptor confirms
//           → shaper (WAN emulation in local mode)
//   N streams → StripedLink (if N > 1) → ResilientLink (reconnect + resume, exactly once)
//
// Site i dials every site j < i; an acceptor thread takes connections from sites j > i,
// checks them (TLS identity == the site its hello claims; job; stream index), and files them
// by (site, generation), so a reconnecting peer's new streams find their ResilientLink.
//
// Limits from protocol state: until its hellos are done a connection accepts frames of at
// most wire::kMaxHelloPayload bytes (so an unauthenticated peer cannot make this side read a
// gigabyte); afterwards each stream takes what its layer above can send: wan.max_frame, or
// its stripe's share of it plus the chunk header. Handshakes in progress are bounded in all,
// per IPv4 host and per IPv6 /64; at most kMaxParkedGenerations sets of streams per peer wait
// to be taken. An accept() that runs out of descriptors or memory backs off and keeps going.
//
// Audit: every connection attempt, accepted or refused, is one line in the audit log, except
// under a flood: of the refusals from one source (IPv4 host, IPv6 /64) at most
// kAuditedRefusalsPerMinute lines a minute, then one line "N more refusals from X in the last
// minute", so a flood cannot fill the disk. A stream that was accepted but cannot be audited
// (the log cannot be written) is not used: fail closed, logged as an error; refusals that
// cannot be written are only logged, and refusing never depends on the audit log.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "nebula/deadline.h"
#include "transport/audit_log.h"
#include "transport/link.h"
#include "transport/tcp_link.h"
#include "transport/tls_link.h"
#include "util/thread_annotations.h"

namespace nebula::transport {

struct SiteAddress {
  std::string name;
  std::string address;  // "host:port" of the site's gateway
  // The site its certificate must name; empty = `name`. With wan.mode = "every_worker" the
  // endpoints are workers ("alpha/1"): each names its site, and endpoints of one site never
  // connect to each other.
  std::string site;
  const std::string& identity() const { return site.empty() ? name : site; }
};

// Wraps the freshly connected streams to peer site `peer` (e.g. in WAN emulators);
// `generation` counts reconnections (0 = first).
using Shaper = std::function<std::vector<std::unique_ptr<Link>>(size_t peer, std::vector<std::unique_ptr<Link>>,
                                                                 int generation)>;

// An address range of the allow-list: "10.0.0.0/8", "2001:db8::/32", or one address.
struct AddressRange {
  int family = 0;         // AF_INET or AF_INET6
  uint8_t bytes[16] = {};
  int prefix = 0;         // leading bits that must match
  // Throws nebula::Error naming `text` and the expected form when it is not one.
  static AddressRange parse(const std::string& text);
  // `address`: "10.1.2.3:4000" or "[2001:db8::1]:4000".
  bool contains(const std::string& address) const;
};

struct ConnectorOptions {
  std::string job;
  size_t self = 0;
  std::vector<SiteAddress> sites;
  int streams = 1;
  std::shared_ptr<TlsContext> tls;  // null = plaintext (security.insecure)
  Shaper shaper;                    // optional
  // WAN emulation: what setting up a connection to `peer` costs on a real path (TCP, TLS 1.3
  // and the hellos: three round trips), paid by the dialer after each dial; optional.
  std::function<std::chrono::nanoseconds(size_t peer)> connect_delay;
  LinkOptions link;                 // max_payload: larger frames disconnect the peer
  std::chrono::milliseconds handshake_timeout{10000};
  std::chrono::milliseconds reconnect_timeout{30000};
  std::chrono::milliseconds liveness_timeout{20000};  // ResilientOptions::liveness_timeout
  uint64_t fragment_bytes = 256 * 1024;               // ResilientOptions::fragment_bytes
  std::vector<AddressRange> allow;  // wan.allow: if not empty, the only sources accepted
  uint64_t max_pending = 1ull << 30;
  std::shared_ptr<AuditLog> audit;  // optional
};

class SiteConnector {
 public:
  // At most this many incoming handshakes run at once; a connection beyond them is refused at
  // once (and audited), so a flood of idle connections cannot exhaust threads. Each lasts at
  // most handshake_timeout.
  static constexpr size_t kMaxConcurrentHandshakes = 128;
  // And at most max(this, 2 · streams · (sites − 1)) of them from one address (host, any
  // port), so that one flooding host cannot take the slots a real peer elsewhere needs to
  // reconnect. (All the job's peers fit: in local mode they share 127.0.0.1.)
  static constexpr size_t kMinHandshakesPerAddress = 16;
  size_t max_handshakes_per_address() const;
  // Complete or partial sets of streams per peer waiting to be taken (one per generation);
  // an older set beyond them is closed.
  static constexpr size_t kMaxParkedGenerations = 4;
  static constexpr size_t kAuditedRefusalsPerMinute = 10;
  // What a connection from `address` ("host:port") counts against: the IPv4 host, or the
  // IPv6 /64 it belongs to ("[2001:db8:0:1::]/64"), so that one host with a /64 of
  // addresses is one source.
  static std::string source_of(const std::string& address);

  // `listener` is this gateway's bound listening socket; the connector takes it over.
  SiteConnector(ConnectorOptions options, std::unique_ptr<TcpListener> listener);
  ~SiteConnector();
  SiteConnector(const SiteConnector&) = delete;
  SiteConnector& operator=(const SiteConnector&) = delete;

  // Connects to every other site; links[j] is the link to site j (null for this site).
  // Throws Timeout if a site is not reachable by `deadline`, AuthError if a site we dial
  // fails authentication.
  std::vector<std::unique_ptr<Link>> connect_all(Deadline deadline);

  // Elastic rejoin: a fresh session with `peer`, whose old one was lost (the peer restarted).
  // The side that dials (peer < self) dials once; the other takes the most recent complete
  // set of streams the peer dialed. Waits at most until `deadline`; null if there is none.
  std::unique_ptr<Link> rejoin(size_t peer, Deadline deadline);

  // Stops accepting; links already handed out keep working until closed.
  void close();

  // Connection attempts refused or failed so far, audited one by one or not.
  uint64_t refusals_seen() const { return refusals_seen_.load(); }

 private:
  struct Pending;  // accepted streams of one (site, generation), waiting to be complete
  std::vector<std::unique_ptr<Link>> dial(size_t peer, int generation, Deadline deadline);
  // The oldest complete set of streams from `peer` newer than `after_generation`; sets *taken.
  std::vector<std::unique_ptr<Link>> await(size_t peer, int after_generation, Deadline deadline, int* taken);
  std::unique_ptr<Link> assemble(size_t peer, std::vector<std::unique_ptr<Link>> streams, int generation);
  // A session: `first` (generation `generation`) wrapped in a ResilientLink that reconnects.
  std::unique_ptr<Link> session(size_t peer, std::unique_ptr<Link> first, int generation);
  void accept_loop();
  // `host`: the peer's source_of(), whose slot in handshakes_by_host_ it frees.
  void handshake_incoming(std::unique_ptr<TcpLink> tcp, const std::string& host);
  // Logs a refusal and writes the audit line; false (logged, never thrown) if the line could
  // not be written, e.g. on a full disk.
  bool audit(const std::string& peer_site, const std::string& address, const std::string& fingerprint,
             const std::string& outcome, const std::string& reason);

  ConnectorOptions options_;
  std::unique_ptr<TcpListener> listener_;
  std::thread acceptor_;

  Mutex mu_;
  std::condition_variable_any arrived_;
  // (site, generation) → streams by index.
  std::map<std::pair<size_t, int>, std::vector<std::unique_ptr<Link>>> incoming_ GUARDED_BY(mu_);
  // Handshakes in progress or finished but not yet joined; a finished one is joined by the
  // next accept (so a stream of connections does not pile up threads), the rest by close().
  struct Handshake {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Handshake> handshakes_ GUARDED_BY(mu_);
  std::atomic<size_t> in_handshake_{0};  // handshakes not yet decided (any thread)
  std::atomic<uint64_t> refusals_seen_{0};
  std::map<std::string, size_t> handshakes_by_host_ GUARDED_BY(mu_);  // the same, per source_of()
  bool closed_ GUARDED_BY(mu_) = false;

  // Refusals per source in the current minute: lines written and left out.
  struct RefusalWindow {
    std::chrono::steady_clock::time_point start;
    size_t written = 0, left_out = 0;
  };
  Mutex audit_mu_;
  std::map<std::string, RefusalWindow> refusals_ GUARDED_BY(audit_mu_);
  // Writes the "N more refusals" line of a window that is over (or of every window, at close).
  void audit_left_out_locked(const std::string& source, RefusalWindow& w) REQUIRES(audit_mu_);
};

}  // namespace nebula::transport
