// MlmTask: multilingual pre-training (task.h).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "model/mlm_encoder.h"
#include "model/peft.h"
#include "model/xlingual.h"
#include "parallel/encoder_stage.h"
#include "nebula/error.h"
#include "train/evaluation.h"
#include "train/site_data.h"
#include "train/task.h"

namespace nebula::train {
namespace {

// The task's side of a pipeline stage: the batch (parallel/encoder_stage.h computes).
class MlmStage : public Task::Stage {
 public:
  MlmStage(model::MlmEncoderImpl& model, parallel::Pipeline& pipeline, model::MlmBatcher& batches,
           const parallel::StageKeeper* built)
      : stage(model, pipeline, built), batches_(batches) {}
  Task::Step prepare(int64_t) override {
    model::MlmBatch b = batches_.next();
    stage.set_batch(b.ids, b.labels);
    return {at::Tensor(), static_cast<double>(b.predicted), b.tokens};
  }
  std::vector<at::Tensor> forward(int micro, const std::vector<at::Tensor>& inputs) override {
    return stage.forward(micro, inputs);
  }
  parallel::EncoderStage stage;

 private:
  model::MlmBatcher& batches_;
};

class MlmTask : public Task {
 public:
  explicit MlmTask(const TaskContext& ctx) : ctx_(ctx), c_(ctx.config) {
    const SiteConfig& site = c_.sites[ctx.who.site];
    NEBULA_CHECK(ctx.tokenizer->mask_id() >= 0, ctx.tokenizer_path, " has no <mask> piece: train it with nebula");
    // Data: this site's own sentences, this worker's share of them.
    SiteText text = site_text(ctx);
    auto sequences = encode_all(*ctx.tokenizer, text.train, c_.model.max_len);
    size_t tlm_sequences = 0;
    if (c_.data.objective == "mlm+tlm") {  // XLM's translation LM: the pair in one sequence
      auto tlm = encode_tlm(*ctx.tokenizer, text.train_pairs, c_.model.max_len);
      tlm_sequences = tlm.size();
      sequences.insert(sequences.end(), std::make_move_iterator(tlm.begin()), std::make_move_iterator(tlm.end()));
    }
    const uint64_t stream = batch_seed(c_, ctx.who);
    batches_ = std::make_unique<model::MlmBatcher>(std::move(sequences), ctx.ids, c_.data.mask_prob,
                                                   c_.data.batch_size, stream);
    if (c_.data.contrastive_weight > 0) {  // the site's own training pairs, this worker's share
      std::vector<std::string> en, other;
      for (const auto& p : text.train_pairs)
        if (!p.other.empty()) {
          en.push_back(p.en);
          other.push_back(p.other);
        }
      if (en.empty())
        throw ConfigError(str_cat(c_.source_path, ": data.contrastive_weight = ", c_.data.contrastive_weight,
                                  " needs parallel pairs, and worker ", ctx.who.local_rank, " of site '", site.name,
                                  "' has none (data.source \"", c_.data.source, "\"): set it to 0"));
      pairs_ = std::make_unique<model::PairBatcher>(encode_all(*ctx.tokenizer, en, c_.model.max_len),
                                                    encode_all(*ctx.tokenizer, other, c_.model.max_len),
                                                    ctx.tokenizer->pad_id(), c_.data.contrastive_batch,
                                                    stream ^ 0x9e3779b97f4a7c15ull);
    }
    if (!text.valid.empty())
      valid_ = std::make_unique<model::MlmBatcher>(encode_all(*ctx.tokenizer, text.valid, c_.model.max_len), ctx.ids,
                                                   c_.data.mask_prob, c_.data.batch_size, c_.job.seed);
    spdlog::info("{} training sentences (+ {} translation-LM pairs) / {} validation sentences on this worker",
                 text.train.size(), tlm_sequences, text.valid.size());
    // The gateway evaluates the site's own held-out pairs (cross-lingual accuracy, retrieval).
    if (ctx.who.local_rank == 0) probe_ = std::make_unique<XlingualProbe>(c_, ctx.who.site, *ctx.tokenizer, ctx.ids);

    at::manual_seed(c_.job.seed);  // the same initial weights on every worker
    // Pipeline stages: the other stages' layers let go as each is built (not with PEFT or a
    // model file, which change the model after it is built: built whole, cut by make_stage).
    const parallel::SiteGrid grid = site_grid(c_, site);
    if (grid.pipeline > 1 && c_.peft.kind == "none" && c_.model.init.empty())
      keeper_ = parallel::encoder_keeper(c_.model, ctx.tokenizer->vocab_size(), grid.pipeline,
                                         grid.stage(ctx.who.local_rank));
    {
      model::SinkScope building(keeper_.get());
      model_ = model::MlmEncoder(c_.model, ctx.tokenizer->vocab_size(), ctx.tokenizer->pad_id());
    }
    if (!c_.model.init.empty()) load_pretrained(ctx, *model_, *model_);  // PEFT below freezes it
    // PEFT freezes the backbone (equal on every worker: same seed). Only the trainable
    // parameters are optimized and synchronized, so they alone cross the WAN.
    params_ = model::apply_peft(*model_, c_.peft);
    model_->to(ctx.device);  // in place (the same parameter tensors): the batches follow in MlmEncoder
    spdlog::info("{} trainable of {} parameters{} (peft: {})", model::numel(params_), model::numel(model_->parameters()),
                 keeper_ ? " here (this worker's pipeline stage)" : "", c_.peft.kind);
  }

