// One worker process of a job: `nebula worker CONFIG --site NAME --rank N`, spawned by
// `nebula run` in local mode or by a cluster launcher in a deployment.
#pragma once

#include <string>

#include "nebula/config.h"

namespace nebula::train {

struct WorkerIdentity {
  size_t site = 0;     // index into config.sites
  int local_rank = 0;  // rank inside the site; 0 is the site's gateway
  std::string store;   // the site's c10d store, host:port (empty: [[sites]] store)
  bool external_store = false;  // it exists already (torchrun's agent): rank 0 does not host it
};

// Trains to the end and returns 0; or, on SIGINT/SIGTERM, writes a checkpoint at the end of
// the step (every worker of the site at the same one) and returns 128 + the signal. With
// `resume`, starts from the newest checkpoint every worker of the site (diloco, streaming) or
// of the job (sync) holds. Throws on any failure (the CLI turns it into a message and exit code).
// `rejoin` (elastic diloco/streaming): this site was lost and restarted while the others went
// on; it resumes from its own checkpoint if it has one, then joins them and takes their
// global state.
int run_worker(const Config& config, const WorkerIdentity& who, bool resume = false, bool rejoin = false);

// Where run_worker looks for the tokenizer when config.data.tokenizer is empty.
std::string default_tokenizer_path(const Config& config);

}  // namespace nebula::train
