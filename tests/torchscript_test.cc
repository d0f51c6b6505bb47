// [7/7] Bring your own model: a TorchScript module written and exported by a Python script
// (examples/torchscript/export.py, with Debian's python3-torch) trains on two sites with
// nebula; the module nebula writes back loads in Python and gives the outputs C++ gives.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/import.h>

#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "e2e_util.h"
#include "model/safetensors.h"

namespace {

using namespace nebula::e2e;

// Debian's interpreter, which python3-torch installs into (another python3 may come first in
// PATH); $NEBULA_TEST_PYTHON names another (bench/gpu_check.sh: the one with pip's torch).
const std::string kPython = std::getenv("NEBULA_TEST_PYTHON") ? std::getenv("NEBULA_TEST_PYTHON") : "/usr/bin/python3";

// The module and both sites' tensors, written once by the export script.
const std::string& exported() {
  static const std::string dir = [] {
    const std::string d = temp_run_dir("torchscript-data");
    Result r = shell(kPython + " examples/torchscript/export.py " + d, 300);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return d;
  }();
  return dir;
}

std::string job_args(const std::string& run_dir, const std::string& data_dir) {
  return "run examples/torchscript/langid.toml --set job.run_dir=\\\"" + run_dir + "\\\" --set model.script=\\\"" +
         data_dir + "/model.pt\\\" --set data.path=\\\"" + data_dir + "/data\\\"";
}

// Each site's first and last logged training loss.
std::map<std::string, std::pair<double, double>> first_and_last_loss(const std::string& run_dir) {
  std::map<std::string, std::pair<double, double>> out;
  for (const auto& line : lines_of(run_dir + "/metrics.jsonl")) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    const std::string site = j["site"];
    if (!out.count(site)) out[site].first = j["loss"];
    out[site].second = j["loss"];
  }
  return out;
}

std::map<std::string, at::Tensor> parameters_of(const torch::jit::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.name] = p.value;
  return out;
}

TEST(TorchScript, AModelExportedFromPythonTrainsOnTwoSitesAndLoadsBackInPythonWithTheSameOutputs) {
  const std::string data = exported();
  const std::string dir = temp_run_dir("torchscript");
  Result r = run(job_args(dir, data) + " --set job.steps=120");
  ASSERT_EQ(r.exit_code, 0) << r.output;

  // Loss falls on both sites, from about ln 4 (four languages) to well below.
  const auto losses = first_and_last_loss(dir);
  ASSERT_EQ(losses.size(), 2u);
  for (const auto& [site, fl] : losses) EXPECT_LT(fl.second, 0.6 * fl.first) << site;
  auto summary = nlohmann::json::parse(read_file(dir + "/summary.json"));
  EXPECT_EQ(summary["model_kind"], "torchscript");
  EXPECT_LT(summary["final_val_loss"].get<double>(), 0.6 * std::log(4.0));
  EXPECT_EQ(summary["torchscript"], fs::absolute(dir + "/model.pt").string());

  // Python loads the trained module and computes the probe's logits...
  const std::string py_out = dir + "/python-logits.safetensors";
  Result check = shell(kPython + " examples/torchscript/check.py " + dir + "/model.pt " + data + "/probe.safetensors " +
                       py_out, 120);
  ASSERT_EQ(check.exit_code, 0) << check.output;
  EXPECT_NE(check.output.find("accuracy"), std::string::npos) << check.output;
  // ...and C++ gets the same from the same file.
  torch::jit::Module trained = torch::jit::load(dir + "/model.pt");
  trained.eval();
  const auto probe = nebula::model::load_safetensors(data + "/probe.safetensors");
  const at::Tensor logits = trained.get_method("predict")({probe.tensors.at("inputs")}).toTensor();
  const at::Tensor python = nebula::model::load_safetensors(py_out).tensors.at("logits");
  ASSERT_TRUE(logits.sizes().equals(python.sizes()));
  EXPECT_TRUE(at::allclose(logits, python, 1e-5, 1e-6)) << (logits - python).abs().max().item<float>();
  // Most probe sentences (catalogs neither site had) get their language right.
  EXPECT_GT(logits.argmax(1).eq(probe.tensors.at("targets")).to(at::kFloat).mean().item<float>(), 0.7);

  // model.pt holds the trained weights: those of model.safetensors, not the exported ones.
  const auto params = parameters_of(trained);
  const auto saved = nebula::model::load_safetensors(dir + "/model.safetensors");
  const auto initial = parameters_of(torch::jit::load(data + "/model.pt"));
  ASSERT_EQ(params.size(), 5u);  // embed.weight, conv.{weight,bias}, out.{weight,bias}
  for (const auto& [name, t] : params) {
    ASSERT_TRUE(saved.tensors.count(name)) << name;
    EXPECT_TRUE(at::equal(t, saved.tensors.at(name))) << name;
    EXPECT_FALSE(at::equal(t, initial.at(name))) << name;
  }
}

