#include "site/gateway.h"

#include <algorithm>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <map>

#include "nebula/error.h"
#include "transport/certs.h"
#include "transport/emulated_link.h"
#include "transport/tcp_link.h"
#include "transport/tls_link.h"

namespace nebula::site {
namespace fs = std::filesystem;

transport::TlsFiles tls_files(const Config& c, const std::string& site, int rank) {
  const auto& s = c.security;
  if (s.host_certs && rank >= 0 && !s.certs.empty()) {
    transport::TlsFiles p{transport::ca_cert_path(s.certs), transport::host_cert_path(s.certs, site, rank),
                          transport::host_key_path(s.certs, site, rank)};
    if (!s.ca.empty()) p.ca = s.ca;
    for (const auto& f : {p.cert, p.key})
      if (!fs::exists(f))
        throw ConfigError(str_cat(c.source_path, ": security.host_certs = true, but ", f, " (worker ", rank,
                                  " of site '", site, "') does not exist: make the site's host certificates with "
                                  "`nebula certs issue ", s.certs, " --site ", site, " --job ", c.job.name,
                                  " --workers N`"));
    return p;
  }
  transport::TlsFiles p = s.certs.empty() ? transport::TlsFiles{} : transport::TlsFiles::for_site(s.certs, site);
  if (!s.ca.empty()) p.ca = s.ca;
  if (!s.cert.empty()) p.cert = s.cert;
  if (!s.key.empty()) p.key = s.key;
  if (p.ca.empty() || p.cert.empty() || p.key.empty())
    throw ConfigError(str_cat(c.source_path, ": [security] needs certs = \"DIR\" (made with `nebula certs init DIR` ",
                              "and `nebula certs issue DIR --site ", site, " --job ", c.job.name,
                              "`) or ca, cert and key paths; ",
                              "or insecure = true for plaintext links"));
  return p;
}

void ensure_local_certificates(Config& c) {
  if (c.security.insecure || !c.security.certs.empty() || !c.security.ca.empty()) return;
  const std::string dir = c.job.run_dir + "/certs";
  fs::create_directories(dir);
  if (!fs::exists(dir + "/ca.pem")) transport::create_ca(dir);
  // Made for this job; one left in the run directory by a job of another name is replaced.
  auto stale = [&](const std::string& pem) {
    if (!fs::exists(pem)) return true;
    const transport::CertIdentity id = transport::certificate_identity(pem);
    return !id.ok() || id.job != c.job.name;
  };
  for (const auto& s : c.sites) {
    if (stale(transport::site_cert_path(dir, s.name))) transport::issue_site_certificate(dir, s.name, c.job.name);
    for (int r = 0; c.security.host_certs && r < s.workers; ++r)
      if (stale(transport::host_cert_path(dir, s.name, r)))
        transport::issue_host_certificate(dir, s.name, r, c.job.name);
  }
  c.security.certs = dir;
}

namespace {

// The connector of one endpoint (a gateway, or with every_worker a worker) to `endpoints`:
// TLS, limits, audit log and, in local mode, the WAN emulation. `site_of[j]` is endpoint j's
// site index.
// `rank`: with every_worker, this worker's rank (its own certificate with security.host_certs).
GatewayLinks connect_endpoints(const Config& c, std::vector<transport::SiteAddress> endpoints,
                               std::vector<size_t> site_of, size_t self, bool joining, int rank = -1) {
  const size_t site = site_of[self];
  transport::ConnectorOptions o;
  o.job = c.job.name;
  o.self = self;
  o.sites = std::move(endpoints);
  o.streams = static_cast<int>(c.wan.streams);
  o.link.max_payload = c.wan.max_frame;
  o.handshake_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(c.wan.handshake_timeout);
  o.reconnect_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
      joining ? std::max(c.wan.reconnect_timeout, c.job.timeout) : c.wan.reconnect_timeout);
  o.max_pending = c.wan.max_pending;
  o.liveness_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(c.wan.liveness_timeout);
  o.link.tcp_user_timeout = o.liveness_timeout;
  o.fragment_bytes = c.wan.piece_bytes();
  for (size_t i = 0; i < c.wan.allow.size(); ++i) {
    try {
      o.allow.push_back(transport::AddressRange::parse(c.wan.allow[i]));
    } catch (const Error& e) {
      throw ConfigError(str_cat(c.source_path, ": key 'wan.allow[", i, "]': ", e.what()));
    }
  }
  o.audit = std::make_shared<transport::AuditLog>(c.security.audit_log.empty() ? c.job.run_dir + "/audit.jsonl"
                                                                               : c.security.audit_log);
  if (c.security.insecure) {
    spdlog::warn("security.insecure = true: links to other sites are PLAINTEXT and unauthenticated");
  } else {
    o.tls = transport::TlsContext::create(tls_files(c, c.sites[site].name, rank));
    if (o.tls->job() != c.job.name || o.tls->name() != c.sites[site].name)
      throw ConfigError(str_cat(c.source_path, ": the certificate ", o.tls->files().cert, " is for site '",
                                o.tls->name(), "' of job '", o.tls->job(), "', but this is site '", c.sites[site].name,
                                "' of job '", c.job.name, "': issue one with `nebula certs issue DIR --site ",
                                c.sites[site].name, " --job ", c.job.name, "`"));
  }
  if (c.wan.emulated()) {
    // One bottleneck per direction of a site pair, shared by its streams; with every_worker
    // shared by the links of all of the site's worker processes, through a file in RUN_DIR/wan.
    // Behind it, with wan.host_bandwidth, this process's own egress, shared by all its links.
    // Faults fire on the first connection only, except a cut with `every`, which fires on each one.
    auto host = c.wan.host_bandwidth_bits > 0 ? std::make_shared<transport::Bottleneck>(c.wan.host_bandwidth_bits)
                                              : nullptr;
    auto pairs = std::make_shared<std::map<size_t, std::shared_ptr<transport::Bottleneck>>>();
    if (c.wan.every_worker()) std::filesystem::create_directories(c.job.run_dir + "/wan");
    o.connect_delay = [&c, site, site_of](size_t peer) {
      return 3 * c.wan.path_between(c.sites[site].name, c.sites[site_of[peer]].name).rtt;
    };
    o.shaper = [&c, site, site_of, host, pairs](size_t peer, std::vector<std::unique_ptr<transport::Link>> streams,
                                                 int generation) {
      const std::string& me = c.sites[site].name;
      const std::string& other = c.sites[site_of[peer]].name;
      WanPathConfig path = c.wan.path_between(me, other);
      auto& pair = (*pairs)[site_of[peer]];
      if (!pair)
        pair = c.wan.every_worker() && path.bandwidth_bits > 0
                   ? transport::Bottleneck::in_file(path.bandwidth_bits, str_cat(c.job.run_dir, "/wan/", me, "-", other, ".clock"), host)
                   : std::make_shared<transport::Bottleneck>(path.bandwidth_bits, host);
      std::vector<std::unique_ptr<transport::Link>> out;
      for (size_t k = 0; k < streams.size(); ++k) {
        transport::WanEmulation e;
        e.bandwidth_bits_per_s = path.bandwidth_bits;
        e.one_way_delay = path.rtt / 2;
        e.jitter = path.jitter;
        e.window_bytes = c.wan.window_bytes;
        e.seed = c.job.seed * 7919 + site * 104729 + peer * 31 + k;
        if (k == 0) {
          for (const auto& f : c.wan.faults) {
            if (!f.a.empty() && !((f.a == me && f.b == other) || (f.a == other && f.b == me))) continue;
            if (generation > 0 && !f.every) continue;  // a reconnected link is a clean one
            if (generation > 0) {  // a repeating cut: again `every` after this reconnection
              transport::WanFault again;
              again.kind = transport::WanFault::Kind::kCut;
              again.at = *f.every;
              e.faults.push_back(again);
              continue;
            }
            transport::WanFault wf;
            wf.kind = f.kind == "cut"         ? transport::WanFault::Kind::kCut
                      : f.kind == "stall"     ? transport::WanFault::Kind::kStall
                      : f.kind == "blackhole" ? transport::WanFault::Kind::kBlackhole
                                              : transport::WanFault::Kind::kCorrupt;
            wf.at = f.at;
            wf.after_bytes = f.after_bytes;
            wf.duration = f.duration;
            e.faults.push_back(wf);
          }
        }
        out.push_back(std::make_unique<transport::EmulatedLink>(std::move(streams[k]), e, pair));
      }
      return out;
    };
  }
  auto [host_name, port] = transport::parse_host_port(o.sites[self].address);
  auto listener = std::make_unique<transport::TcpListener>(host_name, port, o.link);
  GatewayLinks g;
  g.connector = std::make_unique<transport::SiteConnector>(std::move(o), std::move(listener));
  g.links = g.connector->connect_all(Deadline::after(c.job.timeout));
  return g;
}

}  // namespace

