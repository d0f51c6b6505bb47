// Logging: spdlog, with one process-wide pattern that names the process ("alpha/1") so the
// interleaved logs of a local run can be told apart.
#pragma once

#include <string>

namespace nebula {

// Sets the default logger's pattern to "[time] [tag] level: message" and the level from
// NEBULA_LOG (trace|debug|info|warn|error; default info). Call once at process start.
void init_logging(const std::string& tag);

}  // namespace nebula