// Model buffers: a module with BatchNorm trains under diloco (alpha's two workers see other
// batches, beta other data). After the last step every worker of both sites holds the same
// running statistics (each one's checkpoint of that step), and model.pt carries them.
TEST(TorchScript, BatchNormStatisticsEndEqualOnEveryWorkerAndInModelPt) {
  const std::string data = temp_run_dir("torchscript-bn-data");
  Result e = shell(kPython + " examples/torchscript/export.py " + data + " --batchnorm", 300);
  ASSERT_EQ(e.exit_code, 0) << e.output;
  const std::string dir = temp_run_dir("torchscript-bn");
  Result r = run(job_args(dir, data) + " --set job.steps=50 --set checkpoint.every=50 --set strategy.heterogeneous=false");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::map<std::string, std::string>> workers;
  for (const char* w : {"alpha/rank-0", "alpha/rank-1", "beta/rank-0"})
    workers.push_back(tensor_bytes(dir + "/checkpoints/" + std::string(w) + "/step-000000000050/tensors.safetensors"));
  const torch::jit::Module trained = torch::jit::load(dir + "/model.pt");
  std::map<std::string, at::Tensor> saved;
  for (const auto& b : trained.named_buffers()) saved[b.name] = b.value;
  for (const std::string name : {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}) {
    ASSERT_TRUE(workers[0].count("model/" + name)) << name;
    for (size_t w = 1; w < workers.size(); ++w) EXPECT_EQ(workers[w].at("model/" + name), workers[0].at("model/" + name)) << name << ", worker " << w;
    ASSERT_TRUE(saved.count(name)) << name;
    const at::Tensor t = saved.at(name).contiguous();
    EXPECT_EQ(std::string(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size()), workers[0].at("model/" + name))
        << name << ": model.pt";
  }
  EXPECT_EQ(saved.at("norm.num_batches_tracked").item<int64_t>(), 50);
  EXPECT_GT(saved.at("norm.running_mean").abs().max().item<float>(), 0.0f);  // it moved from its start
}

TEST(TorchScript, OtherStrategiesCodecsATracedModuleAndResumeWork) {
  const std::string data = exported();
  // Other strategies and codecs train it too.
  for (const std::string& variant : {std::string("--set strategy.kind=sync --set strategy.codec=powersgd"),
                                     std::string("--set strategy.kind=streaming --set strategy.codec=int4 "
                                                 "--set strategy.inner_steps=20 --set strategy.delay=2"),
                                     // [2/5] ZeRO-1 on a user's module: AdamW's moments sharded over 2 workers.
                                     std::string("--set strategy.kind=diloco --set strategy.inner_steps=20 "
                                                 "--set sites.0.workers=2 --set parallel.shard=optimizer")}) {
    SCOPED_TRACE(variant);
    const std::string dir = temp_run_dir("torchscript-variant");
    Result r = run(job_args(dir, data) + " --set job.steps=60 " + variant);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    for (const auto& [site, fl] : first_and_last_loss(dir)) EXPECT_LT(fl.second, 0.8 * fl.first) << site;
  }
  // torch.jit.trace'd instead of scripted.
  const std::string traced = temp_run_dir("torchscript-traced");
  ASSERT_EQ(shell(kPython + " examples/torchscript/export.py " + traced + " --trace", 300).exit_code, 0);
  Result t = run(job_args(temp_run_dir("torchscript-traced-run"), traced) + " --set job.steps=30");
  EXPECT_EQ(t.exit_code, 0) << t.output;

  // Stopped at step 40 and resumed: the same weights as without the stop (checkpoints go
  // through the mirror; model.pt must hold what was restored). Equal sites: a heterogeneous
  // round's inner steps follow measured speed, which differs between runs.
  const std::string clean = temp_run_dir("torchscript-clean"), stopped = temp_run_dir("torchscript-stopped");
  const std::string args = " --set job.steps=80 --set checkpoint.every=20 --set strategy.heterogeneous=false";
  ASSERT_EQ(run(job_args(clean, data) + args).exit_code, 0);
  Result s = run(job_args(stopped, data) + args, 600, "NEBULA_TEST_STOP_AT_STEP=40");
  ASSERT_EQ(s.exit_code, 128 + 15) << s.output;
  Result resumed = run(job_args(stopped, data) + args + " --resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(tensor_bytes(clean + "/model.safetensors"), tensor_bytes(stopped + "/model.safetensors"));
  const auto a = parameters_of(torch::jit::load(clean + "/model.pt"));
  const auto b = parameters_of(torch::jit::load(stopped + "/model.pt"));
  for (const auto& [name, t] : a) EXPECT_TRUE(at::equal(t, b.at(name))) << name;
}

}  // namespace
