#include "eval/plot.h"

#include <gtest/gtest.h>

#include <cmath>
#include <regex>

namespace nebula::eval {
namespace {

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

TEST(Plot, OnePolylinePerSeriesWithEveryFinitePointInsideThePlotArea) {
  ChartOptions o;
  o.title = "loss <sync & diloco>";
  std::vector<Series> s = {{"sync", {{0, 6.5}, {50, 5.9}, {100, 5.5}}},
                           {"diloco", {{0, 6.5}, {50, NAN}, {100, 5.6}}}};
  const std::string svg = line_chart_svg(s, o);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_EQ(count(svg, "<polyline"), 2u);
  EXPECT_NE(svg.find("loss &lt;sync &amp; diloco&gt;"), std::string::npos);  // escaped
  // Points: 3 for sync, 2 for diloco (NaN skipped); all within [left, left + plot width] × [top, top + height].
  std::regex poly("points=\"([^\"]*)\"");
  std::vector<size_t> sizes;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), poly); it != std::sregex_iterator(); ++it) {
    std::string pts = (*it)[1];
    std::regex pair("([-0-9.e]+),([-0-9.e]+)");
    size_t n = 0;
    for (auto p = std::sregex_iterator(pts.begin(), pts.end(), pair); p != std::sregex_iterator(); ++p, ++n) {
      const double x = std::stod((*p)[1]), y = std::stod((*p)[2]);
      EXPECT_GE(x, 70 - 1e-9);
      EXPECT_LE(x, 640 - 160 + 1e-9);
      EXPECT_GE(y, 40 - 1e-9);
      EXPECT_LE(y, 400 - 50 + 1e-9);
    }
    sizes.push_back(n);
  }
  EXPECT_EQ(sizes, (std::vector<size_t>{3, 2}));
}

TEST(Plot, EmptyAndFlatSeriesStillDrawAxes) {
  EXPECT_NE(line_chart_svg({}, {}).find("</svg>"), std::string::npos);
  const std::string flat = line_chart_svg({{"x", {{1, 2}, {1, 2}}}}, {});
  EXPECT_EQ(flat.find("nan"), std::string::npos);
  EXPECT_EQ(flat.find("inf"), std::string::npos);
}

}  // namespace
}  // namespace nebula::eval
