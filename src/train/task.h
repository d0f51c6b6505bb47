// What a worker trains: the model, its batches and loss, its evaluation. The training loop
// (worker.cc) is the same for every task; a Task supplies the parts that differ.
//
//   mlm_encoder  MlmTask          masked (and translation) language modelling; cross-lingual
//                                 evaluation (MLM accuracy, retrieval) per language
//   seq2seq      TranslationTask  English→X translation, optionally distilled from a teacher on
//                                 another site ([distill]); BLEU on the site's test pairs
//   classifier   ClassifierTask   zero-shot cross-lingual transfer: which package a gettext
//                                 message is from, trained in English, scored in every language
//   torchscript  ScriptTask       the user's own TorchScript module on the site's tensor files
//
// A task lives on one worker thread (not thread-safe). Evaluation counts are plain numbers
// so that every site's gateway can evaluate its own held-out data and the job sums them.
#pragma once

#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "model/layer_gather.h"
#include "model/mlm_batch.h"
#include "model/mlm_encoder.h"
#include "nebula/config.h"
#include "parallel/checkpoint.h"
#include "parallel/pipeline.h"
#include "parallel/tensor_parallel.h"
#include "train/site_data.h"
#include "train/worker.h"
#include "transport/link.h"

namespace nebula::train {

struct TaskContext {
  const Config& config;
  WorkerIdentity who;
  std::optional<data::Tokenizer> tokenizer;  // none for torchscript (it reads tensors)
  std::string tokenizer_path;
  model::SpecialIds ids;
  at::Device device = at::kCPU;  // the site's device for this worker (a task moves its model there)
  // Text tasks: this worker's share of its site's data, read before the worker joins its site
  // and the WAN (so a site without data fails alone, saying why, instead of leaving the other
  // sites to report a lost peer). Taken by site_text().
  std::shared_ptr<SiteText> text;
};

// The worker's share of its site's text, moved out of what task_context read (once).
SiteText site_text(const TaskContext& ctx);

// The seed of this worker's training batch order. It is keyed by the site's name and the
// worker's rank, not by the site's index in [[sites]], so a site draws the same batches in any
// job it is part of: the demo's plain student (a one-site job) and its distilled twin (the
// second site of a two-site job) see the same batches in the same order.
uint64_t batch_seed(const Config& config, const WorkerIdentity& who);

// A site's workers as a data × pipeline × tensor grid ([parallel] pipeline, tensor); and a
// worker's data replica: the share of the site's data it trains on (every stage and slice of one
// replica the same share, drawn in the same order), its rank without stages and slices.
parallel::SiteGrid site_grid(const Config& config, const SiteConfig& site);
WorkerIdentity data_replica(const Config& config, const WorkerIdentity& who);

class Task {
 public:
  virtual ~Task() = default;

  virtual torch::nn::Module& module() = 0;
  // The whole model's parameter values and of them the trainable ones, whatever this worker
  // holds (pipeline stages: every stage's).
  virtual std::pair<int64_t, int64_t> model_numel();
  // What the optimizer and the strategy get (PEFT: the unfrozen part).
  virtual std::vector<at::Tensor> trainable() = 0;
  // ZeRO-3 ([parallel] shard = "full", parallel/full_shard.h): the modules the model runs through
  // a model::LayerGather (the built-in models' units: embeddings, layers, norms), and the setter
  // (null: run them directly). Empty: the model cannot (a user's TorchScript module).
  virtual std::vector<torch::nn::Module*> layers() { return {}; }
  virtual void set_layer_gather(model::LayerGather* gather) {}

  struct Step {
    at::Tensor loss;      // to call backward() on
    double weight = 0;    // loss terms (predicted tokens): the worker's weight in the global mean
    int64_t tokens = 0;   // input tokens processed
  };
  // Pipeline parallelism ([parallel] pipeline > 1): what this worker's stage computes for each
  // micro-batch of a step (parallel::StageModel), and the step's batch.
  class Stage : public parallel::StageModel {
   public:
    // Draws step `step`'s batch (every stage of a pipeline draws the same one) and cuts it into
    // the pipeline's micro-batches. Returns the step's weight and tokens (no loss yet).
    virtual Step prepare(int64_t step) = 0;
  };
  // Cuts the model into `pipeline`'s stages (parallel::balance_stages), lets go of the other
  // stages' parameters, ties what two stages share (Pipeline::tie) and returns this worker's
  // stage; trainable() is the stage's from then on. Once, before the strategy is made. Null:
  // this task's model cannot be cut (the config check refuses it first).
  virtual Stage* make_stage(parallel::Pipeline& pipeline) { return nullptr; }
  // Tensor parallelism ([parallel] tensor > 1): splits every layer over `group` (this worker
  // keeps its slices, parallel/tensor_parallel.h); trainable() is them from then on, while
  // model_numel() and trainable_shapes() stay the whole model's. Once, before the strategy is
  // made. Null: this task's model cannot be split (the config check refuses it first).
  virtual parallel::TensorSplit* split_for_tensor(parallel::SiteTensorGroup& group) { return nullptr; }
  // Each trainable parameter's dimension a tensor split cuts (0 rows, 1 columns, -1 whole), in
  // trainable_shapes()' order, whether or not this worker's model is split: every site can tell
  // a site of slices' SliceLayout. Empty: this task's model cannot be split.
  virtual std::vector<int> tensor_dims() { return {}; }
  // The flat vector the sites exchange, whatever this worker holds: the shapes of the whole
  // model's trainable parameters in order (with stages: every stage's; with slices: whole).
  virtual std::vector<std::vector<int64_t>> trainable_shapes() {
    if (tensor_split_) return tensor_split_->whole_shapes();
    std::vector<std::vector<int64_t>> shapes;
    for (const at::Tensor& p : trainable()) shapes.push_back(p.sizes().vec());
    return shapes;
  }
  // Where each of `stages` stages' values would lie in it (StagedModel's cut; every site can tell
  // every other's); empty: the model is not cut into stages.
  virtual std::vector<int64_t> stage_bounds(int /*stages*/) { return {}; }
  // With stages: fn() with the whole model on the first-stage worker of replicas [0, replicas)
  // (replica 0's is the gateway: its evaluation and the model file; every replica's: each
  // validates its own share), run there only or, `everywhere`, on every worker; a site collective
  // (parallel::StagedModel::with_whole). Without stages: fn().
  virtual void with_whole(collective::SiteGroup& group, int replicas, const std::function<void()>& fn,
                          bool everywhere = false) {
    fn();
  }
  // The forward pass of step `step` (0-based) on the next batch.
  virtual Step forward(int64_t step) = 0;
  // Loss sum and weight over `batches` fixed held-out batches of this worker's share.
  virtual std::pair<double, double> validate(int64_t batches) = 0;
  // Whether validate() runs the model (false: this worker's share has no held-out data).
  virtual bool has_validation() const { return true; }

