// Parameter-efficient training (PEFT): freeze the backbone, train a few added parameters.
//
//   lora     every Linear of every encoder layer (q, k, v, out, linear1, linear2) becomes
//            base(x) + (alpha / r) · x Aᵀ Bᵀ with the base frozen, A: [r, in], B: [out, r]
//            (Hu et al. 2021). r·(in + out) trainable values per Linear.
//   adapter  a bottleneck x + up(gelu(down(x))) after the attention block and after the FFN
//            of every layer, and after the cross-attention of a decoder layer (Houlsby et al.
//            2019). 2·dim·a + a + dim values per adapter.
//   none     nothing added, nothing frozen.
//
// Both start as the identity change (B = 0, up = 0): right after apply_peft the model computes
// exactly what it did before. Only the trainable parameters go to the optimizer and the
// strategy, so WAN bytes per synchronization scale with their count, not the model's. Frozen
// weights are equal on every worker by construction (same seed, or the same checkpoint), so
// they never need to cross the WAN.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <vector>

#include "model/mlm_encoder.h"
#include "model/seq2seq.h"
#include "nebula/config.h"

namespace nebula::model {

// A frozen Linear plus a trainable low-rank update. `base` is shared, not copied: its weight
// and bias get requires_grad(false) and are never written by this module.
class LoraLinearImpl : public torch::nn::Module {
 public:
  // rank ≥ 1, alpha > 0. A is initialised like a Linear's weight (Kaiming-uniform, a = √5, as
  // in the reference implementation), B to zeros.
  LoraLinearImpl(torch::nn::Linear base, int64_t rank, double alpha);
  // [..., in] → [..., out]
  at::Tensor forward(const at::Tensor& x);

  const torch::nn::Linear& base() const { return base_; }
  const at::Tensor& a() const { return a_; }  // [rank, in], registered as "lora_A"
  const at::Tensor& b() const { return b_; }  // [out, rank], registered as "lora_B"
  double scale() const { return scale_; }     // alpha / rank

 private:
  torch::nn::Linear base_;
  at::Tensor a_, b_;
  double scale_;
};
TORCH_MODULE(LoraLinear);

// Bottleneck adapter: x + up(gelu(down(x))), down: dim → bottleneck, up: bottleneck → dim.
// up's weight and bias start at zero, so the adapter starts as the identity.
class AdapterImpl : public torch::nn::Module {
 public:
  AdapterImpl(int64_t dim, int64_t bottleneck);
  at::Tensor forward(const at::Tensor& x);

  const torch::nn::Linear& down() const { return down_; }
  const torch::nn::Linear& up() const { return up_; }

 private:
  torch::nn::Linear down_{nullptr}, up_{nullptr};
};
TORCH_MODULE(Adapter);

// Injects `peft` into `model` (check_peft first) and freezes every parameter that was there
// before: embeddings, norms, base weights. Returns model.trainable_parameters(): the added
// parameters in registration order (layer by layer; q, k, v, out, linear1, linear2, each
// lora_A then lora_B; or each layer's two adapters), or with kind "none" every parameter.
// Draws the new parameters' initial values from the default generator. Once per model.
std::vector<at::Tensor> apply_peft(MlmEncoderImpl& model, const PeftConfig& peft);
// The same for a translation model: LoRA in every Linear of every encoder and decoder layer
// (self- and cross-attention, FFN), or adapters (two per encoder layer as above, three per
// decoder layer: after self-attention, cross-attention and the FFN); embeddings (tied to the
// output), norms and base weights frozen. Returns the trainable parameters in registration
// order.
std::vector<at::Tensor> apply_peft(Seq2SeqImpl& model, const PeftConfig& peft);

// Total number of values in `tensors`.
int64_t numel(const std::vector<at::Tensor>& tensors);

}  // namespace nebula::model
