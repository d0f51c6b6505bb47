#include "model/script_model.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <fstream>
#include <set>

#include "model/testing.h"
#include "nebula/error.h"
#include "util/temp_dir.h"

namespace nebula::model {
namespace {

using testing::error_of;

// A TorchScript module built in C++ (as torch.jit.script would from Python): a child "lin"
// (weight [2, 3], bias [2]), a buffer "scale", and the given methods. Saved to `path`.
std::string make_module(const std::string& path, const std::string& source) {
  torch::jit::Module lin("Lin");
  lin.register_parameter("weight", at::randn({2, 3}).set_requires_grad(true), /*is_buffer=*/false);
  lin.register_parameter("bias", at::zeros({2}).set_requires_grad(true), /*is_buffer=*/false);
  lin.define(R"(
def forward(self, x: Tensor) -> Tensor:
    return torch.matmul(x, self.weight.t()) + self.bias
)");
  torch::jit::Module m("Model");
  m.register_module("lin", lin);
  m.register_buffer("scale", at::full({1}, 1.0));
  m.define(source);
  m.save(path);
  return path;
}

const char* kRegression = R"(
def forward(self, x: Tensor, y: Tensor) -> Tensor:
    return torch.mean((self.lin.forward(x) * self.scale - y) ** 2)
)";
const char* kLogits = R"(
def forward(self, x: Tensor) -> Tensor:
    return self.lin.forward(x) * self.scale
)";

TEST(ScriptModel, MirrorHasTheModulesNamesAndSharesItsTensors) {
  nebula::testing::TempDir dir("script");
  ScriptModel m = ScriptModel::load(make_module(dir.file("m.pt"), kRegression));
  std::set<std::string> params, buffers;
  for (const auto& p : m.module().named_parameters()) {
    params.insert(p.key());
    EXPECT_EQ(p.value().data_ptr(), m.script().attr("lin").toModule().attr(p.key().substr(4)).toTensor().data_ptr())
        << p.key();
  }
  for (const auto& b : m.module().named_buffers()) buffers.insert(b.key());
  EXPECT_EQ(params, (std::set<std::string>{"lin.weight", "lin.bias"}));
  EXPECT_EQ(buffers, (std::set<std::string>{"scale"}));
  EXPECT_EQ(m.trainable().size(), 2u);
  EXPECT_EQ(m.module().named_buffers()["scale"].data_ptr(), m.script().attr("scale").toTensor().data_ptr());
}

TEST(ScriptModel, TrainingTheMirrorsParametersTrainsTheModuleAndSaveKeepsTheWeights) {
  nebula::testing::TempDir dir("script");
  at::manual_seed(3);
  ScriptModel m = ScriptModel::load(make_module(dir.file("m.pt"), kRegression));
  const at::Tensor w_true = at::randn({2, 3});
  const at::Tensor x = at::randn({64, 3}), y = at::matmul(x, w_true.t());
  std::vector<at::Tensor> params;
  for (const auto& p : m.module().parameters()) params.push_back(p);  // the mirror's, as the worker's optimizer gets them
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(0.05).weight_decay(0));
  const double first = m.loss({x}, y, "output").item<double>();
  for (int i = 0; i < 200; ++i) {
    opt.zero_grad();
    m.loss({x}, y, "output").backward();
    opt.step();
  }
  const double last = m.loss({x}, y, "output").item<double>();
  EXPECT_LT(last, first * 0.01) << first << " -> " << last;

  m.save(dir.file("trained.pt"));
  ScriptModel back = ScriptModel::load(dir.file("trained.pt"));
  EXPECT_TRUE(at::equal(back.module().named_parameters()["lin.weight"], m.module().named_parameters()["lin.weight"]));
  EXPECT_DOUBLE_EQ(back.loss({x}, y, "output").item<double>(), last);
  EXPECT_FALSE(std::filesystem::exists(dir.file("trained.pt.tmp-" + std::to_string(::getpid()))));
}