GatewayLinks connect_gateway(const Config& c, size_t site, bool joining) {
  std::vector<transport::SiteAddress> endpoints;
  std::vector<size_t> site_of;
  for (size_t s = 0; s < c.sites.size(); ++s) {
    endpoints.push_back({c.sites[s].name, c.sites[s].gateway, ""});
    site_of.push_back(s);
  }
  return connect_endpoints(c, std::move(endpoints), std::move(site_of), site, joining);
}

std::string worker_address(const Config& c, size_t site, int rank) {
  const SiteConfig& s = c.sites.at(site);
  if (rank == 0) return s.gateway;
  if (s.worker_addresses.size() != static_cast<size_t>(s.workers - 1))
    throw ConfigError(str_cat(c.source_path, ": key 'sites[", site, "].worker_addresses': wan.mode = \"every_worker\" "
                              "needs the WAN address (\"host:port\") of each of site '", s.name, "''s ranks 1 .. ",
                              s.workers - 1, "; it lists ", s.worker_addresses.size()));
  return s.worker_addresses[static_cast<size_t>(rank - 1)];
}

std::vector<collective::WorkerSlot> worker_slots(const Config& c) {
  std::vector<collective::WorkerSlot> slots;
  for (size_t s = 0; s < c.sites.size(); ++s)
    for (int r = 0; r < c.sites[s].workers; ++r) slots.push_back({s, r, str_cat(c.sites[s].name, "/", r)});
  return slots;
}

GatewayLinks connect_worker(const Config& c, size_t site, int rank) {
  std::vector<transport::SiteAddress> endpoints;
  std::vector<size_t> site_of;
  size_t self = 0;
  for (const auto& w : worker_slots(c)) {
    if (w.site == site && w.rank == rank) self = endpoints.size();
    endpoints.push_back({w.name, worker_address(c, w.site, w.rank), c.sites[w.site].name});
    site_of.push_back(w.site);
  }
  return connect_endpoints(c, std::move(endpoints), std::move(site_of), self, false, rank);
}

}  // namespace nebula::site
