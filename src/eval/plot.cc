#include "eval/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>

#include "nebula/error.h"

namespace nebula::eval {
std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

namespace {

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

// About five round tick values covering [lo, hi].
std::vector<double> ticks(double lo, double hi) {
  const double span = hi - lo;
  const double raw = span / 5;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * mag) {
      step = m * mag;
      break;
    }
  std::vector<double> out;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push_back(std::abs(t) < step * 1e-9 ? 0 : t);
  return out;
}

}  // namespace

std::string line_chart_svg(const std::vector<Series>& series, const ChartOptions& o) {
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const auto& s : series)
    for (auto [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  if (!std::isfinite(x0)) x0 = 0, x1 = 1, y0 = 0, y1 = 1;  // no data: empty axes
  if (o.y_from_zero) y0 = std::min(0.0, y0);
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y1 = y0 + 1;
  const double pad = (y1 - y0) * 0.05;
  if (!o.y_from_zero || y0 < 0) y0 -= pad;
  y1 += pad;

  const double left = 70, right = 160, top = 40, bottom = 50;
  const double pw = o.width - left - right, ph = o.height - top - bottom;
  auto px = [&](double x) { return left + (x - x0) / (x1 - x0) * pw; };
  auto py = [&](double y) { return top + (1 - (y - y0) / (y1 - y0)) * ph; };

  std::string svg = str_cat("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"", o.width, "\" height=\"", o.height,
                            "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
                            "fill=\"white\"/>\n<text x=\"",
                            o.width / 2, "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">", xml_escape(o.title),
                            "</text>\n");
  for (double t : ticks(x0, x1))
    svg += str_cat("<line x1=\"", px(t), "\" y1=\"", top + ph, "\" x2=\"", px(t), "\" y2=\"", top + ph + 5,
                   "\" stroke=\"black\"/><text x=\"", px(t), "\" y=\"", top + ph + 18, "\" text-anchor=\"middle\">",
                   num(t), "</text>\n");
  for (double t : ticks(y0, y1))
    svg += str_cat("<line x1=\"", left, "\" y1=\"", py(t), "\" x2=\"", left + pw, "\" y2=\"", py(t),
                   "\" stroke=\"#e0e0e0\"/><text x=\"", left - 6, "\" y=\"", py(t) + 4, "\" text-anchor=\"end\">",
                   num(t), "</text>\n");
  svg += str_cat("<rect x=\"", left, "\" y=\"", top, "\" width=\"", pw, "\" height=\"", ph,
                 "\" fill=\"none\" stroke=\"black\"/>\n<text x=\"", left + pw / 2, "\" y=\"", o.height - 10,
                 "\" text-anchor=\"middle\">", xml_escape(o.x_label), "</text>\n<text transform=\"translate(16,",
                 top + ph / 2, ") rotate(-90)\" text-anchor=\"middle\">", xml_escape(o.y_label), "</text>\n");
  for (size_t i = 0; i < series.size(); ++i) {
    const char* color = kColors[i % std::size(kColors)];
    std::string points;
    for (auto [x, y] : series[i].points)
      if (std::isfinite(x) && std::isfinite(y)) points += str_cat(points.empty() ? "" : " ", px(x), ",", py(y));
    svg += str_cat("<polyline fill=\"none\" stroke=\"", color, "\" stroke-width=\"2\" points=\"", points, "\"/>\n");
    const double ly = top + 10 + 18 * static_cast<double>(i);
    svg += str_cat("<line x1=\"", left + pw + 10, "\" y1=\"", ly, "\" x2=\"", left + pw + 30, "\" y2=\"", ly,
                   "\" stroke=\"", color, "\" stroke-width=\"2\"/><text x=\"", left + pw + 35, "\" y=\"", ly + 4, "\">",
                   xml_escape(series[i].label), "</text>\n");
  }
  return svg + "</svg>\n";
}

void write_line_chart(const std::string& path, const std::vector<Series>& series, const ChartOptions& options) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << line_chart_svg(series, options);
  if (!out.flush()) throw DataError(str_cat(path, ": cannot write the chart"));
}

}  // namespace nebula::eval
