// `nebula report RUN_DIR [RUN_DIR...]`: the runs' curves side by side, as SVG charts and one
// HTML page that shows them with a table of each run's summary.
//
//   loss_vs_time.svg    training loss (each site's gateway) against seconds since start
//   loss_vs_tokens.svg  against the tokens that gateway processed
//   loss_vs_wan.svg     against the WAN bytes that site's gateway sent so far
//   index.html          the table (summary.json of each run) and the three charts
//
// A series is "RUN · SITE", RUN the run directory's name. Malformed metrics lines are skipped
// with a warning naming file:line (read_metrics). TensorBoard event files are not written.
#pragma once

#include <string>
#include <vector>

namespace nebula::train {

struct ReportResult {
  std::vector<std::string> files;  // what was written, index.html last
  size_t skipped_lines = 0;        // malformed metrics lines, over all runs
};

// Writes the report into out_dir (created). DataError naming the run directory if one has no
// metrics.jsonl with training lines.
ReportResult write_report(const std::vector<std::string>& run_dirs, const std::string& out_dir);

}  // namespace nebula::train
