// Which worker of the job this process is: its site, its rank in the site, and the site's
// rendezvous store (from nebula::Placement, include/nebula/placement.h, or the library's
// Session). Everything that connects a worker to its site and the WAN takes it.
#pragma once

#include <cstddef>
#include <string>

#include "nebula/config.h"

namespace nebula::site {

struct WorkerIdentity {
  size_t site = 0;     // index into config.sites
  int local_rank = 0;  // rank inside the site; 0 is the site's gateway
  std::string store;   // the site's c10d store, host:port (empty: [[sites]] store)
  bool external_store = false;  // it exists already (torchrun's agent): rank 0 does not host it
};

// The worker's index in the job, sites in order and ranks in order: what per-worker counters
// of the job and the library's global rank are indexed by.
inline size_t job_index(const Config& config, const WorkerIdentity& who) {
  size_t first = 0;
  for (size_t s = 0; s < who.site; ++s) first += static_cast<size_t>(config.sites[s].workers);
  return first + static_cast<size_t>(who.local_rank);
}

}  // namespace nebula::site
