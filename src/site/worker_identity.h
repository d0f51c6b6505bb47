// Which worker of the job this process is: its site, its rank in the site, and the site's
// rendezvous store (from nebula::Placement, include/nebula/placement.h, or the library's
// Session). Everything that connects a worker to its site and the WAN takes it.
#pragma once

#include <cstddef>
#include <string>

namespace nebula::site {

struct WorkerIdentity {
  size_t site = 0;     // index into config.sites
  int local_rank = 0;  // rank inside the site; 0 is the site's gateway
  std::string store;   // the site's c10d store, host:port (empty: [[sites]] store)
  bool external_store = false;  // it exists already (torchrun's agent): rank 0 does not host it
};

}  // namespace nebula::site
