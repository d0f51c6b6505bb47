#include "nebula/units.h"

#include <gtest/gtest.h>

#include "nebula/error.h"

namespace nebula {
namespace {

TEST(Units, Sizes) {
  EXPECT_EQ(parse_size("1GiB"), 1073741824u);
  EXPECT_EQ(parse_size("1.5 KiB"), 1536u);
  EXPECT_EQ(parse_size("2MB"), 2000000u);
  EXPECT_EQ(parse_size("0"), 0u);
  EXPECT_EQ(parse_size("17B"), 17u);
}

TEST(Units, Rates) {
  EXPECT_DOUBLE_EQ(parse_rate_bits("50Mbit"), 50e6);
  EXPECT_DOUBLE_EQ(parse_rate_bits("50 Mbit/s"), 50e6);
  EXPECT_DOUBLE_EQ(parse_rate_bits("1Gbps"), 1e9);
  EXPECT_DOUBLE_EQ(parse_rate_bits("10MB/s"), 80e6);
  EXPECT_DOUBLE_EQ(parse_rate_bits("0"), 0);
}

TEST(Units, Durations) {
  EXPECT_EQ(parse_duration("80ms"), std::chrono::milliseconds(80));
  EXPECT_EQ(parse_duration("1.5s"), std::chrono::milliseconds(1500));
  EXPECT_EQ(parse_duration("250us"), std::chrono::microseconds(250));
  EXPECT_EQ(parse_duration("2min"), std::chrono::minutes(2));
}

TEST(Units, BadInputNamesTextAndForms) {
  for (const char* bad : {"50", "fast", "50 Mbits", "-3ms", "ms", "1.2.3s", ""}) {
    try {
      parse_duration(bad);
      ADD_FAILURE() << "accepted \"" << bad << "\"";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("\"") + bad + "\""), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(parse_size("1 GiBB"), ConfigError);
  EXPECT_THROW(parse_rate_bits("50Mb"), ConfigError);  // ambiguous: megabit or megabyte?
}

TEST(Units, Format) {
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_rate_bits(50e6), "50.0 Mbit/s");
  EXPECT_EQ(format_duration(std::chrono::milliseconds(80)), "80.0 ms");
}

}  // namespace
}  // namespace nebula
