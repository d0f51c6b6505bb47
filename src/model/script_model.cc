#include "model/script_model.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/version.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <set>

#include "nebula/error.h"

namespace nebula::model {
namespace {

std::string shape(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// An nn::Module with `script`'s children, parameters and buffers: the same names, the same tensors.
std::shared_ptr<torch::nn::Module> mirror_of(const torch::jit::Module& script) {
  auto m = std::make_shared<torch::nn::Module>();
  for (const auto& p : script.named_parameters(/*recurse=*/false))
    m->register_parameter(p.name, p.value, p.value.requires_grad());
  for (const auto& b : script.named_buffers(/*recurse=*/false)) m->register_buffer(b.name, b.value);
  for (const auto& child : script.named_children()) m->register_module(child.name, mirror_of(child.value));
  return m;
}

}  // namespace

ScriptModel::ScriptModel(torch::jit::Module script, std::string path)
    : script_(std::move(script)), mirror_(mirror_of(script_)), path_(std::move(path)) {}

ScriptModel ScriptModel::load(const std::string& path) {
  if (!std::filesystem::is_regular_file(path))
    throw DataError(str_cat(path, ": no such file: give model.script the module saved by torch.jit.save in Python"));
  try {
    return ScriptModel(torch::jit::load(path), path);
  } catch (const c10::Error& e) {
    throw DataError(str_cat(path, ": not a TorchScript module LibTorch ", TORCH_VERSION,
                            " can load (export it with torch.jit.script(model).save(path)): ",
                            e.what_without_backtrace()));
  }
}

std::vector<at::Tensor> ScriptModel::trainable() const {
  std::vector<at::Tensor> out;
  std::set<const void*> seen;
  for (const auto& p : script_.parameters())
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

at::Tensor ScriptModel::loss(const std::vector<at::Tensor>& inputs, const at::Tensor& targets,
                             const std::string& kind) {
  auto fail = [&](const std::string& what) {
    std::string args;
    for (size_t k = 0; k < inputs.size(); ++k)
      args += str_cat(inputs.size() == 1 ? std::string("inputs") : str_cat("inputs.", k), " ", shape(inputs[k]), ", ");
    return DataError(str_cat(path_, ": forward(", args, "targets ", shape(targets), ") ", what));
  };
  std::vector<c10::IValue> args(inputs.begin(), inputs.end());
  if (kind == "output") args.emplace_back(targets);
  c10::IValue out;
  try {
    out = script_.forward(std::move(args));
  } catch (const c10::Error& e) {
    throw fail(str_cat("failed: ", e.what_without_backtrace()));
  }
  if (kind == "output") {
    if (out.isTuple() && !out.toTupleRef().elements().empty()) out = out.toTupleRef().elements()[0];
    if (out.isGenericDict()) {
      auto dict = out.toGenericDict();
      auto it = dict.find(c10::IValue(std::string("loss")));
      if (it == dict.end()) throw fail("returned a dict without \"loss\"");
      out = it->value();
    }
    if (!out.isTensor() || out.toTensor().numel() != 1)
      throw fail(str_cat("returned ", out.tagKind(), out.isTensor() ? " " + shape(out.toTensor()) : std::string(),
                         ", not a scalar loss: return the loss, or set model.loss = \"cross_entropy\" or \"mse\""));
    return out.toTensor().reshape({});
  }
  if (!out.isTensor()) throw fail(str_cat("returned ", out.tagKind(), ", not a tensor for model.loss = \"", kind, "\""));
  const at::Tensor y = out.toTensor();
  if (kind == "mse") {
    if (!y.sizes().equals(targets.sizes()))
      throw fail(str_cat("returned ", shape(y), ": model.loss = \"mse\" needs the targets' shape"));
    return at::mse_loss(y, targets.to(y.scalar_type()));
  }
  // cross_entropy: logits [..., classes] against class ids [...].
  if (y.dim() < 1 || y.numel() != targets.numel() * y.size(-1) || at::isFloatingType(targets.scalar_type()))
    throw fail(str_cat("returned ", shape(y), ": model.loss = \"cross_entropy\" needs logits [..., classes] and "
                       "integer targets of the shape [...]"));
  return at::cross_entropy_loss(y.reshape({-1, y.size(-1)}), targets.reshape({-1}).to(at::kLong), {},
                                at::Reduction::Mean, -100);
}

int64_t ScriptModel::weight(const at::Tensor& targets, const std::string& kind) {
  if (kind == "cross_entropy") return targets.ne(-100).sum().item<int64_t>();
  return targets.dim() > 0 ? targets.size(0) : 1;
}

void ScriptModel::to(const at::Device& device) {
  script_.to(device);  // set_data on each tensor: the same TensorImpls, now on `device`
  device_ = device;
}

void ScriptModel::save(const std::string& path) {
  const std::string tmp = str_cat(path, ".tmp-", ::getpid());
  const at::Device device = device_;
  try {
    if (device.is_cuda()) script_.to(at::kCPU);
    script_.save(tmp);
    if (device.is_cuda()) script_.to(device);
  } catch (const c10::Error& e) {
    if (device.is_cuda()) script_.to(device);
    std::remove(tmp.c_str());
    throw DataError(str_cat(path, ": cannot write the TorchScript module: ", e.what_without_backtrace()));
  }
  if (int fd = ::open(tmp.c_str(), O_RDONLY); fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw DataError(str_cat(path, ": cannot rename ", tmp, " onto it"));
  }
}

}  // namespace nebula::model
