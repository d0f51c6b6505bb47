#include "model/transformer.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/nn/init.h>

#include <cmath>
#include <limits>

#include "nebula/error.h"

namespace nebula::model {
namespace {

// Fill value for masked attention scores. Finite on purpose: with -inf a sequence that is all
// padding gives softmax(-inf, ..., -inf) = NaN, and NaN gradients would then reach every
// weight. With the lowest finite value such a row becomes uniform (finite, ignored by the loss),
// and every other row is unchanged: exp(lowest - max) is exactly 0, as exp(-inf) is.
at::Scalar most_negative(at::ScalarType type) {
  at::Scalar out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, type, "most_negative",
                                  [&] { out = std::numeric_limits<scalar_t>::lowest(); });
  return out;
}

}  // namespace

EncoderLayerImpl::EncoderLayerImpl(int64_t dim, int64_t heads, int64_t ffn, double dropout)
    : dim_(dim), heads_(heads), head_dim_(heads > 0 ? dim / heads : 0), dropout_(dropout) {
  NEBULA_CHECK(dim > 0 && heads > 0 && dim % heads == 0 && ffn > 0, "encoder layer dim ", dim, " heads ", heads,
               " ffn ", ffn, ": dim must be a positive multiple of heads");
  NEBULA_CHECK(dropout >= 0 && dropout < 1, "dropout ", dropout);
  const std::array<std::pair<int64_t, int64_t>, kNumProjections> shapes = {
      {{dim, dim}, {dim, dim}, {dim, dim}, {dim, dim}, {dim, ffn}, {ffn, dim}}};
  for (size_t p = 0; p < kNumProjections; ++p) {
    linears_[p] = register_module(kProjectionNames[p], torch::nn::Linear(shapes[p].first, shapes[p].second));
    projections_[p] = torch::nn::AnyModule(linears_[p]);
  }
  norm1_ = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  norm2_ = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));

  // torch's MultiheadAttention: xavier_uniform_ on the fused [3·dim, dim] in_proj_weight (so the
  // bound is sqrt(6 / (dim + 3·dim))), zero in_proj_bias and out_proj.bias. Matching it keeps
  // training behaviour (and the demo's loss curve) as it was with torch's layer.
  torch::NoGradGuard no_grad;
  const double bound = std::sqrt(6.0 / static_cast<double>(4 * dim));
  for (Projection p : {kQuery, kKey, kValue}) {
    linears_[p]->weight.uniform_(-bound, bound);
    linears_[p]->bias.zero_();
  }
  linears_[kOut]->bias.zero_();
}

at::Tensor EncoderLayerImpl::drop(const at::Tensor& x, double p) const {
  return p > 0 && is_training() ? at::dropout(x, p, /*train=*/true) : x;
}

at::Tensor EncoderLayerImpl::attention(const at::Tensor& x, const at::Tensor& key_padding_mask) {
  NEBULA_CHECK(x.dim() == 3 && x.size(2) == dim_, "encoder layer input of shape ", x.sizes(), ", dim ", dim_);
  const int64_t batch = x.size(0), seq = x.size(1);
  // [batch, seq, dim] → [batch, heads, seq, head_dim]
  auto split_heads = [&](const at::Tensor& t) { return t.view({batch, seq, heads_, head_dim_}).transpose(1, 2); };
  // Scaling q before the product (as torch does) is cheaper than scaling the scores.
  at::Tensor q = split_heads(project(kQuery, x) * (1.0 / std::sqrt(static_cast<double>(head_dim_))));
  at::Tensor k = split_heads(project(kKey, x));
  at::Tensor v = split_heads(project(kValue, x));
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1));  // [batch, heads, seq(query), seq(key)]
  if (key_padding_mask.defined()) {
    NEBULA_CHECK(key_padding_mask.scalar_type() == at::kBool && key_padding_mask.dim() == 2 &&
                     key_padding_mask.size(0) == batch && key_padding_mask.size(1) == seq,
                 "key_padding_mask of shape ", key_padding_mask.sizes(), " and type ",
                 key_padding_mask.scalar_type(), " for input ", x.sizes(), ": expected bool [batch, seq]");
    scores = scores.masked_fill(key_padding_mask.view({batch, 1, 1, seq}), most_negative(scores.scalar_type()));
  }
  at::Tensor weights = drop(at::softmax(scores, -1), dropout_);
  at::Tensor heads = at::matmul(weights, v).transpose(1, 2).reshape({batch, seq, dim_});
  return project(kOut, heads);
}

at::Tensor EncoderLayerImpl::forward(const at::Tensor& x, const at::Tensor& key_padding_mask) {
  at::Tensor h = drop(attention(x, key_padding_mask), dropout_);
  if (has_adapters()) h = adapters_[0].forward(h);
  at::Tensor y = norm1_(x + h);
  h = project(kFfnOut, drop(at::gelu(project(kFfnIn, y)), dropout_));
  h = drop(h, dropout_);
  if (has_adapters()) h = adapters_[1].forward(h);
  return norm2_(y + h);
}

void EncoderLayerImpl::set_projection(Projection p, torch::nn::AnyModule module) {
  NEBULA_CHECK(p < kNumProjections && !module.is_empty(), "set_projection(", static_cast<size_t>(p), ")");
  replace_module(kProjectionNames[p], module.ptr());
  projections_[p] = std::move(module);
}

void EncoderLayerImpl::set_adapters(torch::nn::AnyModule after_attention, torch::nn::AnyModule after_ffn) {
  NEBULA_CHECK(!has_adapters(), "the layer already has adapters");
  NEBULA_CHECK(!after_attention.is_empty() && !after_ffn.is_empty(), "set_adapters with an empty module");
  register_module("adapter1", after_attention.ptr());
  register_module("adapter2", after_ffn.ptr());
  adapters_ = {std::move(after_attention), std::move(after_ffn)};
}

}  // namespace nebula::model
