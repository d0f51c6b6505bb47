// A user's own model: a TorchScript module exported from PyTorch (torch.jit.script or
// torch.jit.trace, then .save("model.pt")), trained by nebula like its built-in models.
//
// The module's forward gives the loss one of two ways (config model.loss), `inputs` being one
// tensor or several (forward's arguments in order):
//   "output"         forward(inputs..., targets) returns the loss: a scalar tensor, or a tuple
//                    whose first element is it, or a dict with a "loss" entry;
//   "cross_entropy"  forward(inputs...) returns logits [..., classes]; targets are class ids
//                    [...] (int64; -100 = no loss there);
//   "mse"            forward(inputs...) returns a tensor of targets' shape.
//
// nebula's training loop, checkpoints and model files work on torch::nn::Module. A
// TorchScript module is not one, so ScriptModel builds a mirror: an nn::Module tree with the
// script module's children, parameters and buffers under the same dotted names, holding the
// *same* tensors. What the optimizer and the strategies do to the mirror's parameters is done
// to the script module's, and save() writes the trained module back as TorchScript.
//
// Not thread-safe (one worker thread owns it).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

namespace nebula::model {

class ScriptModel {
 public:
  // DataError naming `path` when it is missing or not a TorchScript archive.
  static ScriptModel load(const std::string& path);

  torch::jit::Module& script() { return script_; }
  torch::nn::Module& module() { return *mirror_; }
  const torch::nn::Module& module() const { return *mirror_; }
  // The parameters that require a gradient, each once (tied weights appear under two names).
  std::vector<at::Tensor> trainable() const;

  // The loss of one batch (`kind` as model.loss above). DataError naming the module's path
  // and the shapes when the forward's result is not what `kind` needs.
  at::Tensor loss(const std::vector<at::Tensor>& inputs, const at::Tensor& targets, const std::string& kind);
  // The weight of that batch in a global mean: the targets that have a loss ("cross_entropy":
  // those not -100), else the batch rows.
  static int64_t weight(const at::Tensor& targets, const std::string& kind);

  void train(bool on) { script_.train(on); }
  // Moves the parameters and buffers in place (the mirror keeps sharing them).
  void to(const at::Device& device);
  at::Device device() const { return device_; }
  // Writes the module (with its current weights) as TorchScript, atomically (temporary file,
  // rename): torch.jit.load in Python and torch::jit::load in C++ read it. From a GPU, the
  // file holds CPU tensors (loadable anywhere).
  void save(const std::string& path);

  const std::string& path() const { return path_; }

 private:
  ScriptModel(torch::jit::Module script, std::string path);

  torch::jit::Module script_;
  std::shared_ptr<torch::nn::Module> mirror_;
  std::string path_;
  at::Device device_ = at::kCPU;
};

}  // namespace nebula::model
