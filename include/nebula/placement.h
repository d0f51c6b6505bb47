// Where a `nebula worker` process belongs in a job: its site, its rank in the site and the
// site's rendezvous store, from its command line or from what a cluster launcher set. A site is
// one launch (one torchrun, one srun, one mpirun) of `workers` processes; rank 0 is the site's
// gateway.
//
//   site   --site, else $NEBULA_SITE
//   rank   the first that is set, with the site size it comes with:
//            --rank, $NEBULA_RANK                       (size: the site's workers)
//            torchrun   $RANK, $WORLD_SIZE               ($LOCAL_RANK alone: torch.distributed.launch)
//            Open MPI   $OMPI_COMM_WORLD_RANK, $OMPI_COMM_WORLD_SIZE
//            Slurm      $SLURM_PROCID, $SLURM_NTASKS
//          A launcher's size must equal the site's workers, and the rank must be below it.
//   store  [[sites]] store; under torchrun $MASTER_ADDR:$MASTER_PORT. When torchrun's agent
//          hosts that store ($TORCHELASTIC_USE_AGENT_STORE=True) every rank is its client, as
//          torch.distributed's env:// does; otherwise rank 0 hosts it.
//
// Mistakes are ConfigErrors naming the variables, their values and what to do.
#pragma once

#include <functional>
#include <string>

#include "nebula/config.h"

namespace nebula {

struct Placement {
  size_t site = 0;              // index into config.sites
  int rank = 0;                 // in the site
  std::string store;            // host:port of the site's c10d store
  bool external_store = false;  // the store exists already (torchrun's agent): rank 0 is a client too
  std::string launcher;         // "command line", "nebula", "torchrun", "open mpi" or "slurm"
};

// `getenv`-like: the variable's value or null.
using Environment = std::function<const char*(const char*)>;

Placement resolve_placement(const Config& config, const std::string& site_option, const std::string& rank_option,
                            const Environment& env);

}  // namespace nebula
