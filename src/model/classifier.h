// A sentence classifier on the pre-trained encoder: MlmEncoder → mean-pooled, unit-length
// sentence embedding (MlmEncoderImpl::embed) → a linear layer to one logit per class. Used for
// zero-shot cross-lingual transfer (train/classifier_task.cc): fine-tuned on English sentences,
// evaluated on their translations. Registered as "encoder" (the MlmEncoder's own names below
// it, so a pre-trained mlm_encoder's model.safetensors loads into it) and "head".
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include "model/mlm_encoder.h"

namespace nebula::model {

class ClassifierImpl : public torch::nn::Module {
 public:
  ClassifierImpl(const ModelConfig& config, int64_t vocab_size, int64_t pad_id, int64_t classes);

  // ids: [batch, seq] int64. Returns logits [batch, classes].
  at::Tensor forward(const at::Tensor& ids);
  // Mean cross-entropy against labels [batch] (class indices).
  at::Tensor loss(const at::Tensor& ids, const at::Tensor& labels);
  // Per sentence, the index of the largest logit, [batch] int64 on the CPU.
  at::Tensor predict(const at::Tensor& ids);

  MlmEncoder& encoder() { return encoder_; }
  int64_t classes() const { return classes_; }

 private:
  int64_t classes_;
  MlmEncoder encoder_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(Classifier);

}  // namespace nebula::model
