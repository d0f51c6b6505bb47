#include "nebula/log.h"

#include <spdlog/spdlog.h>

#include <cstdlib>

namespace nebula {

void init_logging(const std::string& tag) {
  spdlog::set_pattern("[%H:%M:%S.%e] [" + tag + "] %^%l%$: %v");
  const char* level = std::getenv("NEBULA_LOG");
  spdlog::set_level(level ? spdlog::level::from_str(level) : spdlog::level::info);
}

}  // namespace nebula
