#include "eval/tensorboard.h"

#include <unistd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "nebula/error.h"
#include "util/temp_dir.h"

namespace nebula::eval {
namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::string le(uint64_t v, int bytes) {
  std::string out;
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((v >> (8 * i)) & 0xFF);
  return out;
}

// The TFRecord framing of `data`, from the format's definition.
std::string record(const std::string& data) {
  const std::string length = le(data.size(), 8);
  return length + le(masked_crc32c(length), 4) + data + le(masked_crc32c(data), 4);
}

std::string hostname() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}

TEST(TensorBoard, Crc32cMatchesPublishedCheckValues) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);  // the CRC catalogue's "check" value for CRC-32C
  EXPECT_EQ(crc32c(""), 0u);
  // RFC 3720 (iSCSI), appendix B.4.
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xFF')), 0x62A8AB43u);
  std::string ascending;
  for (int i = 0; i < 32; ++i) ascending += static_cast<char>(i);
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
}

TEST(TensorBoard, MaskedCrcRotatesRightBy15AndAddsTheConstant) {
  // crc        = 0xE3069283 = 1110 0011 0000 0110 1001 0010 1000 0011
  // crc >> 15  = the top 17 bits              = 0x0001C60D
  // crc << 17  = the low 15 bits (0x1283) << 17 = 0x25060000
  // rotated    = 0x2507C60D;  + 0xA282EAD8      = 0xC78AB0E5 (no carry out)
  EXPECT_EQ(masked_crc32c("123456789"), 0xC78AB0E5u);
}

// The bytes of a file with one scalar, derived by hand from the protobuf encoding rules: a key
// is (field number << 3 | wire type) as a varint; doubles and floats are little-endian IEEE 754.
TEST(TensorBoard, GoldenBytesOfTheVersionEventAndOneScalar) {
  nebula::testing::TempDir dir("tensorboard");
  {
    TensorBoardWriter w(dir.path(), 1.5);
    EXPECT_EQ(w.path(), dir.file("events.out.tfevents.1." + hostname()));
    w.add_scalar("loss", 300, 0.25f, 2.0);
    w.flush();
  }
  const std::string version_event(
      "\x09"                              // Event.wall_time: field 1, wire type 1 (64-bit) → 1<<3|1
      "\x00\x00\x00\x00\x00\x00\xF8\x3F"  // 1.5 = 0x3FF8000000000000, little-endian
      "\x1A"                              // Event.file_version: field 3, wire type 2 (length-delimited) → 3<<3|2
      "\x0D"                              // 13 bytes
      "brain.Event:2",
      24);
  const std::string scalar_event(
      "\x09"                              // Event.wall_time, as above
      "\x00\x00\x00\x00\x00\x00\x00\x40"  // 2.0 = 0x4000000000000000
      "\x10"                              // Event.step: field 2, wire type 0 (varint) → 2<<3|0
      "\xAC\x02"                          // 300 = 0b10_0101100: low 7 bits 0x2C | 0x80 (more follow), then 2
      "\x2A"                              // Event.summary: field 5, wire type 2 → 5<<3|2
      "\x0D"                              // 13 bytes of Summary:
      "\x0A"                              //   Summary.value: field 1, wire type 2
      "\x0B"                              //   11 bytes of Summary.Value:
      "\x0A"                              //     Value.tag: field 1, wire type 2
      "\x04"                              //     4 bytes
      "loss"                              //
      "\x15"                              //     Value.simple_value: field 2, wire type 5 (32-bit) → 2<<3|5
      "\x00\x00\x80\x3E",                 //     0.25f = 0x3E800000
      27);
  const std::string file = slurp(dir.file("events.out.tfevents.1." + hostname()));
  EXPECT_EQ(file, record(version_event) + record(scalar_event));
  // The framing of the first record: its length 24 = 0x18, little-endian in 8 bytes.
  EXPECT_EQ(file.substr(0, 8), std::string("\x18\x00\x00\x00\x00\x00\x00\x00", 8));
}

