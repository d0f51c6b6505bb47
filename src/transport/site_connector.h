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
// Every connection attempt, accepted or refused, is one line in the audit log.
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

struct ConnectorOptions {
  std::string job;
  size_t self = 0;
  std::vector<SiteAddress> sites;
  int streams = 1;
  std::shared_ptr<TlsContext> tls;  // null = plaintext (security.insecure)
  Shaper shaper;                    // optional
  LinkOptions link;                 // max_payload: larger frames disconnect the peer
  std::chrono::milliseconds handshake_timeout{10000};
  std::chrono::milliseconds reconnect_timeout{30000};
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

 private:
  struct Pending;  // accepted streams of one (site, generation), waiting to be complete
  std::vector<std::unique_ptr<Link>> dial(size_t peer, int generation, Deadline deadline);
  // The oldest complete set of streams from `peer` newer than `after_generation`; sets *taken.
  std::vector<std::unique_ptr<Link>> await(size_t peer, int after_generation, Deadline deadline, int* taken);
  std::unique_ptr<Link> assemble(size_t peer, std::vector<std::unique_ptr<Link>> streams, int generation);
  // A session: `first` (generation `generation`) wrapped in a ResilientLink that reconnects.
  std::unique_ptr<Link> session(size_t peer, std::unique_ptr<Link> first, int generation);
  void accept_loop();
  // `host`: the peer's address without the port, whose slot in handshakes_by_host_ it frees.
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
  std::map<std::string, size_t> handshakes_by_host_ GUARDED_BY(mu_);  // the same, per host
  bool closed_ GUARDED_BY(mu_) = false;
};

}  // namespace nebula::transport
