#include "model/classifier.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "nebula/error.h"

namespace nebula::model {

ClassifierImpl::ClassifierImpl(const ModelConfig& config, int64_t vocab_size, int64_t pad_id, int64_t classes)
    : classes_(classes) {
  NEBULA_CHECK(classes >= 2, "a classifier needs 2 or more classes, got ", classes);
  encoder_ = register_module("encoder", MlmEncoder(config, vocab_size, pad_id));
  head_ = register_module("head", torch::nn::Linear(config.dim, classes));
}

at::Tensor ClassifierImpl::forward(const at::Tensor& ids) {
  // The embedding has unit length, so the head's weights alone set how sure it may be.
  return head_(encoder_->embed(ids));
}

at::Tensor ClassifierImpl::loss(const at::Tensor& ids, const at::Tensor& labels) {
  const at::Tensor logits = forward(ids);
  return at::cross_entropy_loss(logits, labels.to(logits.device()));
}

at::Tensor ClassifierImpl::predict(const at::Tensor& ids) {
  at::NoGradGuard no_grad;
  return forward(ids).argmax(-1).cpu();
}

}  // namespace nebula::model