TEST(TensorBoard, ScalarsRoundTripInFileOrder) {
  nebula::testing::TempDir dir("tensorboard");
  const std::vector<TensorBoardScalar> want = {
      {"train/loss", 0, 6.5f, 1000.25},
      {"train/loss", 1, 6.25f, 1001.5},
      {"train/tokens_per_s", 127, 12345.5f, 1002},
      {"wan/bytes_sent", 128, 3.0e9f, 1003},
      {"eval/de/accuracy", int64_t{1} << 40, -0.125f, 1004},
      {"negative/step", -1, 1e-30f, 1005},  // protobuf int64: two's complement, a 10-byte varint
      {"negative/step", std::numeric_limits<int64_t>::min(), 0, 1006},
      {"ünïcode tag", 7, std::numeric_limits<float>::infinity(), 1007},
  };
  std::string path;
  {
    TensorBoardWriter w(dir.file("a/b"));  // created, with its parent
    path = w.path();
    EXPECT_EQ(std::filesystem::path(path).parent_path(), std::filesystem::path(dir.file("a/b")));
    EXPECT_EQ(std::filesystem::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u) << path;
    for (const auto& s : want) w.add_scalar(s.tag, s.step, s.value, s.wall_time);
    w.add_scalar("nan", 8, std::nanf(""), 1008);
    w.flush();
    EXPECT_EQ(read_tensorboard_scalars(path).size(), want.size() + 1);  // flushed: readable while open
  }
  const auto got = read_tensorboard_scalars(path);
  ASSERT_EQ(got.size(), want.size() + 1);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].tag, want[i].tag) << i;
    EXPECT_EQ(got[i].step, want[i].step) << i;
    EXPECT_EQ(got[i].value, want[i].value) << i;
    EXPECT_EQ(got[i].wall_time, want[i].wall_time) << i;
  }
  EXPECT_EQ(got.back().tag, "nan");
  EXPECT_TRUE(std::isnan(got.back().value));
}

TEST(TensorBoard, EveryCorruptedOrTruncatedRecordIsADataError) {
  nebula::testing::TempDir dir("tensorboard");
  std::string path;
  {
    TensorBoardWriter w(dir.path(), 10);
    path = w.path();
    w.add_scalar("train/loss", 1, 2.5f, 11);
    w.add_scalar("train/loss", 2, 2.25f, 12);
  }
  const std::string good = slurp(path);
  ASSERT_EQ(read_tensorboard_scalars(path).size(), 2u);
  // A CRC-32C detects every error burst of up to 32 bits, so any one damaged byte, in a length,
  // a CRC or the data, fails a check.
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] ^= 0x5A;
    spit(path, bad);
    EXPECT_THROW(read_tensorboard_scalars(path), DataError) << "byte " << i;
  }
  // Cut inside the last record (a cut between records leaves a shorter valid file).
  for (size_t cut : {good.size() - 1, good.size() - 4, good.size() - 10, good.size() - 30}) {
    spit(path, good.substr(0, cut));
    EXPECT_THROW(read_tensorboard_scalars(path), DataError) << "cut at " << cut;
  }
  spit(path, "");
  EXPECT_THROW(read_tensorboard_scalars(path), DataError);
  try {
    std::string bad = good;
    bad[good.size() - 8] ^= 1;  // inside the last scalar's data
    spit(path, bad);
    read_tensorboard_scalars(path);
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("CRC"), std::string::npos) << e.what();
  }
}

TEST(TensorBoard, ARecordWithoutAFileVersionFirstIsADataError) {
  nebula::testing::TempDir dir("tensorboard");
  // Framing and CRCs fine, but the one event holds only a wall_time.
  spit(dir.file("events.out.tfevents.0.x"), record(std::string("\x09\x00\x00\x00\x00\x00\x00\xF8\x3F", 9)));
  EXPECT_THROW(read_tensorboard_scalars(dir.file("events.out.tfevents.0.x")), DataError);
}

TEST(TensorBoard, AnUncreatableDirectoryIsADataErrorNamingIt) {
  nebula::testing::TempDir dir("tensorboard");
  spit(dir.file("file"), "not a directory");
  try {
    TensorBoardWriter w(dir.file("file/runs"));
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("file/runs")), std::string::npos) << e.what();
  }
}

TEST(TensorBoard, AScalarNeedsATag) {
  nebula::testing::TempDir dir("tensorboard");
  TensorBoardWriter w(dir.path());
  EXPECT_THROW(w.add_scalar("", 0, 1, 0), Error);
}

}  // namespace
}  // namespace nebula::eval
