// Local mode: `nebula run CONFIG` spawns every worker of every site as a process on this
// machine (loopback), with the WAN emulator between the site gateways, watches them, shows
// a progress line per site, and stops them all if one fails.
#pragma once

#include <string>

#include "nebula/config.h"

namespace nebula::launch {

struct LaunchOptions {
  std::string executable;  // the nebula binary to run workers with (normally /proc/self/exe)
  bool resume = false;     // workers continue from their checkpoints (nebula run --resume)
};

// Returns the process exit code: 0 when every worker finished, non-zero otherwise.
int run_local(Config config, const LaunchOptions& options);

// Prints RUN_DIR/summary.json as a short table. Returns false if it is missing or unreadable.
bool print_summary(const std::string& run_dir);

}  // namespace nebula::launch
