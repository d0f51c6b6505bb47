// A small Transformer encoder trained with masked-language modelling (BERT/XLM style):
// token + learned position embeddings → N post-LN encoder layers → LayerNorm → vocab logits
// (the output projection shares the token embedding matrix).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/transformercoder.h>
#include <torch/nn/modules/transformerlayer.h>

#include "nebula/config.h"

namespace nebula::model {

// Label value for positions that carry no loss (not masked, or padding).
constexpr int64_t kIgnoreIndex = -100;

class MlmEncoderImpl : public torch::nn::Module {
 public:
  MlmEncoderImpl(const ModelConfig& config, int64_t vocab_size, int64_t pad_id);

  // ids: [batch, seq] int64. Returns hidden states [batch, seq, dim].
  at::Tensor encode(const at::Tensor& ids);
  // Logits over the vocabulary, [batch, seq, vocab].
  at::Tensor forward(const at::Tensor& ids);
  // Mean cross-entropy over positions whose label != kIgnoreIndex.
  at::Tensor loss(const at::Tensor& ids, const at::Tensor& labels);

  int64_t max_len() const { return max_len_; }

 private:
  int64_t pad_id_, max_len_, dim_;
  torch::nn::Embedding tokens_{nullptr}, positions_{nullptr};
  torch::nn::TransformerEncoder layers_{nullptr};
  torch::nn::LayerNorm norm_{nullptr};
};
TORCH_MODULE(MlmEncoder);

}  // namespace nebula::model
