// RUN_DIR/metrics.jsonl: one JSON object per line, appended by every worker of every site.
// Each line is written with a single write(2) on an O_APPEND descriptor, so lines from
// concurrent processes never interleave.
//
// Fields of a step line: time (unix s), elapsed (s since the worker started), site, rank, step,
// loss (mean over the lines' window), tokens (this worker's, cumulative), tokens_per_s,
// wan_bytes_sent, wan_bytes_received (the site gateway's cumulative WAN bytes; 0 elsewhere),
// adamw_state_values (the inner optimizer's moments this worker holds), peak_rss_bytes (this
// process's peak resident memory so far), site_bytes_sent (bytes this worker sent to its site's
// other workers so far: SiteGroup::bytes_sent), and the link, codec and strategy figures
// (worker.cc).
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace nebula::train {

class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const nlohmann::json& line);

 private:
  int fd_;
  std::string path_;
};

// Writes `value` to `path` atomically (temp file, fsync, rename).
void write_json_atomically(const std::string& path, const nlohmann::json& value);

double unix_time();

// This process's peak resident set (VmHWM in /proc/self/status), in bytes; 0 where it cannot
// be read.
int64_t peak_rss_bytes();

// A worker's peak resident memory in each phase of its run: the kernel's high-water mark
// (VmHWM) is reset when a phase begins (/proc/self/clear_refs, "5") and read when it ends, so a
// phase's peak is its own, not the process's so far. Where the mark cannot be reset (a kernel
// before 4.0, a locked-down /proc) every phase reads the peak so far (exact() false).
class PhasePeaks {
 public:
  enum Phase { kInit, kResume, kStep, kOuterSync, kCheckpoint, kEval, kPhases };
  static const char* name(Phase p);
  explicit PhasePeaks(Phase first);  // begins `first`
  void begin(Phase p);
  void end();  // of the phase begun last
  int64_t peak(Phase p) const { return peaks_[p]; }
  int64_t overall() const;  // the process's peak so far, over every phase
  // The peak before the first phase began: the process with LibTorch loaded, before the set-up
  // builds anything (what a worker holds that no training state explains).
  int64_t start() const { return before_; }
  bool exact() const { return resettable_; }

 private:
  int64_t peaks_[kPhases] = {};
  int64_t before_ = 0;  // the peak before the first reset (start-up before kInit began)
  int open_ = -1;
  bool resettable_ = false;
};

// The lines of a metrics.jsonl file. A line that is not a JSON object is skipped with a
// warning naming path:line (a run killed mid-write may leave a torn last line); `skipped`
// counts them. A missing file is an empty run.
std::vector<nlohmann::json> read_metrics(const std::string& path, size_t* skipped = nullptr);

}  // namespace nebula::train