  torch::nn::Module& module() override { return *model_; }
  std::vector<at::Tensor> trainable() override { return params_; }
  std::vector<torch::nn::Module*> layers() override { return model_->units(); }
  void set_layer_gather(model::LayerGather* gather) override { model_->set_layer_gather(gather); }

  Stage* make_stage(parallel::Pipeline& pipeline) override {
    stage_ = std::make_unique<MlmStage>(*model_, pipeline, *batches_, keeper_.get());
    params_ = stage_->stage.trainable();
    spdlog::info("pipeline stage {} of {}: layers [{}, {}){}{}, {} trainable parameters", pipeline.stage(),
                 pipeline.stages(), stage_->stage.begin(), stage_->stage.end(), pipeline.first() ? ", the embeddings" : "",
                 pipeline.last() ? ", the final norm and the tied projection" : "", model::numel(params_));
    return stage_.get();
  }
  parallel::TensorSplit* split_for_tensor(parallel::SiteTensorGroup& group) override {
    return split_built_in(model_, group, c_.model);
  }
  std::vector<int> tensor_dims() override { return tensor_dims_built_in(model_); }
  std::pair<int64_t, int64_t> model_numel() override {
    if (!stage_) return Task::model_numel();
    return {stage_->stage.staged().whole_numel(false), stage_->stage.staged().whole_numel(true)};
  }
  std::vector<std::vector<int64_t>> trainable_shapes() override {
    return stage_ ? stage_->stage.staged().trainable_shapes() : Task::trainable_shapes();
  }
  std::vector<int64_t> stage_bounds(int stages) override {
    std::vector<int64_t> all, trained;  // per unit, the whole model's (a stage knows the others' shapes)
    if (stage_) {
      all = stage_->stage.staged().unit_numel(false);
      trained = stage_->stage.staged().unit_numel(true);
    } else {
      for (torch::nn::Module* unit : model_->units()) {
        all.push_back(0);
        trained.push_back(0);
        for (const at::Tensor& p : unit->parameters()) {
          all.back() += p.numel();
          if (p.requires_grad()) trained.back() += p.numel();
        }
      }
    }
    const int64_t layer_numel = *std::max_element(all.begin() + 2, all.end() - 1);  // the layers are alike
    return parallel::stage_bounds(trained, parallel::encoder_owners(c_.model, model_->token_embedding()->options.num_embeddings(),
                                                                    layer_numel, stages, all.size()),
                                  stages);
  }
  void with_whole(collective::SiteGroup& group, int replicas, const std::function<void()>& fn,
                  bool everywhere) override {
    if (!stage_) return fn();
    stage_->stage.staged().with_whole(group, site_grid(c_, c_.sites[ctx_.who.site]), replicas, fn, everywhere);
  }

