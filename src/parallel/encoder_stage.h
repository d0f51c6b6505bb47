// The MLM encoder (model/mlm_encoder.h) cut into pipeline stages (parallel/pipeline.h): layers
// [begin, end) on each stage, balanced by parameter count, with the token and position
// embeddings on the first stage and the final norm and the tied projection (the loss) on the
// last, which holds a copy of the token embedding (Pipeline::tie). The batch is cut by rows;
// each micro-batch's loss is its masked-token mean scaled by its share of the batch's masked
// tokens, so the M losses sum to the batch's mean, as one worker running the whole batch has it.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

#include "model/mlm_encoder.h"
#include "parallel/pipeline.h"

namespace nebula::parallel {

// The cut: layers [cuts[s], cuts[s + 1]) on stage s of `stages` (balance_stages by parameter
// count: every layer `layer_numel` values (the encoder's layers are alike), the token and
// position embeddings on the first stage, the final norm on the last).
std::vector<int64_t> encoder_cuts(const ModelConfig& config, int64_t vocab_size, int64_t layer_numel, int stages);

// Which stage trains each of the encoder's `units` (MlmEncoder::units(): the token and position
// embeddings, every layer, the final norm) under encoder_cuts.
std::vector<int> encoder_owners(const ModelConfig& config, int64_t vocab_size, int64_t layer_numel, int stages,
                                size_t units);

// The keeper to build the encoder under (model::SinkScope) on a worker of stage `stage`: the
// layers of the other stages are let go as soon as each is built (the cut from the first layer's
// size), so the model is never whole on this worker. Not for a model that is changed after it is
// built (PEFT, model.init): build that whole and let EncoderStage cut it.
std::unique_ptr<StageKeeper> encoder_keeper(const ModelConfig& config, int64_t vocab_size, int stages, int stage);

class EncoderStage : public StageModel {
 public:
  // Cuts `model` (built from the job's seed, whole or under `built`, encoder_keeper's) for
  // `pipeline`: lets go of the other stages' parameters and ties the token embedding. All must
  // outlive this.
  EncoderStage(model::MlmEncoderImpl& model, Pipeline& pipeline, const StageKeeper* built = nullptr);

  // This step's batch ([batch, seq] ids and labels, model::kIgnoreIndex where no loss), cut by
  // rows into the pipeline's micro-batches (at least one row each: batch >= M).
  void set_batch(const at::Tensor& ids, const at::Tensor& labels);
  std::vector<at::Tensor> forward(int micro, const std::vector<at::Tensor>& inputs) override;

  // This stage's layers, and what its optimizer and strategy get.
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  std::vector<at::Tensor> trainable() const { return staged_->trainable(); }
  StagedModel& staged() { return *staged_; }

 private:
  model::MlmEncoderImpl& model_;
  const Pipeline& pipeline_;
  std::unique_ptr<StagedModel> staged_;
  int64_t begin_ = 0, end_ = 0;
  std::vector<at::Tensor> ids_, labels_;  // this step's micro-batches
  int64_t predicted_ = 0;                 // the batch's masked tokens
};

}  // namespace nebula::parallel
