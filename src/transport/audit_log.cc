#include "transport/audit_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>

#include "nebula/error.h"

namespace nebula::transport {

AuditLog::AuditLog(std::string path) : path_(std::move(path)) {
  if (path_.empty()) return;
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
  if (fd_ < 0)
    throw Error(str_cat("audit log ", path_, ": cannot open for appending: ", std::strerror(errno),
                        "; check that the directory exists and is writable"));
}

AuditLog::~AuditLog() {
  if (fd_ >= 0) ::close(fd_);
}

void AuditLog::record(const AuditEntry& entry) {
  if (fd_ < 0) return;
  NEBULA_CHECK(entry.outcome == "accepted" || entry.outcome == "refused" || entry.outcome == "failed",
               "audit log ", path_, ": outcome must be accepted, refused or failed, got \"", entry.outcome, "\"");
  auto now = std::chrono::system_clock::now();
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count();
  std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  ::gmtime_r(&secs, &tm);
  char utc[64];
  std::snprintf(utc, sizeof utc, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
                tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms % 1000));

  nlohmann::ordered_json j;
  j["time"] = std::chrono::duration<double>(now.time_since_epoch()).count();
  j["utc"] = utc;
  j["local_site"] = entry.local_site;
  j["peer_site"] = entry.peer_site;
  j["address"] = entry.address;
  j["fingerprint"] = entry.fingerprint;
  j["outcome"] = entry.outcome;
  j["reason"] = entry.reason;
  // Peer-supplied text (a certificate's CN) may be any bytes: never fail on it.
  std::string line = j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  line += '\n';

  // One write(2): with O_APPEND the kernel places the whole line at the end atomically.
  // A retry after a short write could interleave with another writer, so it is an error.
  for (;;) {
    ssize_t r = ::write(fd_, line.data(), line.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw Error(str_cat("audit log ", path_, ": write failed: ", std::strerror(errno)));
    if (static_cast<size_t>(r) != line.size())
      throw Error(str_cat("audit log ", path_, ": short write (", r, " of ", line.size(), " bytes; disk full?)"));
    return;
  }
}

}  // namespace nebula::transport