  Step forward(int64_t) override {
    model::MlmBatch b = batches_->next();
    if (!pairs_) return {model_->loss(b.ids, b.labels), static_cast<double>(b.predicted), b.tokens};
    // MLM and the translation ranking in one encoder pass: the three batches, padded on the
    // right to one width (padding changes no real token's hidden state), stacked.
    model::PairBatch p = pairs_->next();
    const int64_t width = std::max({b.ids.size(1), p.en.size(1), p.other.size(1)});
    const int64_t pad = ctx_.tokenizer->pad_id();
    auto widen = [&](const at::Tensor& t) { return at::constant_pad_nd(t, {0, width - t.size(1)}, pad); };
    const at::Tensor ids = at::cat({widen(b.ids), widen(p.en), widen(p.other)});
    const at::Tensor hidden = model_->encode(ids);
    const int64_t n = b.ids.size(0), k = p.en.size(0);
    const at::Tensor labels = at::constant_pad_nd(b.labels, {0, width - b.labels.size(1)}, model::kIgnoreIndex);
    const at::Tensor mlm = model_->masked_loss(hidden.narrow(0, 0, n), labels);
    const at::Tensor en = model_->pool(hidden.narrow(0, n, k), ids.narrow(0, n, k));
    const at::Tensor other = model_->pool(hidden.narrow(0, n + k, k), ids.narrow(0, n + k, k));
    const at::Tensor rank = model::translation_ranking_loss(en, other, c_.data.contrastive_temperature);
    contrastive_sum_ += rank.item<double>();
    ++contrastive_steps_;
    return {mlm + c_.data.contrastive_weight * rank, static_cast<double>(b.predicted),
            b.tokens + p.en.ne(pad).sum().item<int64_t>() + p.other.ne(pad).sum().item<int64_t>()};
  }

  bool has_validation() const override { return valid_ != nullptr; }
  std::pair<double, double> validate(int64_t batches) override {
    if (!valid_) return {0.0, 0.0};
    at::NoGradGuard no_grad;
    model_->eval();
    double loss_sum = 0, predicted = 0;
    for (int64_t i = 0; i < batches; ++i) {
      model::MlmBatch b = valid_->next();
      loss_sum += model_->loss(b.ids, b.labels).item<double>() * static_cast<double>(b.predicted);
      predicted += static_cast<double>(b.predicted);
    }
    model_->train();
    return {loss_sum, predicted};
  }

  size_t eval_size() const override { return XlingualProbe::size(c_); }
  bool eval_at_start() const override { return true; }
  std::vector<double> evaluate() override {
    return probe_ ? probe_->run(*model_) : std::vector<double>(eval_size(), 0.0);
  }
  nlohmann::json eval_json(const std::vector<double>& counts) const override {
    return XlingualProbe::to_json(c_, counts);
  }

  nlohmann::json summary() const override {
    nlohmann::json j = {{"objective", c_.data.objective}, {"peft", c_.peft.kind}};
    if (pairs_)
      j["contrastive"] = {{"weight", c_.data.contrastive_weight},
                          {"pairs", pairs_->size()},
                          {"mean_loss", contrastive_steps_ ? contrastive_sum_ / contrastive_steps_ : 0.0}};
    return j;
  }

  void save_state(parallel::Checkpoint& checkpoint) const override {
    parallel::put_batcher(checkpoint, "train", batches_->state());
    if (pairs_) parallel::put_batcher(checkpoint, "pairs", pairs_->state());
  }
  void load_state(const parallel::Checkpoint& checkpoint) override {
    batches_->restore(parallel::get_batcher(checkpoint, "train"));
    if (pairs_) pairs_->restore(parallel::get_batcher(checkpoint, "pairs"));
  }

  std::map<std::string, std::string> model_metadata() const override {
    auto m = text_model_metadata(ctx_, "mlm_encoder");
    m["peft"] = c_.peft.kind;
    return m;
  }


 private:
  const TaskContext& ctx_;
  const Config& c_;
  std::unique_ptr<model::MlmBatcher> batches_, valid_;
  std::unique_ptr<model::PairBatcher> pairs_;  // data.contrastive_weight > 0: the site's own pairs
  double contrastive_sum_ = 0;                 // the ranking loss summed over this worker's steps
  int64_t contrastive_steps_ = 0;
  std::unique_ptr<XlingualProbe> probe_;
  model::MlmEncoder model_{nullptr};
  std::vector<at::Tensor> params_;
  std::unique_ptr<parallel::StageKeeper> keeper_;  // pipeline stages: what the model was built under
  std::unique_ptr<MlmStage> stage_;                // pipeline stages: this worker's
};

}  // namespace

std::unique_ptr<Task> make_mlm_task(const TaskContext& context) { return std::make_unique<MlmTask>(context); }

}  // namespace nebula::train
