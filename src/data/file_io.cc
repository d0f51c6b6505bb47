#include "data/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "nebula/error.h"

namespace nebula::data {
namespace {

[[noreturn]] void fail(const std::string& path, const char* what, int err) {
  throw DataError(str_cat(path, ": ", what, ": ", std::strerror(err)));
}

// Closes the descriptor on every path out of a function.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::string read_file_bytes(const std::string& path, size_t max_bytes) {
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) fail(path, "cannot open", errno);
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) fail(path, "cannot stat", errno);
  if (!S_ISREG(st.st_mode)) fail(path, "cannot read", S_ISDIR(st.st_mode) ? EISDIR : EINVAL);
  if (static_cast<unsigned long long>(st.st_size) > max_bytes) {
    throw DataError(str_cat(path, ": file too large (", st.st_size, " bytes, limit ", max_bytes, ")"));
  }
  std::string out;
  out.resize(static_cast<size_t>(st.st_size));
  size_t got = 0;
  // Read until EOF rather than trusting st_size: the file may change under us.
  for (;;) {
    if (got == out.size()) {
      if (out.size() >= max_bytes) {
        char probe;
        ssize_t n = ::read(f.fd, &probe, 1);
        if (n == 0) break;
        throw DataError(str_cat(path, ": file grew past the limit of ", max_bytes, " bytes while reading"));
      }
      out.resize(std::min(max_bytes, out.size() + 65536));
    }
    ssize_t n = ::read(f.fd, out.data() + got, out.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(path, "cannot read", errno);
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  out.resize(got);
  return out;
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  std::string tmp = str_cat(path, ".tmp.", ::getpid());
  Fd f;
  f.fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f.fd < 0) fail(tmp, "cannot create", errno);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(f.fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::unlink(tmp.c_str());
      fail(tmp, "cannot write", err);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(f.fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    fail(tmp, "cannot fsync", err);
  }
  int fd = f.fd;
  f.fd = -1;
  if (::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    fail(tmp, "cannot close", err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    fail(path, "cannot rename temporary file into place", err);
  }
}

}  // namespace nebula::data
