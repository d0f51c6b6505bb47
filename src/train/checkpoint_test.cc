#include "train/checkpoint.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "nebula/error.h"
#include "util/temp_dir.h"

namespace nebula::train {
namespace {
namespace fs = std::filesystem;

Checkpoint make(int64_t step) {
  Checkpoint c;
  c.step = step;
  c.tensors["model.w"] = at::full({3, 4}, static_cast<float>(step));
  c.tensors["optimizer.step"] = at::tensor({step});
  c.state = {{"outer_step", step / 10}, {"data_cursor", step * 16}};
  return c;
}

void flip_byte(const std::string& path, size_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char b = 0;
  f.read(&b, 1);
  f.seekp(static_cast<std::streamoff>(at));
  b = static_cast<char>(b ^ 0x5a);
  f.write(&b, 1);
}

TEST(Checkpoint, RoundTripsAndKeepsTheNewestTwo) {
  nebula::testing::TempDir dir("ckpt");
  EXPECT_FALSE(load_latest_checkpoint(dir.path(), "h").has_value());
  for (int64_t step : {10, 20, 30}) save_checkpoint(dir.path(), make(step), "h", 2);
  auto c = load_latest_checkpoint(dir.path(), "h");
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->step, 30);
  EXPECT_TRUE(at::equal(c->tensors.at("model.w"), at::full({3, 4}, 30.0f)));
  EXPECT_EQ(c->tensors.at("optimizer.step").item<int64_t>(), 30);
  EXPECT_EQ(c->state["data_cursor"], 480);
  EXPECT_FALSE(fs::exists(dir.file("step-000000000010")));  // pruned
  EXPECT_TRUE(fs::exists(dir.file("step-000000000020/manifest.json")));
}

// A damaged newest checkpoint (a flipped byte, a truncated file, a torn manifest) is reported
// and the one before it loads; a crash's *.tmp directory is ignored.
TEST(Checkpoint, DamagedNewestFallsBackToThePreviousOne) {
  nebula::testing::TempDir dir("ckpt");
  save_checkpoint(dir.path(), make(10), "h");
  save_checkpoint(dir.path(), make(20), "h");
  const std::string newest = dir.file("step-000000000020/tensors.safetensors");
  flip_byte(newest, fs::file_size(newest) - 3);
  auto c = load_latest_checkpoint(dir.path(), "h");
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->step, 10);

  save_checkpoint(dir.path(), make(30), "h", 3);
  fs::resize_file(dir.file("step-000000000030/manifest.json"), 20);
  EXPECT_EQ(load_latest_checkpoint(dir.path(), "h")->step, 10);

  save_checkpoint(dir.path(), make(35), "h", 4);  // a manifest whose fields have the wrong types
  std::ofstream(dir.file("step-000000000035/manifest.json"))
      << R"({"format": "nebula-checkpoint", "step": "x", "config_hash": "h", "files": {"a": 7}})";
  EXPECT_EQ(load_latest_checkpoint(dir.path(), "h")->step, 10);

  fs::create_directory(dir.file("step-000000000040.tmp"));  // killed while writing
  std::ofstream(dir.file("step-000000000040.tmp/tensors.safetensors")) << "partial";
  EXPECT_EQ(load_latest_checkpoint(dir.path(), "h")->step, 10);
}

TEST(Checkpoint, AnotherConfigIsAConfigErrorNamingBothHashes) {
  nebula::testing::TempDir dir("ckpt");
  save_checkpoint(dir.path(), make(10), "aaaa");
  try {
    load_latest_checkpoint(dir.path(), "bbbb");
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("aaaa"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bbbb"), std::string::npos) << e.what();
  }
}

// A checkpoint directory that cannot be made is a DataError naming it (not a crash), and the
// checkpoints written elsewhere are untouched.
TEST(Checkpoint, UnwritableDirectoryIsADataErrorNamingIt) {
  nebula::testing::TempDir dir("ckpt");
  save_checkpoint(dir.file("good"), make(10), "h");
  std::ofstream(dir.file("file")) << "not a directory";
  try {
    save_checkpoint(dir.file("file/checkpoints"), make(20), "h");
    ADD_FAILURE() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("file/checkpoints"), std::string::npos) << e.what();
  }
  EXPECT_EQ(load_latest_checkpoint(dir.file("good"), "h")->step, 10);
}

}  // namespace
}  // namespace nebula::train
