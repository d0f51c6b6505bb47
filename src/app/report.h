// `nebula report RUN_DIR [RUN_DIR...]`: the runs' curves side by side, as SVG charts and one
// HTML page that shows them with a table of each run's summary, and as TensorBoard event files.
//
//   loss_vs_time.svg    training loss (each site's gateway) against seconds since start
//   loss_vs_tokens.svg  against the tokens that gateway processed
//   loss_vs_wan.svg     against the WAN bytes that site's gateway sent so far
//   index.html          the table (summary.json of each run), each run's strategy decisions
//                       (summary.json's "decisions": the controller's choices and their
//                       measured reasons) and the three charts
//
//   tensorboard/RUN/SITE/events.out.tfevents.*
//                       the same metrics for `tensorboard --logdir OUT/tensorboard`, per step:
//                       train/loss          mean over the site's ranks' lines at that step
//                       train/tokens_per_s  their sum (the site's throughput)
//                       wan/bytes_sent      the site gateway's, cumulative
//                       eval/KEY            every number of the gateway's eval lines, nested
//                                           objects flattened with '/' (eval/de/accuracy)
//                       Wall times are the lines' `time`. A later line for the same step and rank
//                       replaces an earlier one (a resumed run repeats steps); event files of an
//                       earlier report in those directories are replaced.
//
// A series is "RUN · SITE", RUN the run directory's name (in tensorboard/, RUN-2, RUN-3... when
// two run directories share a name). Malformed metrics lines are skipped with a warning naming
// file:line (read_metrics).
#pragma once

#include <string>
#include <vector>

namespace nebula::app {

struct ReportResult {
  std::vector<std::string> files;        // the charts and index.html (last)
  std::vector<std::string> event_files;  // tensorboard/RUN/SITE/events.out.tfevents.*
  size_t skipped_lines = 0;              // malformed metrics lines, over all runs
};

// Writes the report into out_dir (created). DataError naming the run directory if one has no
// metrics.jsonl with training lines.
ReportResult write_report(const std::vector<std::string>& run_dirs, const std::string& out_dir);

}  // namespace nebula::app
