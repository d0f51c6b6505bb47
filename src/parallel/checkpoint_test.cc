#include "parallel/checkpoint.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "nebula/error.h"
#include "parallel/optimizer_state.h"
#include "util/temp_dir.h"

namespace nebula::parallel {
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

// AdamW's moments and step counts and LibTorch's generator survive a checkpoint: a restored
// optimizer takes the same next steps as the original, with dropout-like draws alike.
TEST(Checkpoint, OptimizerAndGeneratorStateContinueExactly) {
  at::manual_seed(3);
  auto make_params = [] { return std::vector<at::Tensor>{at::randn({4, 3}).requires_grad_(), at::randn({5}).requires_grad_()}; };
  std::vector<at::Tensor> a = make_params();
  torch::optim::AdamW opt_a(a, torch::optim::AdamWOptions(0.05).weight_decay(0.1));
  auto step = [](torch::optim::AdamW& opt, std::vector<at::Tensor>& p, int i) {
    opt.zero_grad();
    at::Tensor loss = (p[0] * (i + 1)).pow(2).sum() + p[1].sin().sum() * i;
    loss.backward();
    opt.step();
  };
  for (int i = 0; i < 5; ++i) step(opt_a, a, i);

  nebula::testing::TempDir dir("ckpt");
  Checkpoint k;
  k.step = 5;
  for (size_t i = 0; i < a.size(); ++i) k.tensors["model/" + std::to_string(i)] = a[i].detach();
  save_optimizer(opt_a, a, k);
  save_torch_rng(k);
  save_checkpoint(dir.path(), k, "h");
  const at::Tensor draw_a = at::rand({6});

  auto loaded = load_latest_checkpoint(dir.path(), "h");
  ASSERT_TRUE(loaded.has_value());
  std::vector<at::Tensor> b;
  for (size_t i = 0; i < a.size(); ++i) b.push_back(loaded->tensors.at("model/" + std::to_string(i)).clone().requires_grad_());
  torch::optim::AdamW opt_b(b, torch::optim::AdamWOptions(0.05).weight_decay(0.1));
  load_optimizer(opt_b, b, *loaded);
  load_torch_rng(*loaded);
  EXPECT_TRUE(at::equal(at::rand({6}), draw_a));
  for (int i = 5; i < 9; ++i) {
    step(opt_a, a, i);
    step(opt_b, b, i);
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << i;

  // Without the restored moments the steps differ (the test would notice a lost state).
  std::vector<at::Tensor> c;
  for (size_t i = 0; i < a.size(); ++i) c.push_back(loaded->tensors.at("model/" + std::to_string(i)).clone().requires_grad_());
  torch::optim::AdamW opt_c(c, torch::optim::AdamWOptions(0.05).weight_decay(0.1));
  for (int i = 5; i < 9; ++i) step(opt_c, c, i);
  EXPECT_FALSE(at::equal(a[0], c[0]));

  // A checkpoint of another model is refused, naming what does not fit.
  std::vector<at::Tensor> wrong{at::zeros({2, 2}).requires_grad_(), at::zeros({5}).requires_grad_()};
  torch::optim::AdamW opt_w(wrong, torch::optim::AdamWOptions(0.05));
  try {
    load_optimizer(opt_w, wrong, *loaded);
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("optim/0/exp_avg"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace nebula::parallel
