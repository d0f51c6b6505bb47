#include "app/report.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>

#include "eval/tensorboard.h"
#include "nebula/error.h"
#include "util/temp_dir.h"

namespace nebula::app {
namespace {

void write(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << text;
}

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) out.push_back(e.path().string());
  return out;
}

// tag → (step, value, wall time) of the one event file in `dir`.
using Curves = std::map<std::string, std::vector<std::tuple<int64_t, float, double>>>;
Curves read_curves(const std::string& dir) {
  const auto files = event_files(dir);
  EXPECT_EQ(files.size(), 1u) << dir;
  Curves out;
  if (files.empty()) return out;
  for (const auto& s : eval::read_tensorboard_scalars(files[0])) out[s.tag].emplace_back(s.step, s.value, s.wall_time);
  return out;
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
  write(dir.file("diloco/summary.json"),
        "{\"strategy\":\"diloco\",\"decisions\":[\"round 2: codec int4, H 100 <because> gap 1.2 %\"]}");
  write(dir.file("diloco/metrics.jsonl"),
        "{\"site\":\"alpha\",\"rank\":0,\"step\":10,\"loss\":5.0,\"elapsed\":0.5,\"tokens\":100,\"wan_bytes_sent\":0}\n");
  const auto r = write_report({dir.file("sync"), dir.file("diloco")}, dir.file("out"));
  EXPECT_EQ(r.skipped_lines, 1u);
  ASSERT_EQ(r.files.size(), 4u);
  for (const auto& f : r.files) EXPECT_TRUE(std::filesystem::exists(f)) << f;
  ASSERT_EQ(r.event_files.size(), 3u);  // sync/alpha, sync/beta, diloco/alpha
  for (const auto& f : r.event_files) EXPECT_FALSE(eval::read_tensorboard_scalars(f).empty()) << f;
  std::ifstream svg(dir.file("out/loss_vs_wan.svg"));
  const std::string chart((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  for (const char* label : {"sync · alpha", "sync · beta", "diloco · alpha"})
    EXPECT_NE(chart.find(label), std::string::npos) << label;
  EXPECT_EQ(chart.find("sync · alpha · "), std::string::npos);
  std::ifstream page(dir.file("out/index.html"));
  const std::string html((std::istreambuf_iterator<char>(page)), std::istreambuf_iterator<char>());
  for (const char* part : {"loss_vs_time.svg", "loss_vs_tokens.svg", "loss_vs_wan.svg", "<td>sync</td>", "4.8765",
                           "1 malformed metrics lines", "<h2>Decisions of diloco</h2>",
                           "<li>round 2: codec int4, H 100 &lt;because&gt; gap 1.2 %</li>"})
    EXPECT_NE(html.find(part), std::string::npos) << part;
  EXPECT_EQ(html.find("Decisions of sync"), std::string::npos);  // it made none
}

// Per (run, site) one event file: the loss averaged over the site's ranks, their summed
// throughput, the gateway's WAN bytes and the eval numbers, at the metrics' steps and times.
TEST(Report, TensorBoardEventFilesHoldEachSitesCurves) {
  nebula::testing::TempDir dir("report");
  write(dir.file("a/sync/metrics.jsonl"),
        "{\"time\":1000.0,\"site\":\"alpha\",\"rank\":0,\"step\":10,\"loss\":5.0,\"tokens_per_s\":100.0,\"wan_bytes_sent\":1000}\n"
        "{\"time\":1000.5,\"site\":\"alpha\",\"rank\":1,\"step\":10,\"loss\":6.0,\"tokens_per_s\":50.0,\"wan_bytes_sent\":0}\n"
        "{\"time\":1001.0,\"site\":\"alpha\",\"rank\":0,\"step\":20,\"loss\":4.0,\"tokens_per_s\":110.0,\"wan_bytes_sent\":3000}\n"
        "{\"time\":1001.2,\"site\":\"alpha\",\"rank\":1,\"step\":20,\"loss\":4.5,\"tokens_per_s\":60.0,\"wan_bytes_sent\":0}\n"
        "{\"time\":1001.5,\"site\":\"alpha\",\"rank\":0,\"step\":20,"
        "\"eval\":{\"de\":{\"accuracy\":0.5,\"mrr\":0.75},\"sentences\":64,\"greedy\":true,\"name\":\"x\"}}\n"
        // resumed from step 10: rank 0's step 20 again, which replaces the first
        "{\"time\":1002.0,\"site\":\"alpha\",\"rank\":0,\"step\":20,\"loss\":3.5,\"tokens_per_s\":120.0,\"wan_bytes_sent\":3500}\n"
        "{\"time\":1001.0,\"site\":\"beta\",\"rank\":0,\"step\":10,\"loss\":5.5,\"tokens_per_s\":90.0,\"wan_bytes_sent\":2000}\n"
        "{\"time\":1003.0,\"site\":\"../escape\",\"rank\":0,\"step\":10,\"loss\":1.0}\n");
  // Another run directory of the same name: tensorboard/sync-2.
  write(dir.file("b/sync/metrics.jsonl"), "{\"time\":2000.0,\"site\":\"alpha\",\"rank\":0,\"step\":5,\"loss\":7.0}\n");
  write(dir.file("out/tensorboard/sync/alpha/events.out.tfevents.1.stale"), "an earlier report's");
  for (int report = 0; report < 2; ++report) {  // a report replaces an earlier one's event files
    const auto r = write_report({dir.file("a/sync"), dir.file("b/sync")}, dir.file("out"));
    ASSERT_EQ(r.event_files.size(), 3u);
    EXPECT_EQ(r.files.back(), dir.file("out/index.html"));
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("out/tensorboard/escape")));  // not a site name: skipped

  using Points = std::vector<std::tuple<int64_t, float, double>>;
  const Curves alpha = read_curves(dir.file("out/tensorboard/sync/alpha"));
  EXPECT_EQ(alpha.size(), 6u);  // train/loss, train/tokens_per_s, wan/bytes_sent, 3 numbers of eval
  EXPECT_EQ(alpha.at("train/loss"), (Points{{10, 5.5f, 1000.5}, {20, 4.0f, 1002.0}}));  // (5+6)/2, (3.5+4.5)/2
  EXPECT_EQ(alpha.at("train/tokens_per_s"), (Points{{10, 150.0f, 1000.5}, {20, 180.0f, 1002.0}}));
  EXPECT_EQ(alpha.at("wan/bytes_sent"), (Points{{10, 1000.0f, 1000.5}, {20, 3500.0f, 1002.0}}));
  EXPECT_EQ(alpha.at("eval/de/accuracy"), (Points{{20, 0.5f, 1001.5}}));
  EXPECT_EQ(alpha.at("eval/de/mrr"), (Points{{20, 0.75f, 1001.5}}));
  EXPECT_EQ(alpha.at("eval/sentences"), (Points{{20, 64.0f, 1001.5}}));
  const Curves beta = read_curves(dir.file("out/tensorboard/sync/beta"));
  EXPECT_EQ(beta.at("train/loss"), (Points{{10, 5.5f, 1001.0}}));
  EXPECT_EQ(beta.at("wan/bytes_sent"), (Points{{10, 2000.0f, 1001.0}}));
  EXPECT_EQ(read_curves(dir.file("out/tensorboard/sync-2/alpha")).at("train/loss"), (Points{{5, 7.0f, 2000.0}}));

  std::ifstream page(dir.file("out/index.html"));
  const std::string html((std::istreambuf_iterator<char>(page)), std::istreambuf_iterator<char>());
  EXPECT_NE(html.find("tensorboard --logdir " + dir.file("out") + "/tensorboard"), std::string::npos);
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
}  // namespace nebula::app
