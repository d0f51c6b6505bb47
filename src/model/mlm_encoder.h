// A small Transformer encoder trained with masked-language modelling (BERT/XLM style):
// token + learned position embeddings → N post-LN encoder layers (model/transformer.h) →
// LayerNorm → vocab logits (the output projection shares the token embedding matrix).
// PEFT (model/peft.h) may freeze most of it afterwards: trainable_parameters() is then what
// the optimizer and the strategy get.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <vector>

#include "model/layer_gather.h"
#include "model/tensor_parallel.h"
#include "model/transformer.h"
#include "nebula/config.h"

namespace nebula::model {

// Label value for positions that carry no loss (not masked, or padding).
constexpr int64_t kIgnoreIndex = -100;

class MlmEncoderImpl : public torch::nn::Module {
 public:
  MlmEncoderImpl(const ModelConfig& config, int64_t vocab_size, int64_t pad_id);

  // ids: [batch, seq] int64. Returns hidden states [batch, seq, dim].
  at::Tensor encode(const at::Tensor& ids);
  // encode() in the parts a pipeline's stages run (parallel/pipeline.h): encode(ids) is
  // final_norm(run_layers(embed_input(ids), ids, 0, layers().size())). embed_input: the token and
  // position embeddings [batch, seq, dim]; run_layers: layers [begin, end) on x (ids: for the
  // padding mask); final_norm: the last LayerNorm.
  at::Tensor embed_input(const at::Tensor& ids);
  at::Tensor run_layers(at::Tensor x, const at::Tensor& ids, size_t begin, size_t end);
  at::Tensor final_norm(const at::Tensor& x);
  // Logits over the vocabulary, [batch, seq, vocab]. Not while split for tensor parallelism
  // (each worker has its vocabulary rows' logits only): run it on the whole model.
  at::Tensor forward(const at::Tensor& ids);
  // Mean cross-entropy over positions whose label != kIgnoreIndex; the vocabulary logits are
  // computed at those positions only (the same value as from forward()'s full logits).
  at::Tensor loss(const at::Tensor& ids, const at::Tensor& labels);
  // The same from encode()'s hidden states (so one encode() can serve several objectives).
  at::Tensor masked_loss(const at::Tensor& hidden, const at::Tensor& labels);
  // Sentence embeddings [batch, dim]: the mean of encode()'s hidden states over the non-pad
  // tokens, scaled to unit length. Differentiable (the contrastive objective trains through it;
  // the retrieval probe uses it under no_grad).
  at::Tensor embed(const at::Tensor& ids);
  // The same from encode(ids)'s hidden states.
  at::Tensor pool(const at::Tensor& hidden, const at::Tensor& ids) const;

  int64_t max_len() const { return max_len_; }
  const ModelConfig& config() const { return config_; }
  // The encoder layers, first to last (PEFT injects LoRA / adapters into them).
  const std::vector<EncoderLayer>& layers() const { return layers_; }
  // The token embedding [vocab, dim] (registered as "tokens"). A Seq2Seq ties its decoder input
  // and output projection to it (embed_tokens, project); copying the holder shares the module,
  // not the weights.
  const torch::nn::Embedding& token_embedding() const { return tokens_; }
  // The token embedding of `ids` scaled by sqrt(dim), and `hidden` [..., dim] projected onto the
  // vocabulary by the tied embedding [..., vocab]: each through the layer gather, so ZeRO-3
  // gathers the embedding only while one of them runs. Split for tensor parallelism, project()
  // gives this worker's vocabulary rows' logits [..., vocab_rows().size()].
  at::Tensor embed_tokens(const at::Tensor& ids);
  at::Tensor project(const at::Tensor& hidden);
  // What ZeRO-3 cuts into units and gathers where they run (model/layer_gather.h), in parameter
  // order: the token and position embeddings, every layer, the final norm.
  std::vector<torch::nn::Module*> units() const;
  // The parameters with requires_grad, in parameters() order (deterministic: registration
  // order). Without PEFT that is all of them.
  std::vector<at::Tensor> trainable_parameters() const;

  // ZeRO-3 (model/layer_gather.h): encode() runs each unit through `gather` (null: directly).
  // Not owned; it must outlive its use.
  void set_layer_gather(LayerGather* gather) { gather_ = gather; }

  // Tensor parallelism (model/tensor_parallel.h): keeps this worker's slices of every layer and
  // its rows of the token embedding (vocabulary-parallel; the tied projection and the loss
  // follow), computing with `group` from then on; the position embeddings and the norms stay
  // whole. Returns the slices (parameter, dimension, range). Not with ZeRO-3 or PEFT.
  std::vector<TensorSlice> split_for_tensor(TensorGroup& group);
  // The group the model computes with (null: whole here for a while: its slices gathered).
  void set_tensor_group(TensorGroup* group);
  // This worker's rows of the vocabulary once split (all of them before).
  SliceRange vocab_rows() const { return vocab_; }

 private:
  ModelConfig config_;
  int64_t pad_id_, max_len_, dim_, vocab_size_;
  LayerGather* gather_ = nullptr;
  TensorGroup* tensor_ = nullptr;  // not owned
  SliceRange vocab_;
  torch::nn::Embedding tokens_{nullptr}, positions_{nullptr};
  std::vector<EncoderLayer> layers_;  // registered as "layers.<i>"
  torch::nn::LayerNorm norm_{nullptr};
};
TORCH_MODULE(MlmEncoder);

}  // namespace nebula::model
