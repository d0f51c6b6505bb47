#include "parallel/encoder_stage.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>

#include "model/peft.h"
#include "nebula/error.h"

namespace nebula::parallel {

std::vector<int64_t> encoder_cuts(const ModelConfig& c, int64_t vocab_size, int64_t layer_numel, int stages) {
  return balance_stages(std::vector<int64_t>(static_cast<size_t>(c.layers), layer_numel),
                        (vocab_size + c.max_len) * c.dim, 2 * c.dim, stages);
}

std::vector<int> encoder_owners(const ModelConfig& c, int64_t vocab_size, int64_t layer_numel, int stages,
                                size_t units) {
  NEBULA_CHECK(units == static_cast<size_t>(c.layers) + 3, units, " units for an encoder of ", c.layers, " layers");
  const std::vector<int64_t> cuts = encoder_cuts(c, vocab_size, layer_numel, stages);
  std::vector<int> owner(units, 0);
  for (int s = 0; s < stages; ++s)
    for (int64_t i = cuts[static_cast<size_t>(s)]; i < cuts[static_cast<size_t>(s) + 1]; ++i)
      owner[static_cast<size_t>(2 + i)] = s;
  owner.back() = stages - 1;
  return owner;
}

std::unique_ptr<StageKeeper> encoder_keeper(const ModelConfig& c, int64_t vocab_size, int stages, int stage) {
  // MlmEncoder builds its layers first, then the token embedding, the position embedding and the
  // final norm (model::layer_built after each).
  auto cuts = std::make_shared<std::vector<int64_t>>();
  return std::make_unique<StageKeeper>([=, &c](size_t i, torch::nn::Module& layer) {
    const auto layers = static_cast<size_t>(c.layers);
    if (i < layers) {
      if (cuts->empty()) *cuts = encoder_cuts(c, vocab_size, model::numel(layer.parameters()), stages);
      return (*cuts)[static_cast<size_t>(stage)] <= static_cast<int64_t>(i) &&
             static_cast<int64_t>(i) < (*cuts)[static_cast<size_t>(stage) + 1];
    }
    if (i == layers) return stage == 0 || stage + 1 == stages;  // tokens: the last stage's tied copy too
    if (i == layers + 1) return stage == 0;                     // positions
    return stage + 1 == stages;                                 // the final norm
  });
}

EncoderStage::EncoderStage(model::MlmEncoderImpl& model, Pipeline& pipeline, const StageKeeper* built)
    : model_(model), pipeline_(pipeline) {
  // Units in parameter order: the token and position embeddings, every layer, the final norm.
  const std::vector<torch::nn::Module*> units = model.units();
  int64_t layer_numel = 0;  // the layers are alike: any this worker holds (every stage holds one)
  for (const auto& layer : model.layers()) layer_numel = std::max(layer_numel, model::numel(layer->parameters()));
  const std::vector<int64_t> cuts =
      encoder_cuts(model.config(), model.token_embedding()->options.num_embeddings(), layer_numel, pipeline.stages());
  const std::vector<int> owner = encoder_owners(model.config(), model.token_embedding()->options.num_embeddings(),
                                                layer_numel, pipeline.stages(), units.size());
  // The last stage projects onto the vocabulary with the first stage's token embedding.
  staged_ = std::make_unique<StagedModel>(units, owner, pipeline.stage(),
                                          pipeline.last() ? std::vector<size_t>{0} : std::vector<size_t>{}, built);
  pipeline.tie(model.token_embedding()->weight, 0, pipeline.stages() - 1);
  begin_ = cuts[static_cast<size_t>(pipeline.stage())];
  end_ = cuts[static_cast<size_t>(pipeline.stage()) + 1];
}

void EncoderStage::set_batch(const at::Tensor& ids, const at::Tensor& labels) {
  NEBULA_CHECK(ids.dim() == 2 && ids.sizes() == labels.sizes() && ids.size(0) >= pipeline_.micro_batches(),
               "a batch of shape ", ids.sizes(), " (labels ", labels.sizes(), ") for ", pipeline_.micro_batches(),
               " micro-batches");
  ids_ = ids.tensor_split(pipeline_.micro_batches());
  labels_ = labels.tensor_split(pipeline_.micro_batches());
  predicted_ = labels.ne(model::kIgnoreIndex).sum().item<int64_t>();
}

std::vector<at::Tensor> EncoderStage::forward(int micro, const std::vector<at::Tensor>& inputs) {
  const at::Tensor& ids = ids_.at(static_cast<size_t>(micro));
  at::Tensor x = pipeline_.first() ? model_.embed_input(ids) : inputs.at(0);
  x = model_.run_layers(x, ids, static_cast<size_t>(begin_), static_cast<size_t>(end_));
  if (!pipeline_.last()) return {x};
  const at::Tensor& labels = labels_.at(static_cast<size_t>(micro));
  const int64_t predicted = labels.ne(model::kIgnoreIndex).sum().item<int64_t>();
  x = model_.final_norm(x);
  if (predicted == 0) return {x.sum() * 0.0};  // nothing to predict here; every stage still runs its backward
  return {model_.masked_loss(x, labels) * (static_cast<double>(predicted) / static_cast<double>(predicted_))};
}

}  // namespace nebula::parallel
