#include "train/gateway.h"

#include <algorithm>
#include <spdlog/spdlog.h>

#include <filesystem>

#include "nebula/error.h"
#include "transport/certs.h"
#include "transport/emulated_link.h"
#include "transport/tcp_link.h"
#include "transport/tls_link.h"

namespace nebula::train {
namespace fs = std::filesystem;

transport::TlsFiles tls_files(const Config& c, const std::string& site) {
  const auto& s = c.security;
  transport::TlsFiles p = s.certs.empty() ? transport::TlsFiles{} : transport::TlsFiles::for_site(s.certs, site);
  if (!s.ca.empty()) p.ca = s.ca;
  if (!s.cert.empty()) p.cert = s.cert;
  if (!s.key.empty()) p.key = s.key;
  if (p.ca.empty() || p.cert.empty() || p.key.empty())
    throw ConfigError(str_cat(c.source_path, ": [security] needs certs = \"DIR\" (made with `nebula certs init DIR` ",
                              "and `nebula certs issue DIR --site ", site, "`) or ca, cert and key paths; ",
                              "or insecure = true for plaintext links"));
  return p;
}

void ensure_local_certificates(Config& c) {
  if (c.security.insecure || !c.security.certs.empty() || !c.security.ca.empty()) return;
  const std::string dir = c.job.run_dir + "/certs";
  fs::create_directories(dir);
  if (!fs::exists(dir + "/ca.pem")) transport::create_ca(dir);
  for (const auto& s : c.sites)
    if (!fs::exists(dir + "/" + s.name + ".pem")) transport::issue_site_certificate(dir, s.name);
  c.security.certs = dir;
}

GatewayLinks connect_gateway(const Config& c, size_t site, bool joining) {
  transport::ConnectorOptions o;
  o.job = c.job.name;
  o.self = site;
  for (const auto& s : c.sites) o.sites.push_back({s.name, s.gateway});
  o.streams = static_cast<int>(c.wan.streams);
  o.link.max_payload = c.wan.max_frame;
  o.handshake_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(c.wan.handshake_timeout);
  o.reconnect_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
      joining ? std::max(c.wan.reconnect_timeout, c.job.timeout) : c.wan.reconnect_timeout);
  o.max_pending = c.wan.max_pending;
  o.audit = std::make_shared<transport::AuditLog>(c.security.audit_log.empty() ? c.job.run_dir + "/audit.jsonl"
                                                                               : c.security.audit_log);
  if (c.security.insecure) {
    spdlog::warn("security.insecure = true: links to other sites are PLAINTEXT and unauthenticated");
  } else {
    o.tls = transport::TlsContext::create(tls_files(c, c.sites[site].name));
  }
  if (c.wan.emulated()) {
    // One bottleneck per site pair, shared by its streams. Faults fire on the first
    // connection only, except a cut with `every`, which fires on each one.
    auto bottlenecks = std::make_shared<std::map<size_t, std::shared_ptr<transport::Bottleneck>>>();
    o.shaper = [&c, site, bottlenecks](size_t peer, std::vector<std::unique_ptr<transport::Link>> streams,
                                       int generation) {
      const std::string& me = c.sites[site].name;
      const std::string& other = c.sites[peer].name;
      WanPathConfig path = c.wan.path_between(me, other);
      auto& bottleneck = (*bottlenecks)[peer];
      if (!bottleneck) bottleneck = std::make_shared<transport::Bottleneck>(path.bandwidth_bits);
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
            wf.kind = f.kind == "cut" ? transport::WanFault::Kind::kCut
                      : f.kind == "stall" ? transport::WanFault::Kind::kStall
                                          : transport::WanFault::Kind::kCorrupt;
            wf.at = f.at;
            wf.after_bytes = f.after_bytes;
            wf.duration = f.duration;
            e.faults.push_back(wf);
          }
        }
        out.push_back(std::make_unique<transport::EmulatedLink>(std::move(streams[k]), e, bottleneck));
      }
      return out;
    };
  }
  auto [host, port] = transport::parse_host_port(c.sites[site].gateway);
  auto listener = std::make_unique<transport::TcpListener>(host, port, o.link);
  GatewayLinks g;
  g.connector = std::make_unique<transport::SiteConnector>(std::move(o), std::move(listener));
  g.links = g.connector->connect_all(Deadline::after(c.job.timeout));
  return g;
}

}  // namespace nebula::train
