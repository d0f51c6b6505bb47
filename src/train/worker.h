// One worker process of a job: `nebula worker CONFIG --site NAME --rank N`, spawned by
// `nebula run` in local mode or by a cluster launcher in a deployment.
#pragma once

#include <string>

#include "nebula/config.h"

namespace nebula::train {

struct WorkerIdentity {
  size_t site = 0;     // index into config.sites
  int local_rank = 0;  // rank inside the site; 0 is the site's gateway
};

// Trains to the end. Throws on any failure (the CLI turns it into a message and exit code).
void run_worker(const Config& config, const WorkerIdentity& who);

// Where run_worker looks for the tokenizer when config.data.tokenizer is empty.
std::string default_tokenizer_path(const Config& config);

}  // namespace nebula::train
