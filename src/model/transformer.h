// One post-LN Transformer encoder layer, written out with explicit projections.
//
// The math is PyTorch's TransformerEncoderLayer(norm_first=false, activation=gelu):
//   x = norm1(x + adapter1(dropout(attention(x))))
//   x = norm2(x + adapter2(dropout(linear2(dropout(gelu(linear1(x)))))))
// where attention is multi-head scaled dot-product self-attention with a key padding mask,
// and adapter1/2 are the identity unless PEFT fills them (model/peft.h). It exists instead of
// torch::nn::TransformerEncoderLayer because MultiheadAttention keeps q/k/v as one raw
// in_proj_weight tensor: here each of the six Linear maps (q, k, v, out, linear1, linear2) is a
// module of its own that PEFT can wrap (LoRA). transformer_test.cc checks the equality with
// torch's layer numerically.
//
// Not thread-safe (like any torch::nn::Module); forward may run on any one thread at a time.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <array>
#include <cstdint>

namespace nebula::model {

class EncoderLayerImpl : public torch::nn::Module {
 public:
  // The six Linear maps, in registration (and so parameter) order.
  enum Projection : size_t { kQuery, kKey, kValue, kOut, kFfnIn, kFfnOut, kNumProjections };
  static constexpr std::array<const char*, kNumProjections> kProjectionNames = {"q",   "k",       "v",
                                                                                "out", "linear1", "linear2"};

  // dim must be divisible by heads. Initialised like torch's layer: q/k/v weights Xavier-uniform
  // as if fused into one [3·dim, dim] matrix, their biases and out's bias zero, the rest
  // torch::nn::Linear's default.
  EncoderLayerImpl(int64_t dim, int64_t heads, int64_t ffn, double dropout);

  // x: [batch, seq, dim] (batch first). key_padding_mask: [batch, seq] bool, true where a
  // position is padding (never attended to); may be undefined. A sequence that is all padding
  // gets finite (meaningless) outputs, not NaN. Returns [batch, seq, dim].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& key_padding_mask = {});
  // The self-attention block alone (projections, softmax, attention dropout, out), before the
  // residual add: what torch::nn::MultiheadAttention(x, x, x) returns as its first output.
  at::Tensor attention(const at::Tensor& x, const at::Tensor& key_padding_mask = {});

  // The plain Linear behind `p`; still the same module (and weights) after PEFT wraps it.
  const torch::nn::Linear& linear(Projection p) const { return linears_[p]; }
  torch::nn::LayerNorm& norm1() { return norm1_; }
  torch::nn::LayerNorm& norm2() { return norm2_; }

  // PEFT hooks (model/peft.h). The layer only knows "a module mapping [..., in] → [..., out]",
  // with forward(const at::Tensor&) -> at::Tensor.
  // Replaces what computes projection `p` (registered under its name, so parameter names
  // become e.g. "q.base.weight"). The module must keep the Linear's input and output widths.
  void set_projection(Projection p, torch::nn::AnyModule module);
  // Fills the adapter slots: after_attention on the attention output, after_ffn on the FFN
  // output, each before its residual add and LayerNorm (Houlsby et al. 2019). Once only.
  void set_adapters(torch::nn::AnyModule after_attention, torch::nn::AnyModule after_ffn);
  bool has_adapters() const { return !adapters_[0].is_empty(); }

 private:
  at::Tensor project(Projection p, const at::Tensor& x) { return projections_[p].forward(x); }
  at::Tensor drop(const at::Tensor& x, double p) const;

  int64_t dim_, heads_, head_dim_;
  double dropout_;
  std::array<torch::nn::Linear, kNumProjections> linears_{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  std::array<torch::nn::AnyModule, kNumProjections> projections_;  // what forward calls: linears_ or wrappers
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  std::array<torch::nn::AnyModule, 2> adapters_;  // empty = identity
};
TORCH_MODULE(EncoderLayer);

}  // namespace nebula::model
