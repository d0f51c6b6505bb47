// One worker process of a job: `nebula worker CONFIG --site NAME --rank N`, spawned by
// `nebula run` in local mode or by a cluster launcher in a deployment.
#pragma once

#include <string>

#include "nebula/config.h"
#include "site/worker_identity.h"

namespace nebula::train {

using site::WorkerIdentity;

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
