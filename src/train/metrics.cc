#include "train/metrics.h"

#include <spdlog/spdlog.h>

#include <fstream>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "nebula/error.h"

namespace nebula::train {

int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;  // "VmHWM:  123456 kB"
  return 0;
}

namespace {
bool reset_peak_rss() {
  const int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, "5", 1) == 1;
  ::close(fd);
  return ok;
}
}  // namespace

const char* PhasePeaks::name(Phase p) {
  static const char* const names[kPhases] = {"init", "resume", "step", "outer_sync", "checkpoint", "eval"};
  return names[p];
}

PhasePeaks::PhasePeaks(Phase first) : before_(peak_rss_bytes()) {
  resettable_ = reset_peak_rss();
  open_ = first;
}

void PhasePeaks::begin(Phase p) {
  if (open_ >= 0) end();
  open_ = p;
  if (resettable_) reset_peak_rss();
}

void PhasePeaks::end() {
  if (open_ < 0) return;
  peaks_[open_] = std::max(peaks_[open_], peak_rss_bytes());
  open_ = -1;
}

int64_t PhasePeaks::overall() const {
  int64_t m = std::max(before_, peak_rss_bytes());
  for (int64_t p : peaks_) m = std::max(m, p);
  return m;
}

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error(str_cat(path, ": cannot open metrics file: ", std::strerror(errno)));
}

MetricsWriter::~MetricsWriter() { ::close(fd_); }

void MetricsWriter::write(const nlohmann::json& line) {
  std::string text = line.dump() + "\n";
  ssize_t n = ::write(fd_, text.data(), text.size());
  if (n != static_cast<ssize_t>(text.size()))
    throw Error(str_cat(path_, ": cannot append metrics: ", n < 0 ? std::strerror(errno) : "short write"));
}

void write_json_atomically(const std::string& path, const nlohmann::json& value) {
  std::string tmp = path + ".tmp";
  std::string text = value.dump(2) + "\n";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(str_cat(tmp, ": cannot create: ", std::strerror(errno)));
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fsync(fd) == 0;
  int err = errno;
  ::close(fd);
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    if (ok) err = errno;
    std::remove(tmp.c_str());
    throw Error(str_cat(path, ": cannot write: ", std::strerror(err)));
  }
}

double unix_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::vector<nlohmann::json> read_metrics(const std::string& path, size_t* skipped) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  size_t bad = 0, number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      if (++bad <= 5) spdlog::warn("{}:{}: not a metrics line (skipped): {:.80}", path, number, line);
      continue;
    }
    out.push_back(std::move(j));
  }
  if (bad > 5) spdlog::warn("{}: {} malformed lines skipped in all", path, bad);
  if (skipped) *skipped = bad;
  return out;
}

}  // namespace nebula::train