  // Evaluation on the gateway (local rank 0) of each site: eval_size() counts, the same on
  // every worker; the job sums them and eval_json() turns the sums into summary values.
  virtual size_t eval_size() const { return 0; }
  virtual bool eval_at_start() const { return false; }
  virtual std::vector<double> evaluate() { return std::vector<double>(eval_size(), 0.0); }
  virtual nlohmann::json eval_json(const std::vector<double>& counts) const { return nlohmann::json::object(); }

  // Checkpoints: what the task needs besides the weights to continue exactly where it was
  // (data position, generators). The worker saves module() and the optimizer itself.
  virtual void save_state(parallel::Checkpoint& checkpoint) const = 0;
  virtual void load_state(const parallel::Checkpoint& checkpoint) = 0;

  // After the last step (e.g. the distillation client says goodbye).
  virtual void finish() {}
  // Task-specific summary.json entries from this worker (the writer's) view.
  virtual nlohmann::json summary() const { return nlohmann::json::object(); }
  // The model file's metadata: its kind and shape, for whoever loads it.
  virtual std::map<std::string, std::string> model_metadata() const = 0;
  // Writes the trained model into run_dir (the first live site's gateway, at the end):
  // model.safetensors (module() and `metadata`); a task may add its own format next to it.
  virtual void save_model(const std::string& run_dir, const std::map<std::string, std::string>& metadata);

 protected:
  // split_for_tensor for a built-in model (an MlmEncoder or Seq2Seq holder): cuts it over
  // `group`, the whole model's counts and shapes kept for model_numel() and trainable_shapes().
  template <typename Holder>
  parallel::TensorSplit* split_built_in(Holder model, parallel::SiteTensorGroup& group, const ModelConfig& config) {
    const std::pair<int64_t, int64_t> whole = model_numel();
    std::vector<std::vector<int64_t>> shapes = trainable_shapes();
    tensor_split_ = std::make_unique<parallel::TensorSplit>(
        model->split_for_tensor(group), [model](model::TensorGroup* g) mutable { model->set_tensor_group(g); }, group,
        whole, std::move(shapes));
    log_tensor_slice(config, group, trainable(), whole.second);
    return tensor_split_.get();
  }
  // tensor_dims for a built-in model: the split's, or, not split, those of a split over one
  // worker (which cuts nothing) undone at once.
  template <typename Holder>
  std::vector<int> tensor_dims_built_in(Holder model) {
    if (tensor_split_) return tensor_split_->dims(trainable());
    parallel::OneWorkerTensorGroup one;
    const std::vector<model::TensorSlice> slices = model->split_for_tensor(one);
    model->set_tensor_group(nullptr);
    return parallel::slice_dims(slices, trainable());
  }
  std::unique_ptr<parallel::TensorSplit> tensor_split_;  // split_built_in's

 private:
  static void log_tensor_slice(const ModelConfig& config, const model::TensorGroup& group,
                               const std::vector<at::Tensor>& here, int64_t whole_trainable);
};

// model.init: copies a trained model's model.safetensors in. A model of the job's own kind
// (model.kind) goes into `whole`; a pre-trained mlm_encoder into `encoder` (the encoder of a
// seq2seq or classifier; for an mlm_encoder job the two are one). DataError naming the file
// for another kind of model, or one trained with another vocabulary size than the context's
// tokenizer. Call it before PEFT, which then freezes what was loaded. Returns the file's kind.
std::string load_pretrained(const TaskContext& context, torch::nn::Module& whole, model::MlmEncoderImpl& encoder);

// A text model file's metadata (Task::model_metadata): format, `kind`, the [model] shape, the
// vocabulary's size and the tokenizer's absolute path; a task adds its own keys.
std::map<std::string, std::string> text_model_metadata(const TaskContext& context, const std::string& kind);

std::unique_ptr<Task> make_mlm_task(const TaskContext& context);
std::unique_ptr<Task> make_classifier_task(const TaskContext& context);
// `teacher`: the link to the teacher site with [distill] (on the gateway; not owned), else null.
std::unique_ptr<Task> make_translation_task(const TaskContext& context, transport::Link* teacher);
std::unique_ptr<Task> make_script_task(const TaskContext& context);

// The teacher site of a [distill] job: loads config.distill.teacher and answers the student
// site's requests (distill::serve_teacher) until it says goodbye.
void run_teacher(const TaskContext& context);

}  // namespace nebula::train
