// Errors in nebula come in two kinds (see CONVENTIONS.md, "Two kinds of error"):
//  * bad input or a violated precondition: NEBULA_CHECK throws nebula::Error (or a
//    subclass naming the kind of input) with the place and the offending values;
//  * a peer or network failure: PeerLost / Timeout, typed and recoverable, delivered
//    to every pending operation on the link concerned.
// The CLI is the only place that turns these into exit codes and one-line messages.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace nebula {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A config file or --set override is wrong. The message names file:line:col and key.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A data file (corpus, catalog, tokenizer, checkpoint) is unreadable or corrupt.
class DataError : public Error {
 public:
  using Error::Error;
};

// A frame failed validation. `kind` says which check failed, so tests and the
// transport can react without parsing the message.
class FrameError : public Error {
 public:
  enum class Kind { kTruncated, kBadMagic, kBadVersion, kBadType, kTooLarge, kBadChecksum, kBadPayload };
  FrameError(Kind kind, const std::string& what) : Error(what), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

// A codec payload (src/codec/codec.h) failed validation. `kind` says which check failed:
//   kTruncated  fewer bytes than the header (or the header's counts) require;
//   kBadHeader  a header field is invalid in itself: unknown codec id, format version or
//               dtype, too many dims, a shape too large, or codec parameters out of range
//               (block 0, k > numel, rank > min(n, m), unknown flags);
//   kMismatch   the payload disagrees with its header or with the caller: bytes left over,
//               indices out of range or out of order, another codec's payload, or a size
//               other than the caller's expected_numel.
class CodecError : public Error {
 public:
  enum class Kind { kTruncated, kBadHeader, kMismatch };
  CodecError(Kind kind, const std::string& what) : Error(what), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

// Recoverable network failures. `peer` names the site (or address) concerned.
class NetworkError : public Error {
 public:
  NetworkError(std::string peer, const std::string& what) : Error(what), peer_(std::move(peer)) {}
  const std::string& peer() const { return peer_; }

 private:
  std::string peer_;
};

// The peer closed the connection, reset it, or stayed away past its deadline.
class PeerLost : public NetworkError {
 public:
  using NetworkError::NetworkError;
};

// A peer failed authentication (TLS handshake, certificate chain, expiry, site name) or
// spoke something other than our protocol. The connection is refused; other links go on.
class AuthError : public NetworkError {
 public:
  using NetworkError::NetworkError;
};

// A wait ran past its deadline while the peer may still be alive.
class Timeout : public NetworkError {
 public:
  using NetworkError::NetworkError;
};

namespace detail {
[[noreturn]] void throw_check_failed(const char* file, int line, const char* cond, const std::string& msg);

inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  append(os, args...);
  return os.str();
}
}  // namespace detail

// Concatenates its arguments with operator<< into a std::string.
template <typename... Args>
std::string str_cat(const Args&... args) {
  return detail::cat(args...);
}

}  // namespace nebula

// NEBULA_CHECK(cond, parts...): throws nebula::Error("file:line: check `cond` failed: parts")
#define NEBULA_CHECK(cond, ...)                                                              \
  do {                                                                                       \
    if (!(cond)) ::nebula::detail::throw_check_failed(__FILE__, __LINE__, #cond,             \
                                                      ::nebula::detail::cat(__VA_ARGS__));   \
  } while (0)
