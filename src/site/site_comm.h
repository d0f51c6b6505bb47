// A worker's communication, assembled from the job config: the site's c10d group, and on the
// gateway (local rank 0) the WAN links to the other sites and the mesh over them, joined in
// the two-level Hierarchy that strategies use. One place for both the `nebula worker` loop
// (worker.cc) and library users (include/nebula/session.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "collective/gateway_mesh.h"
#include "collective/hierarchical.h"
#include "collective/site_group.h"
#include "nebula/config.h"
#include "site/worker_identity.h"
#include "transport/link.h"
#include "transport/site_connector.h"

namespace nebula::site {

struct SiteComm {
  // Declared in the order they are built; destroyed in reverse (the hierarchy first).
  std::unique_ptr<collective::SiteGroup> group;
  std::unique_ptr<collective::SiteGroup> comm_group;    // every_worker: the communication thread's
  std::unique_ptr<transport::SiteConnector> connector;  // gateway (every_worker: each worker): re-establishes broken links
  std::unique_ptr<transport::Link> teacher;             // gateway of a [distill] student only
  std::unique_ptr<collective::WorkerMesh> workers;      // every_worker: this worker's links to the other sites' workers
  std::unique_ptr<collective::GatewayMesh> mesh;        // gateway only (every_worker: over rank 0's links to rank 0s)
  std::unique_ptr<collective::Hierarchy> comm;
  std::vector<std::string> training_names;  // the sites that train together, in mesh order
  size_t training_index = 0;                // this site's index among them
};

// Blocks until every worker of the site has joined and, on the gateway, the links to every
// other site are up (bounded by job.timeout). With [distill] the teacher site's link goes to
// `teacher` and the mesh holds this site alone. `rejoin`: see run_worker.
SiteComm connect_site(const Config& config, const WorkerIdentity& who, bool rejoin = false);

}  // namespace nebula::site
