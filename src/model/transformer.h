// Post-LN Transformer encoder and decoder layers, written out with explicit projections.
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
// DecoderLayer is PyTorch's TransformerDecoderLayer(norm_first=false, activation=gelu) the same
// way, with ten Linear maps (self-attention q/k/v/out, cross-attention q/k/v/out, linear1/2):
//   x = norm1(x + dropout(self_attention(x, causal mask, target key padding mask)))
//   x = norm2(x + dropout(attention(q = x, k = v = memory, memory key padding mask)))
//   x = norm3(x + dropout(linear2(dropout(gelu(linear1(x))))))
// Both layers compute attention with multi_head_attention() below (one implementation).
//
// Not thread-safe (like any torch::nn::Module); forward may run on any one thread at a time.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <array>
#include <cstdint>
#include <vector>

#include "model/tensor_parallel.h"

namespace nebula::model {

// Multi-head scaled dot-product attention on already projected inputs: per head h,
// softmax(q_h k_hᵀ / √head_dim + mask) v_h, the heads concatenated again (what goes into the
// output projection). q: [batch, tq, dim]; k, v: [batch, tk, dim]; dim divisible by heads.
// key_padding_mask: [batch, tk] bool, true = never attended to; may be undefined. causal: query
// i attends to keys j ≤ i only (needs tq == tk). dropout: the probability applied to the
// attention weights (pass 0 in eval mode). Masked scores are the lowest finite value, not -inf,
// so a query with every key masked gets finite (meaningless) output and gradients, not NaN; for
// any other query a masked key's weight is exactly 0. Returns [batch, tq, dim].
at::Tensor multi_head_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads,
                                const at::Tensor& key_padding_mask, bool causal, double dropout);

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

  // Tensor parallelism (model/tensor_parallel.h): keeps this worker's slices of q, k, v and
  // linear1 (their output rows: heads / T heads, ffn / T units) and of out and linear2 (their
  // input columns), records them in `out`, and computes with `group` from then on. heads and
  // ffn must be multiples of group.size(); not with PEFT.
  void split_for_tensor(TensorGroup& group, std::vector<TensorSlice>& out);
  // The group the layer computes with (null: the whole layer here, e.g. while its slices are
  // gathered whole for a while, parallel::TensorSplit::with_whole).
  void set_tensor_group(TensorGroup* group) { tensor_ = group; }

 private:
  at::Tensor project(Projection p, const at::Tensor& x) { return projections_[p].forward(x); }
  // With tensor parallelism: the input of a column-parallel projection (copy_to_tensor_group),
  // and row-parallel projection `p` (its partial sums added over the group, then its bias).
  at::Tensor column_input(const at::Tensor& x) { return tensor_ ? copy_to_tensor_group(x, *tensor_) : x; }
  at::Tensor row_parallel(Projection p, const at::Tensor& x);
  at::Tensor drop(const at::Tensor& x, double p) const;

  int64_t dim_, heads_;
  double dropout_;
  std::array<torch::nn::Linear, kNumProjections> linears_{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  std::array<torch::nn::AnyModule, kNumProjections> projections_;  // what forward calls: linears_ or wrappers
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  std::array<torch::nn::AnyModule, 2> adapters_;  // empty = identity
  TensorGroup* tensor_ = nullptr;                  // not owned
};
TORCH_MODULE(EncoderLayer);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  // The ten Linear maps, in registration (and so parameter) order.
  enum Projection : size_t {
    kSelfQuery, kSelfKey, kSelfValue, kSelfOut,
    kCrossQuery, kCrossKey, kCrossValue, kCrossOut,
    kFfnIn, kFfnOut, kNumProjections
  };
  static constexpr std::array<const char*, kNumProjections> kProjectionNames = {
      "self_q", "self_k", "self_v", "self_out", "cross_q", "cross_k", "cross_v", "cross_out", "linear1", "linear2"};

  // dim must be divisible by heads. Both attentions are initialised like EncoderLayer's (and
  // torch's MultiheadAttention); linear1/2 are torch::nn::Linear's default.
  DecoderLayerImpl(int64_t dim, int64_t heads, int64_t ffn, double dropout);

  // x: [batch, tgt, dim], memory: [batch, src, dim] (the encoder's output), batch first.
  // tgt_padding_mask: [batch, tgt] bool, memory_padding_mask: [batch, src] bool, true where a
  // position is padding; either may be undefined. The causal mask is always applied: output
  // position t depends on x[:, ≤ t] and the memory only. Returns [batch, tgt, dim].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& memory, const at::Tensor& tgt_padding_mask = {},
                     const at::Tensor& memory_padding_mask = {});

  // The plain Linear behind `p`; still the same module (and weights) after set_projection.
  const torch::nn::Linear& linear(Projection p) const { return linears_[p]; }
  torch::nn::LayerNorm& norm1() { return norms_[0]; }
  torch::nn::LayerNorm& norm2() { return norms_[1]; }
  torch::nn::LayerNorm& norm3() { return norms_[2]; }

  // As EncoderLayerImpl::set_projection (a PEFT hook): replaces what computes projection `p`.
  void set_projection(Projection p, torch::nn::AnyModule module);
  // As EncoderLayerImpl's: both attentions' q, k, v and linear1 by output rows, self_out,
  // cross_out and linear2 by input columns.
  void split_for_tensor(TensorGroup& group, std::vector<TensorSlice>& out);
  void set_tensor_group(TensorGroup* group) { tensor_ = group; }
  // As EncoderLayerImpl::set_adapters, one slot per sub-block: on the self-attention output, the
  // cross-attention output and the FFN output, each before its residual sum. Once per layer.
  void set_adapters(torch::nn::AnyModule after_self, torch::nn::AnyModule after_cross, torch::nn::AnyModule after_ffn);
  bool has_adapters() const { return !adapters_[0].is_empty(); }

 private:
  at::Tensor project(Projection p, const at::Tensor& x) { return projections_[p].forward(x); }
  at::Tensor drop(const at::Tensor& x) const;
  at::Tensor adapt(size_t slot, const at::Tensor& x) { return has_adapters() ? adapters_[slot].forward(x) : x; }
  at::Tensor column_input(const at::Tensor& x) { return tensor_ ? copy_to_tensor_group(x, *tensor_) : x; }
  at::Tensor row_parallel(Projection p, const at::Tensor& x);

  int64_t dim_, heads_;
  double dropout_;
  std::array<torch::nn::Linear, kNumProjections> linears_{nullptr, nullptr, nullptr, nullptr, nullptr,
                                                          nullptr, nullptr, nullptr, nullptr, nullptr};
  std::array<torch::nn::AnyModule, kNumProjections> projections_;  // what forward calls: linears_ or wrappers
  std::array<torch::nn::LayerNorm, 3> norms_{nullptr, nullptr, nullptr};
  std::array<torch::nn::AnyModule, 3> adapters_;  // empty = identity
  TensorGroup* tensor_ = nullptr;                  // not owned
};
TORCH_MODULE(DecoderLayer);

}  // namespace nebula::model
