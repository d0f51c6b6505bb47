#include "model/transformer.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/init.h>

#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>

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

// torch's MultiheadAttention: xavier_uniform_ on the fused [3·dim, dim] in_proj_weight (so the
// bound is sqrt(6 / (dim + 3·dim))), zero in_proj_bias and out_proj.bias. Matching it keeps
// training behaviour (and the demo's loss curve) as it was with torch's layer.
void init_attention_like_torch(const torch::nn::Linear& q, const torch::nn::Linear& k, const torch::nn::Linear& v,
                               const torch::nn::Linear& out, int64_t dim) {
  at::NoGradGuard no_grad;
  const double bound = std::sqrt(6.0 / static_cast<double>(4 * dim));
  for (const torch::nn::Linear* p : {&q, &k, &v}) {
    (*p)->weight.uniform_(-bound, bound);
    (*p)->bias.zero_();
  }
  out->bias.zero_();
}

void check_layer_shape(const char* what, int64_t dim, int64_t heads, int64_t ffn, double dropout) {
  NEBULA_CHECK(dim > 0 && heads > 0 && dim % heads == 0 && ffn > 0, what, " dim ", dim, " heads ", heads, " ffn ",
               ffn, ": dim must be a positive multiple of heads");
  NEBULA_CHECK(dropout >= 0 && dropout < 1, "dropout ", dropout);
}

// Tensor parallelism of a layer's Linear maps (EncoderLayer, DecoderLayer; `what` names it):
// `columns` keep their output rows' slice (weight and bias), `rows` their input columns' slice
// (the weight; the bias stays whole, added after the partial sums). Checks the heads and the
// MLP (linears[ffn_in]'s output) divide by the group, and that no PEFT module replaced a map.
template <size_t N>
void split_linears(const char* what, int64_t heads, const std::array<torch::nn::Linear, N>& linears,
                   const std::array<torch::nn::AnyModule, N>& projections, bool adapters, size_t ffn_in,
                   std::initializer_list<size_t> columns, std::initializer_list<size_t> rows, TensorGroup& group,
                   std::vector<TensorSlice>& out) {
  const int t = group.size();
  const int64_t ffn = linears[ffn_in]->weight.size(0);
  NEBULA_CHECK(heads % t == 0 && ffn % t == 0, what, " of ", heads, " heads and ffn ", ffn, " cannot be split over ", t,
               " workers: both must be multiples of it");
  for (size_t p = 0; p < N; ++p)
    NEBULA_CHECK(projections[p].ptr() == linears[p].ptr() && !adapters,
                 "tensor parallelism of a layer with PEFT modules is not built");
  for (size_t p : columns) {
    slice_parameter(linears[p]->weight, 0, group, out);
    slice_parameter(linears[p]->bias, 0, group, out);
  }
  for (size_t p : rows) slice_parameter(linears[p]->weight, 1, group, out);
}

}  // namespace

at::Tensor multi_head_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads,
                                const at::Tensor& key_padding_mask, bool causal, double dropout) {
  NEBULA_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                   q.size(2) == k.size(2) && heads > 0 && q.size(2) % heads == 0,
               "attention on q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " with ", heads, " heads");
  const int64_t batch = q.size(0), tq = q.size(1), tk = k.size(1), dim = q.size(2), head_dim = dim / heads;
  NEBULA_CHECK(!causal || tq == tk, "causal attention with ", tq, " queries and ", tk, " keys");
  // [batch, t, dim] → [batch, heads, t, head_dim]
  auto split_heads = [&](const at::Tensor& t) { return t.view({batch, t.size(1), heads, head_dim}).transpose(1, 2); };
  // Scaling q before the product (as torch does) is cheaper than scaling the scores.
  at::Tensor scores = at::matmul(split_heads(q * (1.0 / std::sqrt(static_cast<double>(head_dim)))),
                                 split_heads(k).transpose(-2, -1));  // [batch, heads, tq, tk]
  const at::Scalar lowest = most_negative(scores.scalar_type());
  if (key_padding_mask.defined()) {
    NEBULA_CHECK(key_padding_mask.scalar_type() == at::kBool && key_padding_mask.dim() == 2 &&
                     key_padding_mask.size(0) == batch && key_padding_mask.size(1) == tk,
                 "key_padding_mask of shape ", key_padding_mask.sizes(), " and type ",
                 key_padding_mask.scalar_type(), " for keys ", k.sizes(), ": expected bool [batch, keys]");
    scores = scores.masked_fill(key_padding_mask.view({batch, 1, 1, tk}), lowest);
  }
  if (causal) {
    at::Tensor future = at::ones({tq, tk}, q.options().dtype(at::kBool)).triu(1);  // key j > query i
    scores = scores.masked_fill(future, lowest);
  }
  at::Tensor weights = at::softmax(scores, -1);
  if (dropout > 0) weights = at::dropout(weights, dropout, /*train=*/true);
  return at::matmul(weights, split_heads(v)).transpose(1, 2).reshape({batch, tq, dim});
}

