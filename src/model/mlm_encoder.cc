#include "model/mlm_encoder.h"

#include <ATen/ATen.h>

#include <cmath>

#include "nebula/error.h"

namespace nebula::model {

MlmEncoderImpl::MlmEncoderImpl(const ModelConfig& c, int64_t vocab_size, int64_t pad_id)
    : pad_id_(pad_id), max_len_(c.max_len), dim_(c.dim) {
  NEBULA_CHECK(vocab_size > 0 && pad_id >= 0 && pad_id < vocab_size, "vocab ", vocab_size, " pad ", pad_id);
  tokens_ = register_module("tokens", torch::nn::Embedding(vocab_size, c.dim));
  positions_ = register_module("positions", torch::nn::Embedding(c.max_len, c.dim));
  auto layer = torch::nn::TransformerEncoderLayer(torch::nn::TransformerEncoderLayerOptions(c.dim, c.heads)
                                                      .dim_feedforward(c.ffn)
                                                      .dropout(c.dropout)
                                                      .activation(torch::kGELU));
  layers_ = register_module("layers", torch::nn::TransformerEncoder(layer, c.layers));
  norm_ = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
  // Small embeddings: the tied output projection starts near uniform.
  torch::NoGradGuard no_grad;
  tokens_->weight.normal_(0, 0.02);
  positions_->weight.normal_(0, 0.02);
}

at::Tensor MlmEncoderImpl::encode(const at::Tensor& ids) {
  NEBULA_CHECK(ids.dim() == 2 && ids.size(1) <= max_len_, "ids of shape ", ids.sizes(), ", max_len ", max_len_);
  const int64_t seq = ids.size(1);
  at::Tensor pos = at::arange(seq, ids.options());
  at::Tensor x = tokens_(ids) * std::sqrt(static_cast<double>(dim_)) + positions_(pos).unsqueeze(0);
  // torch::nn::TransformerEncoder is sequence-first: [seq, batch, dim].
  at::Tensor pad_mask = ids.eq(pad_id_);
  x = layers_->forward(x.transpose(0, 1), /*src_mask=*/at::Tensor(), /*src_key_padding_mask=*/pad_mask).transpose(0, 1);
  return norm_(x);
}

at::Tensor MlmEncoderImpl::forward(const at::Tensor& ids) {
  return at::matmul(encode(ids), tokens_->weight.t());
}

at::Tensor MlmEncoderImpl::loss(const at::Tensor& ids, const at::Tensor& labels) {
  at::Tensor logits = forward(ids);
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}), /*weight=*/{},
                                at::Reduction::Mean, kIgnoreIndex);
}

}  // namespace nebula::model
