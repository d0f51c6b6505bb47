// RUN_DIR/metrics.jsonl: one JSON object per line, appended by every worker of every site.
// Each line is written with a single write(2) on an O_APPEND descriptor, so lines from
// concurrent processes never interleave.
//
// Fields of a step line: time (unix s), elapsed (s since the worker started), site, rank, step,
// loss (mean over the lines' window), tokens (this worker's, cumulative), tokens_per_s,
// wan_bytes_sent, wan_bytes_received (the site gateway's cumulative WAN bytes; 0 elsewhere),
// adamw_state_values (the inner optimizer's moments this worker holds), peak_rss_bytes (this
// process's VmHWM so far), and the link, codec and strategy figures (worker.cc).
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

// The lines of a metrics.jsonl file. A line that is not a JSON object is skipped with a
// warning naming path:line (a run killed mid-write may leave a torn last line); `skipped`
// counts them. A missing file is an empty run.
std::vector<nlohmann::json> read_metrics(const std::string& path, size_t* skipped = nullptr);

}  // namespace nebula::train