EncoderLayerImpl::EncoderLayerImpl(int64_t dim, int64_t heads, int64_t ffn, double dropout)
    : dim_(dim), heads_(heads), dropout_(dropout) {
  check_layer_shape("encoder layer", dim, heads, ffn, dropout);
  const std::array<std::pair<int64_t, int64_t>, kNumProjections> shapes = {
      {{dim, dim}, {dim, dim}, {dim, dim}, {dim, dim}, {dim, ffn}, {ffn, dim}}};
  for (size_t p = 0; p < kNumProjections; ++p) {
    linears_[p] = register_module(kProjectionNames[p], torch::nn::Linear(shapes[p].first, shapes[p].second));
    projections_[p] = torch::nn::AnyModule(linears_[p]);
  }
  norm1_ = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  norm2_ = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  init_attention_like_torch(linears_[kQuery], linears_[kKey], linears_[kValue], linears_[kOut], dim);
}

at::Tensor EncoderLayerImpl::drop(const at::Tensor& x, double p) const {
  return p > 0 && is_training() ? at::dropout(x, p, /*train=*/true) : x;
}

at::Tensor EncoderLayerImpl::row_parallel(Projection p, const at::Tensor& x) {
  if (!tensor_) return project(p, x);
  const torch::nn::Linear& l = linears_[p];
  return reduce_from_tensor_group(at::linear(x, l->weight), *tensor_) + l->bias;
}

at::Tensor EncoderLayerImpl::attention(const at::Tensor& x, const at::Tensor& key_padding_mask) {
  NEBULA_CHECK(x.dim() == 3 && x.size(2) == dim_, "encoder layer input of shape ", x.sizes(), ", dim ", dim_);
  const at::Tensor in = column_input(x);
  const int64_t heads = tensor_ ? heads_ / tensor_->size() : heads_;  // this worker's
  return row_parallel(kOut, multi_head_attention(project(kQuery, in), project(kKey, in), project(kValue, in), heads,
                                                 key_padding_mask, /*causal=*/false, is_training() ? dropout_ : 0.0));
}

at::Tensor EncoderLayerImpl::forward(const at::Tensor& x, const at::Tensor& key_padding_mask) {
  at::Tensor h = drop(attention(x, key_padding_mask), dropout_);
  if (has_adapters()) h = adapters_[0].forward(h);
  at::Tensor y = norm1_(x + h);
  h = row_parallel(kFfnOut, drop(at::gelu(project(kFfnIn, column_input(y))), dropout_));
  h = drop(h, dropout_);
  if (has_adapters()) h = adapters_[1].forward(h);
  return norm2_(y + h);
}

void EncoderLayerImpl::set_projection(Projection p, torch::nn::AnyModule module) {
  NEBULA_CHECK(p < kNumProjections && !module.is_empty(), "set_projection(", static_cast<size_t>(p), ")");
  replace_module(kProjectionNames[p], module.ptr());
  projections_[p] = std::move(module);
}

void EncoderLayerImpl::split_for_tensor(TensorGroup& group, std::vector<TensorSlice>& out) {
  split_linears("an encoder layer", heads_, linears_, projections_, has_adapters(), kFfnIn,
                {kQuery, kKey, kValue, kFfnIn}, {kOut, kFfnOut}, group, out);
  tensor_ = &group;
}

void EncoderLayerImpl::set_adapters(torch::nn::AnyModule after_attention, torch::nn::AnyModule after_ffn) {
  NEBULA_CHECK(!has_adapters(), "the layer already has adapters");
  NEBULA_CHECK(!after_attention.is_empty() && !after_ffn.is_empty(), "set_adapters with an empty module");
  register_module("adapter1", after_attention.ptr());
  register_module("adapter2", after_ffn.ptr());
  adapters_ = {std::move(after_attention), std::move(after_ffn)};
}

