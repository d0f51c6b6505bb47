// Line charts as SVG images (what `nebula demo` saves next to its summary): axes with tick
// labels, one polyline per series, a legend. SVG is text, so the charts need no library and
// open in any browser; the values are also in the run's metrics.jsonl / summary.json.
//
// Non-finite points are skipped. Labels are XML-escaped. Thread safety: pure functions.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace nebula::eval {

struct Series {
  std::string label;
  std::vector<std::pair<double, double>> points;  // (x, y)
};

struct ChartOptions {
  std::string title;
  std::string x_label;
  std::string y_label;
  int width = 640;
  int height = 400;
  bool y_from_zero = false;  // the y axis starts at 0 (accuracies, bytes)
};

// & < > " as entities: text for SVG and HTML.
std::string xml_escape(const std::string& s);

std::string line_chart_svg(const std::vector<Series>& series, const ChartOptions& options);
// Writes line_chart_svg(...) to `path`; DataError naming the path if it cannot be written.
void write_line_chart(const std::string& path, const std::vector<Series>& series, const ChartOptions& options);

}  // namespace nebula::eval