TEST(ScriptModel, EachLossKindGivesTheLossAndItsWeight) {
  nebula::testing::TempDir dir("script");
  const at::Tensor x = at::randn({5, 3});
  {  // "output": a tuple whose first element is the loss, or a dict with "loss"
    ScriptModel tuple = ScriptModel::load(make_module(dir.file("t.pt"), R"(
def forward(self, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
    out = self.lin.forward(x)
    return torch.mean((out - y) ** 2), out
)"));
    const at::Tensor y = at::randn({5, 2});
    EXPECT_NEAR(tuple.loss({x}, y, "output").item<double>(),
                at::mse_loss(tuple.script().attr("lin").toModule().forward({x}).toTensor(), y).item<double>(), 1e-6);
    ScriptModel dict = ScriptModel::load(make_module(dir.file("d.pt"), R"(
def forward(self, x: Tensor, y: Tensor) -> Dict[str, Tensor]:
    return {"logits": self.lin.forward(x), "loss": torch.sum(self.lin.forward(x) - y)}
)"));
    EXPECT_NEAR(dict.loss({x}, y, "output").item<double>(), (dict.script().attr("lin").toModule().forward({x}).toTensor() - y).sum().item<double>(), 1e-5);
    EXPECT_EQ(ScriptModel::weight(y, "output"), 5);
  }
  ScriptModel logits = ScriptModel::load(make_module(dir.file("l.pt"), kLogits));
  const at::Tensor out = logits.script().forward({x}).toTensor();
  {  // "cross_entropy": -100 has no loss and no weight
    const at::Tensor y = at::tensor({0, 1, -100, 1, 0}, at::kLong);
    const at::Tensor keep = at::tensor({0, 1, 3, 4}, at::kLong);
    EXPECT_NEAR(logits.loss({x}, y, "cross_entropy").item<double>(),
                at::cross_entropy_loss(out.index_select(0, keep), y.index_select(0, keep)).item<double>(), 1e-6);
    EXPECT_EQ(ScriptModel::weight(y, "cross_entropy"), 4);
  }
  {  // "mse"
    const at::Tensor y = at::randn({5, 2});
    EXPECT_NEAR(logits.loss({x}, y, "mse").item<double>(), at::mse_loss(out, y).item<double>(), 1e-6);
  }
}

// Several inputs are forward's arguments in order (e.g. ids and a mask), targets last.
TEST(ScriptModel, SeveralInputsAreForwardsArgumentsInOrder) {
  nebula::testing::TempDir dir("script");
  ScriptModel m = ScriptModel::load(make_module(dir.file("two.pt"), R"(
def forward(self, x: Tensor, mask: Tensor, y: Tensor) -> Tensor:
    return torch.mean(((self.lin.forward(x) - y) ** 2) * mask)
)"));
  const at::Tensor x = at::randn({6, 3}), y = at::randn({6, 2});
  const at::Tensor mask = at::tensor({1.0f, 0.0f}).repeat({6, 1});
  const at::Tensor out = m.script().attr("lin").toModule().forward({x}).toTensor();
  EXPECT_NEAR(m.loss({x, mask}, y, "output").item<double>(), (((out - y) * (out - y)) * mask).mean().item<double>(), 1e-6);
  const std::string e = error_of([&] { m.loss({x}, y, "output"); });  // one input short
  EXPECT_NE(e.find("two.pt: forward(inputs [6, 3], targets [6, 2]) failed"), std::string::npos) << e;
}

TEST(ScriptModel, BadFilesAndBadOutputsAreDataErrorsNamingTheFile) {
  nebula::testing::TempDir dir("script");
  EXPECT_NE(error_of([&] { ScriptModel::load(dir.file("missing.pt")); }).find("missing.pt: no such file"),
            std::string::npos);
  std::ofstream(dir.file("junk.pt")) << "not a zip archive";
  EXPECT_NE(error_of([&] { ScriptModel::load(dir.file("junk.pt")); }).find("junk.pt: not a TorchScript module"),
            std::string::npos);

  ScriptModel logits = ScriptModel::load(make_module(dir.file("l.pt"), kLogits));
  const at::Tensor x = at::randn({4, 3});
  // "output" needs forward(inputs, targets) returning a scalar
  std::string e = error_of([&] { logits.loss({x}, at::zeros({4}, at::kLong), "output"); });
  EXPECT_NE(e.find("l.pt: forward(inputs [4, 3], targets [4]) failed"), std::string::npos) << e;
  ScriptModel vector_out = ScriptModel::load(make_module(dir.file("v.pt"), R"(
def forward(self, x: Tensor, y: Tensor) -> Tensor:
    return self.lin.forward(x)
)"));
  e = error_of([&] { vector_out.loss({x}, at::zeros({4}, at::kLong), "output"); });
  EXPECT_NE(e.find("returned Tensor [4, 2], not a scalar loss"), std::string::npos) << e;
  e = error_of([&] { logits.loss({x}, at::zeros({4}), "cross_entropy"); });  // float class ids
  EXPECT_NE(e.find("integer targets"), std::string::npos) << e;
  e = error_of([&] { logits.loss({x}, at::zeros({4, 3}), "mse"); });
  EXPECT_NE(e.find("returned [4, 2]: model.loss = \"mse\" needs the targets' shape"), std::string::npos) << e;
}

}  // namespace
}  // namespace nebula::model
