// [6/7] hostile input: a disk that fills up while a checkpoint is written. The full disk is
// simulated with RLIMIT_FSIZE (writes past the limit fail with EFBIG once SIGXFSZ is ignored),
// which needs no privileges or mounts; the limit is per file, so the earlier, small checkpoint
// was written before it and the large one is refused.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <string>

#include "nebula/error.h"
#include "parallel/checkpoint.h"
#include "util/temp_dir.h"

namespace nebula::parallel {
namespace {
namespace fs = std::filesystem;

// Lowers the soft RLIMIT_FSIZE to `bytes` and ignores SIGXFSZ for the lifetime of the object;
// both are restored after (the soft limit may go back up to the hard one unprivileged).
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    EXPECT_EQ(::getrlimit(RLIMIT_FSIZE, &saved_), 0);
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit lowered = saved_;
    lowered.rlim_cur = bytes;
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &lowered), 0);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    std::signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit saved_{};
  void (*old_handler_)(int) = nullptr;
};

Checkpoint small(int64_t step) {
  Checkpoint c;
  c.step = step;
  c.tensors["model.w"] = at::full({4, 4}, static_cast<float>(step));
  c.state = {{"data_cursor", step * 16}};
  return c;
}

// Tensors of about 1 MiB: the tensors file cannot be written under a 64 KiB limit.
Checkpoint large_tensors(int64_t step) {
  Checkpoint c = small(step);
  c.tensors["model.big"] = at::full({256, 1024}, 1.5f);
  return c;
}

// Small tensors but a state of about 1 MiB: the tensors file fits, the manifest does not.
Checkpoint large_state(int64_t step) {
  Checkpoint c = small(step);
  c.state["rng"] = std::string(1 << 20, 'x');
  return c;
}

// The earlier checkpoint is the newest intact one, and nothing of the failed one is left.
void expect_only_step_10(const std::string& dir, int64_t failed_step) {
  auto loaded = load_latest_checkpoint(dir, "h");
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 10);
  EXPECT_TRUE(at::equal(loaded->tensors.at("model.w"), at::full({4, 4}, 10.0f)));
  EXPECT_EQ(loaded->state["data_cursor"], 160);
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(std::to_string(failed_step)), std::string::npos)
        << "left behind by the failed save: " << e.path();
}

TEST(CheckpointDisk, FullDiskWhileWritingTensorsIsADataErrorAndKeepsTheEarlierCheckpoint) {
  nebula::testing::TempDir dir("ckpt_full");
  save_checkpoint(dir.path(), small(10), "h");
  {
    FileSizeLimit limit(64 << 10);
    try {
      save_checkpoint(dir.path(), large_tensors(20), "h");
      ADD_FAILURE() << "no DataError with a 64 KiB file size limit";
    } catch (const DataError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(dir.path()), std::string::npos) << msg;
      EXPECT_NE(msg.find("step-000000000020"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::strerror(EFBIG)), std::string::npos) << msg;
    }
  }
  expect_only_step_10(dir.path(), 20);
  // Once there is room again, the next save works and becomes the newest.
  save_checkpoint(dir.path(), large_tensors(30), "h");
  EXPECT_EQ(load_latest_checkpoint(dir.path(), "h")->step, 30);
}

TEST(CheckpointDisk, FullDiskWhileWritingTheManifestIsADataErrorAndKeepsTheEarlierCheckpoint) {
  nebula::testing::TempDir dir("ckpt_full");
  save_checkpoint(dir.path(), small(10), "h");
  {
    FileSizeLimit limit(64 << 10);
    try {
      save_checkpoint(dir.path(), large_state(20), "h", /*keep=*/1);
      ADD_FAILURE() << "no DataError with a 64 KiB file size limit";
    } catch (const DataError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(dir.path()), std::string::npos) << msg;
      EXPECT_NE(msg.find("step-000000000020"), std::string::npos) << msg;
      EXPECT_NE(msg.find("manifest.json"), std::string::npos) << msg;
    }
  }
  // keep = 1 must not have pruned step 10 for a checkpoint that was never completed.
  expect_only_step_10(dir.path(), 20);
}

}  // namespace
}  // namespace nebula::parallel
