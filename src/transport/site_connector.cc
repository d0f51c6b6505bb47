#include "transport/site_connector.h"

#include <spdlog/spdlog.h>

#include <arpa/inet.h>

#include <algorithm>
#include <cstring>
#include <system_error>

#include "nebula/error.h"
#include "transport/hello.h"
#include "transport/resilient_link.h"
#include "transport/striped_link.h"
#include "wire/frame.h"

namespace nebula::transport {

SiteConnector::SiteConnector(ConnectorOptions options, std::unique_ptr<TcpListener> listener)
    : options_(std::move(options)), listener_(std::move(listener)) {
  NEBULA_CHECK(options_.self < options_.sites.size(), "site index ", options_.self, " of ", options_.sites.size());
  NEBULA_CHECK(options_.streams >= 1, "streams ", options_.streams);
  if (options_.self + 1 < options_.sites.size()) acceptor_ = std::thread([this] { accept_loop(); });
}

SiteConnector::~SiteConnector() { close(); }

size_t SiteConnector::max_handshakes_per_address() const {
  return std::max(kMinHandshakesPerAddress,
                  2 * static_cast<size_t>(options_.streams) * (options_.sites.size() - 1));
}

std::string SiteConnector::source_of(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  if (host.size() < 2 || host.front() != '[' || host.back() != ']') return host;  // IPv4 (or a name)
  in6_addr a{};
  if (::inet_pton(AF_INET6, host.substr(1, host.size() - 2).c_str(), &a) != 1) return host;
  std::memset(a.s6_addr + 8, 0, 8);  // the interface half: one /64 is one source
  char text[INET6_ADDRSTRLEN];
  if (!::inet_ntop(AF_INET6, &a, text, sizeof text)) return host;
  return str_cat("[", text, "]/64");
}

AddressRange AddressRange::parse(const std::string& text) {
  AddressRange r;
  const size_t slash = text.find('/');
  const std::string host = text.substr(0, slash);
  if (::inet_pton(AF_INET, host.c_str(), r.bytes) == 1) {
    r.family = AF_INET;
    r.prefix = 32;
  } else if (::inet_pton(AF_INET6, host.c_str(), r.bytes) == 1) {
    r.family = AF_INET6;
    r.prefix = 128;
  } else {
    throw Error(str_cat("allow-list entry \"", text, "\": \"", host, "\" is not an IPv4 or IPv6 address (expected e.g. ",
                        "\"10.0.0.0/8\", \"2001:db8::/32\" or \"192.0.2.7\")"));
  }
  if (slash != std::string::npos) {
    const std::string bits = text.substr(slash + 1);
    const int max = r.prefix;
    if (bits.empty() || bits.size() > 3 || !std::all_of(bits.begin(), bits.end(), ::isdigit) || std::stoi(bits) > max)
      throw Error(str_cat("allow-list entry \"", text, "\": prefix length \"", bits, "\" is not a number in 0..", max));
    r.prefix = std::stoi(bits);
  }
  return r;
}

bool AddressRange::contains(const std::string& address) const {
  const size_t colon = address.rfind(':');
  std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  uint8_t b[16] = {};
  if (::inet_pton(family, host.c_str(), b) != 1) return false;  // another family (or not an address)
  for (int bit = 0; bit < prefix; ++bit)
    if (((b[bit / 8] ^ bytes[bit / 8]) >> (7 - bit % 8)) & 1) return false;
  return true;
}

namespace {

// The payload limit of a stream once its hellos are done: what the layer above it sends.
uint64_t stream_max_payload(const ConnectorOptions& o) {
  if (o.streams <= 1) return o.link.max_payload;
  const uint64_t n = static_cast<uint64_t>(o.streams);
  return (o.link.max_payload + n - 1) / n + kChunkHeaderSize;
}

// Connections are read under this limit until the peer is known (hellos only).
LinkOptions before_hello(LinkOptions o) {
  o.max_payload = wire::kMaxHelloPayload;
  return o;
}

}  // namespace

void SiteConnector::close() {
  std::vector<Handshake> handshakes;
  {
    MutexLock lock(mu_);
    if (closed_) return;
    closed_ = true;
    handshakes.swap(handshakes_);
  }
  arrived_.notify_all();
  if (listener_) listener_->close();
  if (acceptor_.joinable()) acceptor_.join();
  for (auto& h : handshakes) h.thread.join();
  {
    MutexLock lock(mu_);
    for (auto& h : handshakes_) h.thread.join();
  }
  MutexLock lock(audit_mu_);
  for (auto& [source, w] : refusals_) audit_left_out_locked(source, w);
}

void SiteConnector::audit_left_out_locked(const std::string& source, RefusalWindow& w) {
  if (w.left_out == 0) return;
  const double minutes = std::chrono::duration<double>(std::chrono::steady_clock::now() - w.start).count() / 60;
  const std::string reason =
      str_cat(w.left_out, " more refusals from ", source, " in the last ", minutes < 1.05 ? std::string("minute")
                                                                                         : str_cat(minutes, " minutes"),
              ", not audited one by one (at most ", kAuditedRefusalsPerMinute, " lines a minute per source)");
  w.left_out = 0;
  spdlog::warn("{}", reason);
  if (!options_.audit) return;
  AuditEntry e;
  e.local_site = options_.sites[options_.self].name;
  e.address = source;
  e.outcome = "refused";
  e.reason = reason;
  try {
    options_.audit->record(e);
  } catch (const std::exception& x) {
    spdlog::error("cannot audit {}: {}", reason, x.what());
  }
}

bool SiteConnector::audit(const std::string& peer_site, const std::string& address, const std::string& fingerprint,
                          const std::string& outcome, const std::string& reason) {
  const bool refusal = outcome != "accepted";
  if (refusal) {
    // Flood control: a source's refusals beyond kAuditedRefusalsPerMinute a minute are counted,
    // not written; the count goes in one line when its minute is over.
    constexpr size_t kMaxSources = 4096;  // beyond them every new source counts as one, "*"
    const auto now = std::chrono::steady_clock::now();
    MutexLock lock(audit_mu_);
    std::string source = source_of(address);
    if (refusals_.size() >= kMaxSources && !refusals_.count(source)) source = "*";
    RefusalWindow& w = refusals_[source];
    if (now - w.start >= std::chrono::minutes(1)) {
      audit_left_out_locked(source, w);
      w.start = now;
      w.written = 0;
    }
    if (w.written >= kAuditedRefusalsPerMinute) {
      ++w.left_out;
      refusals_seen_.fetch_add(1);
      return true;
    }
    ++w.written;
    spdlog::warn("connection {} {}{}: {}", outcome, address,
                 peer_site.empty() ? std::string() : " (site '" + peer_site + "')", reason);
  }
  bool written = true;
  if (options_.audit) {
    AuditEntry e;
    e.local_site = options_.sites[options_.self].name;
    e.peer_site = peer_site;
    e.address = address;
    e.fingerprint = fingerprint;
    e.outcome = outcome;
    e.reason = reason;
    try {
      options_.audit->record(e);
    } catch (const std::exception& x) {  // e.g. a full disk: never an exception out of a handshake thread
      spdlog::error("cannot audit the connection {} ({} {}): {}", address, outcome, reason, x.what());
      written = false;
    }
  }
  if (refusal) refusals_seen_.fetch_add(1);  // after its line, for whoever waits on the count
  return written;
}

std::vector<std::unique_ptr<Link>> SiteConnector::dial(size_t peer, int generation, Deadline deadline) {
  const SiteAddress& to = options_.sites[peer];
  const std::string& me = options_.sites[options_.self].name;
  auto [host, port] = parse_host_port(to.address);
  std::vector<std::unique_ptr<Link>> streams;
  for (int k = 0; k < options_.streams; ++k) {
    auto tcp = TcpLink::connect(host, port, to.name, deadline, before_hello(options_.link));
    const std::string address = tcp->address();
    Deadline hs = Deadline::after(options_.handshake_timeout).min(deadline);
    std::unique_ptr<TcpLink> link;
    try {
      if (options_.tls) link = TlsLink::client(std::move(tcp), options_.tls, to.identity(), hs);
      else link = std::move(tcp);
      // The accepting side speaks first: if it refused our certificate, this recv gets its
      // TLS alert (with TLS 1.3 the client's handshake ends before the server has judged it).
      Hello greeting = read_hello(link->recv(hs), to.name);
      auto check = [&](const Hello& h) {
        if (h.protocol != kHelloProtocol || h.job != options_.job || h.from != to.name)
          throw AuthError(to.name, str_cat("gateway at ", to.address, " answered as site '", h.from, "' of job '",
                                           h.job, "' (protocol ", h.protocol, "); expected site '", to.name,
                                           "' of job '", options_.job, "': check [[sites]] gateway addresses"));
      };
      check(greeting);
      link->send(hello_frame({kHelloProtocol, options_.job, me, to.name, static_cast<uint32_t>(k),
                              static_cast<uint32_t>(options_.streams), static_cast<uint32_t>(generation)}),
                 hs);
      Hello h = read_hello(link->recv(hs), to.name);
      check(h);
      if (h.to != me || h.stream != static_cast<uint32_t>(k))
        throw AuthError(to.name, str_cat("site '", to.name, "' confirmed stream ", h.stream, " for '", h.to,
                                         "'; expected stream ", k, " for '", me, "'"));
    } catch (const TlsHandshakeError& e) {
      audit(to.name, address, e.peer_fingerprint(), "refused", e.reason());
      throw;
    } catch (const AuthError& e) {
      audit(to.name, address, link ? link->peer_fingerprint() : "", "refused", e.what());
      throw;
    } catch (const Timeout& e) {
      audit(to.name, address, "", "failed", e.what());
      throw;
    }
    audit(to.name, address, link->peer_fingerprint(), "accepted", generation ? "reconnected" : "dialed");
    link->set_max_payload(stream_max_payload(options_));
    streams.push_back(std::move(link));
  }
  // The streams of a real dial set up in parallel: one set-up's round trips for all of them.
  if (options_.connect_delay) std::this_thread::sleep_for(std::min<Clock::duration>(options_.connect_delay(peer), deadline.remaining()));
  return streams;
}

void SiteConnector::accept_loop() {
  auto backoff = std::chrono::milliseconds(50);
  for (;;) {
    std::unique_ptr<TcpLink> tcp;
    try {
      tcp = listener_->accept(Deadline::after(std::chrono::milliseconds(500)));
      backoff = std::chrono::milliseconds(50);
    } catch (const Timeout&) {
      MutexLock lock(mu_);
      if (closed_) return;
      continue;
    } catch (const AcceptExhausted& e) {
      // Out of descriptors or memory: the connection waits in the backlog. Keep listening,
      // after a pause (poll() would report it ready at once), so a real peer gets in as soon
      // as the resource is back.
      audit("", listener_->address(), "", "failed", str_cat(e.what(), "; retrying in ", backoff.count(), " ms"));
      MutexLock lock(mu_);
      if (closed_) return;
      arrived_.wait_until(mu_, std::chrono::steady_clock::now() + backoff);
      if (closed_) return;
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
      continue;
    } catch (const std::exception& e) {
      MutexLock lock(mu_);
      if (!closed_) spdlog::error("gateway listener stopped: {}", e.what());
      return;
    }
    // Each handshake on its own thread: a slow or hostile client cannot hold up the others.
    MutexLock lock(mu_);
    if (closed_) return;
    for (auto it = handshakes_.begin(); it != handshakes_.end();) {  // join the finished ones
      if (!it->done->load()) {
        ++it;
        continue;
      }
      it->thread.join();
      it = handshakes_.erase(it);
    }
    std::string refusal;
    const std::string host = source_of(tcp->address());
    const bool allowed = options_.allow.empty() ||
                         std::any_of(options_.allow.begin(), options_.allow.end(),
                                     [&](const AddressRange& r) { return r.contains(tcp->address()); });
    size_t& from_host = handshakes_by_host_[host];
    if (!allowed) {
      refusal = "address not in wan.allow: refused before any handshake";
    } else if (in_handshake_.load() >= kMaxConcurrentHandshakes) {
      refusal = str_cat("too many connections in handshake (", kMaxConcurrentHandshakes,
                        "): refused at once; a flood of connections to this gateway? (each is given up after "
                        "wan.handshake_timeout)");
    } else if (from_host >= max_handshakes_per_address()) {
      refusal = str_cat("too many connections in handshake from ", host, " (", max_handshakes_per_address(),
                        "): refused at once; a flood from that host? (each is given up after wan.handshake_timeout)");
    } else {
      auto done = std::make_shared<std::atomic<bool>>(false);
      TcpLink* raw = tcp.release();
      in_handshake_.fetch_add(1);
      ++from_host;
      try {
        handshakes_.push_back({std::thread([this, raw, done, host] {
                                 handshake_incoming(std::unique_ptr<TcpLink>(raw), host);
                                 done->store(true);
                               }),
                               done});
      } catch (const std::system_error& e) {  // no thread to be had: refuse, do not terminate
        in_handshake_.fetch_sub(1);
        --from_host;
        tcp.reset(raw);
        refusal = str_cat("cannot start a handshake thread: ", e.what());
      }
    }
    if (from_host == 0) handshakes_by_host_.erase(host);
    if (refusal.empty()) continue;
    lock.unlock();
    const std::string address = tcp->address();
    tcp->close();
    audit("", address, "", "refused", refusal);
  }
}

void SiteConnector::handshake_incoming(std::unique_ptr<TcpLink> tcp, const std::string& host) {
  const std::string address = tcp->address();
  const std::string& me = options_.sites[options_.self].name;
  Deadline hs = Deadline::after(options_.handshake_timeout);
  tcp->set_max_payload(wire::kMaxHelloPayload);  // nothing but hellos before the peer is known
  std::unique_ptr<TcpLink> link;
  std::string claimed, fingerprint, outcome, reason;
  size_t peer = options_.sites.size();
  Hello h;
  try {
    if (options_.tls) link = TlsLink::server(std::move(tcp), options_.tls, hs);
    else link = std::move(tcp);
    link->send(hello_frame({kHelloProtocol, options_.job, me, "", 0, 0, 0}), hs);  // greeting
    h = read_hello(link->recv(hs), address);
    claimed = h.from;
    for (size_t j = options_.self + 1; j < options_.sites.size(); ++j)
      if (options_.sites[j].name == h.from && options_.sites[j].identity() != options_.sites[options_.self].identity())
        peer = j;
    std::string why;
    if (h.protocol != kHelloProtocol) why = str_cat("protocol ", h.protocol, ", expected ", kHelloProtocol);
    else if (h.job != options_.job) why = str_cat("job '", h.job, "', expected '", options_.job, "'");
    else if (h.to != me) why = str_cat("wants site '", h.to, "', this is '", me, "'");
    else if (peer == options_.sites.size()) why = str_cat("site '", h.from, "' is not a site that dials this one");
    else if (options_.tls && link->peer_identity() != options_.sites[peer].identity())
      why = str_cat("certificate names site '", link->peer_identity(), "' but hello claims '", h.from, "'");
    else if (h.streams != static_cast<uint32_t>(options_.streams) || h.stream >= h.streams)
      why = str_cat("stream ", h.stream, " of ", h.streams, ", expected ", options_.streams, " streams");
    if (!why.empty()) throw AuthError(address, why);
    link->send(hello_frame({kHelloProtocol, options_.job, me, h.from, h.stream, h.streams, h.generation}), hs);
    fingerprint = link->peer_fingerprint();
    outcome = "accepted";
    reason = str_cat("stream ", h.stream, " generation ", h.generation);
  } catch (const TlsHandshakeError& e) {
    claimed = e.peer_site();
    fingerprint = e.peer_fingerprint();
    outcome = "refused";
    reason = e.reason();
  } catch (const Timeout& e) {
    outcome = "failed";
    reason = e.what();
  } catch (const std::exception& e) {
    fingerprint = link ? link->peer_fingerprint() : "";
    outcome = "refused";
    reason = e.what();
  }
  {  // the slots are free before the outcome is visible in the audit log
    MutexLock lock(mu_);
    if (--handshakes_by_host_[host] == 0) handshakes_by_host_.erase(host);
  }
  in_handshake_.fetch_sub(1);
  // An accepted stream that cannot be audited is not used (fail closed); the audit error is logged.
  if (audit(claimed, address, fingerprint, outcome, reason) && outcome == "accepted") {
    link->set_max_payload(stream_max_payload(options_));
    std::vector<std::unique_ptr<Link>> dropped;  // closed after the lock
    MutexLock lock(mu_);
    auto& slot = incoming_[{peer, static_cast<int>(h.generation)}];
    if (slot.size() != h.streams) slot.resize(h.streams);
    if (slot[h.stream]) dropped.push_back(std::move(slot[h.stream]));  // a stream sent twice: the newer wins
    slot[h.stream] = std::move(link);
    // Bounded: the peer's oldest sets beyond kMaxParkedGenerations are stale attempts.
    size_t parked = 0;
    for (const auto& [key, streams] : incoming_) parked += key.first == peer;
    for (auto it = incoming_.begin(); parked > kMaxParkedGenerations && it != incoming_.end();) {
      if (it->first.first != peer) {
        ++it;
        continue;
      }
      spdlog::warn("site '{}': dropping its parked streams of generation {} ({} sets waiting, at most {})",
                   options_.sites[peer].name, it->first.second, parked, kMaxParkedGenerations);
      for (auto& s : it->second)
        if (s) dropped.push_back(std::move(s));
      it = incoming_.erase(it);
      --parked;
    }
    arrived_.notify_all();
    lock.unlock();
    for (auto& d : dropped) d->close();
    return;
  }
  if (link) link->close();
}

namespace {
// Whether every stream of a (site, generation) has arrived.
bool all_arrived(const std::vector<std::unique_ptr<Link>>& streams) {
  for (const auto& s : streams)
    if (!s) return false;
  return true;
}
}  // namespace

std::vector<std::unique_ptr<Link>> SiteConnector::await(size_t peer, int after_generation, Deadline deadline,
                                                        int* taken) {
  MutexLock lock(mu_);
  for (;;) {
    // The oldest complete generation newer than the last one used; older ones are stale.
    for (auto it = incoming_.begin(); it != incoming_.end();) {
      auto& [key, streams] = *it;
      if (key.first != peer) {
        ++it;
        continue;
      }
      if (key.second <= after_generation) {
        it = incoming_.erase(it);
        continue;
      }
      if (all_arrived(streams)) {
        *taken = key.second;
        auto out = std::move(streams);
        incoming_.erase(it);
        return out;
      }
      ++it;
    }
    if (closed_) throw PeerLost(options_.sites[peer].name, "gateway closed while waiting for site " + options_.sites[peer].name);
    if (arrived_.wait_until(mu_, deadline.at()) == std::cv_status::timeout && deadline.expired())
      throw Timeout(options_.sites[peer].name, str_cat("site '", options_.sites[peer].name, "' did not connect to ",
                                                       options_.sites[options_.self].address, " in time"));
  }
}

std::unique_ptr<Link> SiteConnector::assemble(size_t peer, std::vector<std::unique_ptr<Link>> streams, int generation) {
  if (options_.shaper) streams = options_.shaper(peer, std::move(streams), generation);
  if (streams.size() == 1) return std::move(streams[0]);
  return std::make_unique<StripedLink>(std::move(streams), options_.link);
}

std::unique_ptr<Link> SiteConnector::session(size_t peer, std::unique_ptr<Link> first, int generation) {
  const bool dialer = peer < options_.self;
  auto current = std::make_shared<int>(generation);
  // Reconnection: the dialing side dials again with a new generation; the accepting side
  // waits for the peer's next complete generation.
  Reconnect reconnect = [this, peer, dialer, current](Deadline d) {
    if (dialer) {
      int g = ++*current;
      return assemble(peer, dial(peer, g, d), g);
    }
    auto streams = await(peer, *current, d, current.get());
    return assemble(peer, std::move(streams), *current);
  };
  ResilientOptions ro;
  ro.reconnect_timeout = options_.reconnect_timeout;
  ro.max_pending_bytes = options_.max_pending;
  ro.liveness_timeout = options_.liveness_timeout;
  ro.fragment_bytes = options_.fragment_bytes;
  return std::make_unique<ResilientLink>(std::move(first), std::move(reconnect), ro);
}

std::vector<std::unique_ptr<Link>> SiteConnector::connect_all(Deadline deadline) {
  const size_t n = options_.sites.size(), me = options_.self;
  std::vector<std::unique_ptr<Link>> links(n);
  for (size_t j = 0; j < n; ++j) {
    if (j == me || options_.sites[j].identity() == options_.sites[me].identity()) continue;  // this site's own workers
    int generation = 0;
    auto first = assemble(j, j < me ? dial(j, 0, deadline) : await(j, -1, deadline, &generation), generation);
    links[j] = session(j, std::move(first), generation);
    spdlog::info("connected to site {} ({} stream{}, {})", options_.sites[j].name, options_.streams,
                 options_.streams > 1 ? "s" : "", options_.tls ? "mutual TLS" : "PLAINTEXT");
  }
  return links;
}

std::unique_ptr<Link> SiteConnector::rejoin(size_t peer, Deadline deadline) {
  NEBULA_CHECK(peer < options_.sites.size() && peer != options_.self, "rejoin of site ", peer);
  try {
    if (peer < options_.self) return session(peer, assemble(peer, dial(peer, 0, deadline), 0), 0);
    // A restarted peer numbers its generations from 0 again: take the newest complete set,
    // whatever its number, and drop the older ones (the lost session's last attempts).
    MutexLock lock(mu_);
    for (;;) {
      auto newest = incoming_.end();
      for (auto it = incoming_.begin(); it != incoming_.end(); ++it) {
        if (it->first.first != peer) continue;
        if (all_arrived(it->second) && (newest == incoming_.end() || it->first.second >= newest->first.second)) newest = it;
      }
      if (newest != incoming_.end()) {
        const int generation = newest->first.second;
        auto streams = std::move(newest->second);
        for (auto it = incoming_.begin(); it != incoming_.end();)
          it = it->first.first == peer && it->first.second <= generation ? incoming_.erase(it) : std::next(it);
        lock.unlock();
        return session(peer, assemble(peer, std::move(streams), generation), generation);
      }
      if (closed_ || arrived_.wait_until(mu_, deadline.at()) == std::cv_status::timeout) return nullptr;
    }
  } catch (const NetworkError& e) {  // not back yet
    return nullptr;
  }
}

}  // namespace nebula::transport