DecoderLayerImpl::DecoderLayerImpl(int64_t dim, int64_t heads, int64_t ffn, double dropout)
    : dim_(dim), heads_(heads), dropout_(dropout) {
  check_layer_shape("decoder layer", dim, heads, ffn, dropout);
  for (size_t p = 0; p < kNumProjections; ++p) {
    const int64_t in = p == kFfnOut ? ffn : dim, out = p == kFfnIn ? ffn : dim;
    linears_[p] = register_module(kProjectionNames[p], torch::nn::Linear(in, out));
    projections_[p] = torch::nn::AnyModule(linears_[p]);
  }
  for (size_t i = 0; i < norms_.size(); ++i)
    norms_[i] =
        register_module("norm" + std::to_string(i + 1), torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  init_attention_like_torch(linears_[kSelfQuery], linears_[kSelfKey], linears_[kSelfValue], linears_[kSelfOut], dim);
  init_attention_like_torch(linears_[kCrossQuery], linears_[kCrossKey], linears_[kCrossValue], linears_[kCrossOut],
                            dim);
}

at::Tensor DecoderLayerImpl::drop(const at::Tensor& x) const {
  return dropout_ > 0 && is_training() ? at::dropout(x, dropout_, /*train=*/true) : x;
}

at::Tensor DecoderLayerImpl::forward(const at::Tensor& x, const at::Tensor& memory, const at::Tensor& tgt_padding_mask,
                                     const at::Tensor& memory_padding_mask) {
  NEBULA_CHECK(x.dim() == 3 && x.size(2) == dim_ && memory.dim() == 3 && memory.size(2) == dim_ &&
                   memory.size(0) == x.size(0),
               "decoder layer input of shape ", x.sizes(), " and memory ", memory.sizes(), ", dim ", dim_);
  const double attention_dropout = is_training() ? dropout_ : 0.0;
  const int64_t heads = tensor_ ? heads_ / tensor_->size() : heads_;  // this worker's
  const at::Tensor in = column_input(x);
  at::Tensor h = multi_head_attention(project(kSelfQuery, in), project(kSelfKey, in), project(kSelfValue, in), heads,
                                      tgt_padding_mask, /*causal=*/true, attention_dropout);
  at::Tensor y = norms_[0](x + adapt(0, drop(row_parallel(kSelfOut, h))));
  const at::Tensor query = column_input(y), keys = column_input(memory);
  h = multi_head_attention(project(kCrossQuery, query), project(kCrossKey, keys), project(kCrossValue, keys), heads,
                           memory_padding_mask, /*causal=*/false, attention_dropout);
  y = norms_[1](y + adapt(1, drop(row_parallel(kCrossOut, h))));
  h = drop(row_parallel(kFfnOut, drop(at::gelu(project(kFfnIn, column_input(y))))));
  return norms_[2](y + adapt(2, h));
}

at::Tensor DecoderLayerImpl::row_parallel(Projection p, const at::Tensor& x) {
  if (!tensor_) return project(p, x);
  const torch::nn::Linear& l = linears_[p];
  return reduce_from_tensor_group(at::linear(x, l->weight), *tensor_) + l->bias;
}

void DecoderLayerImpl::split_for_tensor(TensorGroup& group, std::vector<TensorSlice>& out) {
  split_linears("a decoder layer", heads_, linears_, projections_, has_adapters(), kFfnIn,
                {kSelfQuery, kSelfKey, kSelfValue, kCrossQuery, kCrossKey, kCrossValue, kFfnIn},
                {kSelfOut, kCrossOut, kFfnOut}, group, out);
  tensor_ = &group;
}

void DecoderLayerImpl::set_adapters(torch::nn::AnyModule after_self, torch::nn::AnyModule after_cross,
                                    torch::nn::AnyModule after_ffn) {
  NEBULA_CHECK(!has_adapters(), "the decoder layer already has adapters");
  NEBULA_CHECK(!after_self.is_empty() && !after_cross.is_empty() && !after_ffn.is_empty(),
               "set_adapters with an empty module");
  register_module("adapter1", after_self.ptr());
  register_module("adapter2", after_cross.ptr());
  register_module("adapter3", after_ffn.ptr());
  adapters_ = {std::move(after_self), std::move(after_cross), std::move(after_ffn)};
}

void DecoderLayerImpl::set_projection(Projection p, torch::nn::AnyModule module) {
  NEBULA_CHECK(p < kNumProjections && !module.is_empty(), "set_projection(", static_cast<size_t>(p), ")");
  replace_module(kProjectionNames[p], module.ptr());
  projections_[p] = std::move(module);
}

}  // namespace nebula::model
