#include "model/peft.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>

#include "nebula/error.h"

namespace nebula::model {

LoraLinearImpl::LoraLinearImpl(torch::nn::Linear base, int64_t rank, double alpha)
    : base_(std::move(base)), scale_(alpha / static_cast<double>(rank)) {
  NEBULA_CHECK(!base_.is_empty() && rank >= 1 && alpha > 0, "LoRA rank ", rank, " alpha ", alpha);
  const int64_t in = base_->weight.size(1), out = base_->weight.size(0);
  register_module("base", base_);
  for (auto& p : base_->parameters()) p.set_requires_grad(false);
  a_ = register_parameter("lora_A", at::empty({rank, in}));
  b_ = register_parameter("lora_B", at::zeros({out, rank}));
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(a_, std::sqrt(5.0));
}

at::Tensor LoraLinearImpl::forward(const at::Tensor& x) {
  // Two thin products (x·Aᵀ is [..., r]) rather than forming B·A: cheaper for r ≪ in, out.
  return base_(x) + at::linear(at::linear(x, a_), b_) * scale_;
}

AdapterImpl::AdapterImpl(int64_t dim, int64_t bottleneck) {
  NEBULA_CHECK(dim >= 1 && bottleneck >= 1, "adapter dim ", dim, " bottleneck ", bottleneck);
  down_ = register_module("down", torch::nn::Linear(dim, bottleneck));
  up_ = register_module("up", torch::nn::Linear(bottleneck, dim));
  torch::NoGradGuard no_grad;
  up_->weight.zero_();
  up_->bias.zero_();
}

at::Tensor AdapterImpl::forward(const at::Tensor& x) { return x + up_(at::gelu(down_(x))); }

std::vector<at::Tensor> apply_peft(MlmEncoderImpl& model, const PeftConfig& peft) {
  check_peft(model.config(), peft);
  const auto all = model.parameters();
  NEBULA_CHECK(model.trainable_parameters().size() == all.size(),
               "apply_peft on a model that already has frozen parameters (PEFT applied twice?)");
  if (peft.kind == "none") return all;

  for (auto& p : all) p.set_requires_grad(false);
  const int64_t dim = model.config().dim;
  for (EncoderLayer layer : model.layers()) {  // a holder: copies share the module
    if (peft.kind == "lora") {
      for (size_t p = 0; p < EncoderLayerImpl::kNumProjections; ++p) {
        const auto which = static_cast<EncoderLayerImpl::Projection>(p);
        layer->set_projection(which, torch::nn::AnyModule(LoraLinear(layer->linear(which), peft.rank, peft.alpha)));
      }
    } else {
      layer->set_adapters(torch::nn::AnyModule(Adapter(dim, peft.adapter_dim)),
                          torch::nn::AnyModule(Adapter(dim, peft.adapter_dim)));
    }
  }
  return model.trainable_parameters();
}

std::vector<at::Tensor> apply_peft(Seq2SeqImpl& model, const PeftConfig& peft) {
  ModelConfig config = model.encoder()->config();
  config.kind = "seq2seq";
  check_peft(config, peft);
  const auto all = model.parameters();
  NEBULA_CHECK(std::all_of(all.begin(), all.end(), [](const at::Tensor& p) { return p.requires_grad(); }),
               "apply_peft on a model that already has frozen parameters (PEFT applied twice?)");
  if (peft.kind == "none") return all;
  for (auto& p : all) p.set_requires_grad(false);
  const int64_t dim = config.dim;
  auto adapter = [&] { return torch::nn::AnyModule(Adapter(dim, peft.adapter_dim)); };
  for (EncoderLayer layer : model.encoder()->layers()) {
    if (peft.kind == "adapter") {
      layer->set_adapters(adapter(), adapter());
      continue;
    }
    for (size_t p = 0; p < EncoderLayerImpl::kNumProjections; ++p) {
      const auto which = static_cast<EncoderLayerImpl::Projection>(p);
      layer->set_projection(which, torch::nn::AnyModule(LoraLinear(layer->linear(which), peft.rank, peft.alpha)));
    }
  }
  for (DecoderLayer layer : model.decoder_layers()) {
    if (peft.kind == "adapter") {
      layer->set_adapters(adapter(), adapter(), adapter());
      continue;
    }
    for (size_t p = 0; p < DecoderLayerImpl::kNumProjections; ++p) {
      const auto which = static_cast<DecoderLayerImpl::Projection>(p);
      layer->set_projection(which, torch::nn::AnyModule(LoraLinear(layer->linear(which), peft.rank, peft.alpha)));
    }
  }
  std::vector<at::Tensor> out;
  for (const auto& p : model.parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

int64_t numel(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel();
  return n;
}

}  // namespace nebula::model
