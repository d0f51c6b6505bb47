// AuditLog: one JSON line per inter-site connection attempt (DESIGN.md, "Security": "an
// audit log records every connection attempt: peer, certificate fingerprint, outcome").
//
// Each record() appends one line such as
//   {"time":1714567890.123,"utc":"2024-05-01T12:51:30.123Z","local_site":"alpha",
//    "peer_site":"beta","address":"10.0.0.2:4242","fingerprint":"3f1c...","outcome":"refused",
//    "reason":"certificate expired (notAfter ...)"}
// with one write(2) on a descriptor opened with O_APPEND, so lines from concurrent threads
// and concurrent processes sharing the file never interleave (Linux serialises O_APPEND
// writes to a regular file). Strings that are not valid UTF-8 are written with U+FFFD.
//
// Thread safety: record() may be called from any number of threads at once; the object
// holds no mutable state besides the descriptor, which write(2) already serialises.
#pragma once

#include <string>

namespace nebula::transport {

struct AuditEntry {
  std::string local_site;   // our site name
  std::string peer_site;    // the site the peer claimed or its certificate named ("" if unknown)
  std::string address;      // the peer's "host:port"
  std::string fingerprint;  // SHA-256 hex of the peer's certificate ("" if it sent none)
  std::string outcome;      // "accepted" | "refused" (authentication failed) | "failed" (network, timeout)
  std::string reason;       // short human reason, e.g. TlsHandshakeError::reason(); "" when accepted
};

class AuditLog {
 public:
  // Opens (creating, mode 0640) `path` for appending. An empty path makes a disabled log
  // whose record() does nothing. Throws nebula::Error naming the path when it cannot be
  // opened (missing directory, permissions).
  explicit AuditLog(std::string path);
  ~AuditLog();
  AuditLog(const AuditLog&) = delete;
  AuditLog& operator=(const AuditLog&) = delete;

  // Appends one line; adds "time" (unix seconds, fractional) and "utc" (ISO-8601, ms).
  // Throws nebula::Error naming the path when the write fails or is short (e.g. disk
  // full), and for an outcome other than the three above.
  void record(const AuditEntry& entry);

  bool enabled() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

 private:
  const std::string path_;
  int fd_ = -1;  // O_APPEND; set by the constructor, never changed
};

}  // namespace nebula::transport
