#include "nebula/error.h"

namespace nebula::detail {

void throw_check_failed(const char* file, int line, const char* cond, const std::string& msg) {
  std::string where = file;
  // Keep paths short and stable: "src/transport/tcp_link.cc" rather than the absolute build path.
  if (auto pos = where.rfind("/src/"); pos != std::string::npos) where = where.substr(pos + 1);
  throw Error(where + ":" + std::to_string(line) + ": check `" + cond + "` failed" +
              (msg.empty() ? "" : ": " + msg));
}

}  // namespace nebula::detail
