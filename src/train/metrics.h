// RUN_DIR/metrics.jsonl: one JSON object per line, appended by every worker of every site.
// Each line is written with a single write(2) on an O_APPEND descriptor, so lines from
// concurrent processes never interleave.
//
// Fields of a step line: time (unix s), elapsed (s since the worker started), site, rank, step,
// loss (mean over the lines' window), tokens (this worker's, cumulative), tokens_per_s,
// wan_bytes_sent, wan_bytes_received (the site gateway's cumulative WAN bytes; 0 elsewhere).
#pragma once

#include <nlohmann/json.hpp>

#include <string>

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

}  // namespace nebula::train
