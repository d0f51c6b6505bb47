#include "train/report.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "nebula/error.h"
#include "util/temp_dir.h"

namespace nebula::train {
namespace {

void write(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << text;
}

// Two runs side by side: one series per (run, site) in every chart, the summaries in the
// page's table, a malformed line skipped and counted.
TEST(Report, ChartsEveryRunAndSiteAndSkipsMalformedLines) {
  nebula::testing::TempDir dir("report");
  write(dir.file("sync/metrics.jsonl"),
        "{\"site\":\"alpha\",\"rank\":0,\"step\":10,\"loss\":5.5,\"elapsed\":1.0,\"tokens\":100,\"wan_bytes_sent\":1048576}\n"
        "{\"site\":\"alpha\",\"rank\":1,\"step\":10,\"loss\":5.4,\"elapsed\":1.0,\"tokens\":100,\"wan_bytes_sent\":0}\n"
        "{\"site\":\"beta\",\"rank\":0,\"step\":10,\"loss\":5.6,\"elapsed\":1.1,\"tokens\":90,\"wan_bytes_sent\":2097152}\n"
        "{\"site\":\"alpha\",\"rank\":0,\"step\":20,\"loss\":4.9,\"elapsed\":2.0,\"tokens\":200,\"wan_bytes_sent\":3145728}\n"
        "{\"site\":\"alpha\",\"rank\":0,\"step\":20,\"lo\n"  // torn by a crash
        "{\"site\":\"alpha\",\"rank\":0,\"step\":0,\"eval\":{}}\n");
  write(dir.file("sync/summary.json"), "{\"strategy\":\"sync\",\"final_val_loss\":4.8765,\"steps\":20}");
  write(dir.file("diloco/metrics.jsonl"),
        "{\"site\":\"alpha\",\"rank\":0,\"step\":10,\"loss\":5.0,\"elapsed\":0.5,\"tokens\":100,\"wan_bytes_sent\":0}\n");
  const auto r = write_report({dir.file("sync"), dir.file("diloco")}, dir.file("out"));
  EXPECT_EQ(r.skipped_lines, 1u);
  ASSERT_EQ(r.files.size(), 4u);
  for (const auto& f : r.files) EXPECT_TRUE(std::filesystem::exists(f)) << f;
  std::ifstream svg(dir.file("out/loss_vs_wan.svg"));
  const std::string chart((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  for (const char* label : {"sync · alpha", "sync · beta", "diloco · alpha"})
    EXPECT_NE(chart.find(label), std::string::npos) << label;
  EXPECT_EQ(chart.find("sync · alpha · "), std::string::npos);
  std::ifstream page(dir.file("out/index.html"));
  const std::string html((std::istreambuf_iterator<char>(page)), std::istreambuf_iterator<char>());
  for (const char* part : {"loss_vs_time.svg", "loss_vs_tokens.svg", "loss_vs_wan.svg", "<td>sync</td>", "4.8765",
                           "1 malformed metrics lines"})
    EXPECT_NE(html.find(part), std::string::npos) << part;
}

TEST(Report, ADirectoryWithoutTrainingLinesIsADataErrorNamingIt) {
  nebula::testing::TempDir dir("report");
  write(dir.file("empty/metrics.jsonl"), "not json\n");
  try {
    write_report({dir.file("empty")}, dir.file("out"));
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("empty")), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace nebula::train
