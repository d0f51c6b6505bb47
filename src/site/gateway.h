// The site gateway's WAN side, assembled from the job config: TLS files, the WAN emulator
// (local mode), striping, limits, audit log → transport::SiteConnector → links per site.
#pragma once

#include <memory>
#include <vector>

#include "collective/worker_mesh.h"
#include "nebula/config.h"
#include "transport/link.h"
#include "transport/site_connector.h"
#include "transport/tls_link.h"

namespace nebula::site {

// The CA, certificate and key that site `site` uses, from [security] (explicit paths win over
// `certs`). ConfigError naming the keys to set when there are none.
// With security.host_certs (every_worker), worker `rank`'s own certificate of the site
// (<certs>/hosts/<site>/<rank>.pem); ConfigError naming the missing file and the command
// that makes it.
transport::TlsFiles tls_files(const Config& config, const std::string& site, int rank = -1);

// Connects this site's gateway to every other site's. Keep the connector alive as long as the
// links: it re-establishes them when they break.
struct GatewayLinks {
  std::unique_ptr<transport::SiteConnector> connector;
  std::vector<std::unique_ptr<transport::Link>> links;  // by site; null for this site
};
// `joining` (elastic rejoin): the links wait for the running sites to answer for up to
// job.timeout, not just wan.reconnect_timeout (they admit a site at their next round).
GatewayLinks connect_gateway(const Config& config, size_t site, bool joining = false);

// wan.mode = "every_worker": connects worker `rank` of `site` to every worker of the other
// sites. The endpoints are every worker of every site, in site order and rank order, named
// "site/rank"; links are indexed by endpoint (null for this site's own workers). Worker r of a
// site listens at its `gateway` (r = 0) or worker_addresses[r - 1], and presents the site's
// certificate. ConfigError naming sites[N].worker_addresses when a site has none.
GatewayLinks connect_worker(const Config& config, size_t site, int rank);
// Every worker of every site, in that order (the endpoints of connect_worker, the slots of the
// WorkerMesh over its links), named "site/rank".
std::vector<collective::WorkerSlot> worker_slots(const Config& config);
// The WAN address worker `rank` of site `site` listens at (its gateway for rank 0).
std::string worker_address(const Config& config, size_t site, int rank);

// Local mode: makes RUN_DIR/certs (a CA and one certificate per site, and with
// security.host_certs one per worker) unless it exists, and points config.security.certs at it.
void ensure_local_certificates(Config& config);

}  // namespace nebula::site
