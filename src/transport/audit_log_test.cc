#include "transport/audit_log.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "nebula/error.h"
#include "util/temp_dir.h"

namespace nebula::transport {
namespace {

namespace fs = std::filesystem;

// A temp dir named after this test file, removed afterwards.
struct ScopedDir : nebula::testing::TempDir {
  ScopedDir() : TempDir("audit_test") {}
};

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(AuditLogTest, OneJsonLinePerRecordWithAllFields) {
  ScopedDir dir;
  const std::string path = dir.path() + "/audit.jsonl";
  {
    AuditLog log(path);
    EXPECT_TRUE(log.enabled());
    log.record({"alpha", "beta", "127.0.0.1:4242", "ab12", "accepted", ""});
    log.record({"alpha", "", "10.0.0.9:555", "", "refused", "peer sent no certificate"});
  }
  {
    AuditLog again(path);  // appends, never truncates
    again.record({"alpha", "gamma\xff", "[::1]:1", "cd34", "failed", "handshake timed out"});
  }
  auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 3u);
  std::vector<nlohmann::json> js;
  for (const auto& l : lines) js.push_back(nlohmann::json::parse(l));
  for (const auto& j : js) {
    for (const char* key : {"time", "utc", "local_site", "peer_site", "address", "fingerprint", "outcome", "reason"})
      EXPECT_TRUE(j.contains(key)) << key << " missing in " << j.dump();
    EXPECT_TRUE(j["time"].is_number_float());
    EXPECT_GT(j["time"].get<double>(), 1.6e9);
    const std::string utc = j["utc"];
    EXPECT_EQ(utc.size(), 24u) << utc;  // 2024-05-01T12:51:30.123Z
    EXPECT_EQ(utc[10], 'T');
    EXPECT_EQ(utc.back(), 'Z');
  }
  EXPECT_EQ(js[0]["peer_site"], "beta");
  EXPECT_EQ(js[0]["outcome"], "accepted");
  EXPECT_EQ(js[1]["reason"], "peer sent no certificate");
  EXPECT_EQ(js[1]["address"], "10.0.0.9:555");
  EXPECT_EQ(js[2]["outcome"], "failed");
  EXPECT_EQ(js[2]["peer_site"], "gamma\xEF\xBF\xBD");  // invalid UTF-8 replaced, not an exception
}

TEST(AuditLogTest, ConcurrentWritersNeverInterleave) {
  ScopedDir dir;
  const std::string path = dir.path() + "/audit.jsonl";
  constexpr int kThreads = 2, kRecords = 500;
  {
    AuditLog log(path);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&log, t] {
        for (int i = 0; i < kRecords; ++i)
          log.record({"alpha", "site-" + std::to_string(t), "127.0.0.1:" + std::to_string(i),
                      std::string(64, static_cast<char>('a' + t)), "accepted", std::string(200, 'x')});
      });
    }
    for (auto& th : threads) th.join();
  }
  auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), static_cast<size_t>(kThreads * kRecords));
  std::set<std::pair<std::string, std::string>> seen;
  for (const auto& l : lines) {
    auto j = nlohmann::json::parse(l);  // throws on a torn line
    seen.insert({j["peer_site"].get<std::string>(), j["address"].get<std::string>()});
    EXPECT_EQ(j["fingerprint"].get<std::string>().size(), 64u);
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(kThreads * kRecords));
}

TEST(AuditLogTest, EmptyPathRecordsNothing) {
  AuditLog log("");
  EXPECT_FALSE(log.enabled());
  log.record({"alpha", "beta", "x", "y", "accepted", ""});  // no file, no error
}

TEST(AuditLogTest, ErrorsNameThePath) {
  ScopedDir dir;
  const std::string path = dir.path() + "/no/such/dir/audit.jsonl";
  try {
    AuditLog log(path);
    FAIL() << "expected nebula::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  AuditLog log(dir.path() + "/a.jsonl");
  EXPECT_THROW(log.record({"alpha", "beta", "x", "y", "maybe", ""}), Error);
}

}  // namespace
}  // namespace nebula::transport
