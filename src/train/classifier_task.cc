// ClassifierTask: zero-shot cross-lingual transfer (task.h). Which software package a
// message belongs to, learned from English messages only and evaluated on held-out messages'
// translations in every language of data.languages (site_data.h, split_transfer_messages):
// the analogue, on this machine's gettext catalogs, of the XNLI transfer that multilingual
// encoders are judged by. With model.init the encoder starts from a pre-training run's
// model.safetensors; without it, from random weights (the baseline the transfer must beat).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <spdlog/spdlog.h>

#include <numeric>

#include "model/classifier.h"
#include "model/mlm_batch.h"
#include "nebula/error.h"
#include "train/site_data.h"
#include "train/task.h"

namespace nebula::train {
namespace {

struct Encoded {
  std::vector<std::vector<int>> ids;
  std::vector<int64_t> labels;
};

Encoded encode_labelled(const data::Tokenizer& tok, const TransferData::Labelled& in, int64_t max_len) {
  Encoded out;
  std::vector<std::string> texts;
  for (const auto& [text, label] : in) {
    texts.push_back(text);
    out.labels.push_back(label);
  }
  out.ids = encode_all(tok, texts, max_len);
  return out;
}

class ClassifierTask : public Task {
 public:
  explicit ClassifierTask(const TaskContext& ctx) : ctx_(ctx), c_(ctx.config) {
    const SiteConfig& site = c_.sites[ctx.who.site];
    const TransferData data = load_transfer_data(c_, ctx.who.site);
    // This worker's share of the site's English training messages.
    TransferData::Labelled mine;
    for (size_t i = static_cast<size_t>(ctx.who.local_rank); i < data.train.size(); i += static_cast<size_t>(site.workers))
      mine.push_back(data.train[i]);
    if (mine.empty())
      throw DataError(str_cat("site '", site.name, "' worker ", ctx.who.local_rank, ": no English training message of ",
                              "every package in its share (data.packages: ", c_.data.packages.size(), " packages, ",
                              data.train.size(), " balanced training messages on the site); choose larger packages"));
    train_ = encode_labelled(*ctx.tokenizer, mine, c_.model.max_len);
    valid_ = encode_labelled(*ctx.tokenizer, data.valid, c_.model.max_len);
    passes_ = std::make_unique<model::ShuffledPasses>(train_.ids.size(), batch_seed(c_, ctx.who));
    if (ctx.who.local_rank == 0)
      for (const std::string& slot : slot_names()) test_.push_back(encode_labelled(*ctx.tokenizer, data.test.at(slot), c_.model.max_len));
    spdlog::info("{} English training messages of {} packages on this worker; {} validation; held out: {}", mine.size(),
                 c_.data.packages.size(), data.valid.size(), held_out_summary(data));

    at::manual_seed(c_.job.seed);  // the same initial weights on every worker
    model_ = model::Classifier(c_.model, ctx.tokenizer->vocab_size(), ctx.tokenizer->pad_id(),
                               static_cast<int64_t>(c_.data.packages.size()));
    if (!c_.model.init.empty()) load_pretrained(ctx, *model_, *model_->encoder());
    // model.freeze_encoder: a linear probe. The encoder stays as pre-trained (its languages stay
    // aligned: fine-tuning it on English alone pulls English away from the others); only the
    // head learns, and only it crosses the WAN.
    if (c_.model.freeze_encoder)
      for (auto& p : model_->encoder()->parameters()) p.set_requires_grad(false);
    for (const auto& p : model_->parameters())
      if (p.requires_grad()) params_.push_back(p);
    model_->to(ctx.device);  // in place: params_ stay the module's tensors
  }

  torch::nn::Module& module() override { return *model_; }
  std::vector<at::Tensor> trainable() override { return params_; }
  std::vector<torch::nn::Module*> layers() override { return model_->encoder()->units(); }
  void set_layer_gather(model::LayerGather* gather) override { model_->encoder()->set_layer_gather(gather); }

  Step forward(int64_t) override {
    std::vector<std::vector<int>> ids;
    std::vector<int64_t> labels;
    for (int64_t i = 0; i < c_.data.batch_size; ++i) {
      const size_t k = passes_->next();
      ids.push_back(train_.ids[k]);
      labels.push_back(train_.labels[k]);
    }
    const at::Tensor batch = model::pad_sequences(ids, ctx_.tokenizer->pad_id());
    const int64_t tokens = batch.ne(ctx_.tokenizer->pad_id()).sum().item<int64_t>();
    return {model_->loss(batch, at::tensor(labels)), static_cast<double>(ids.size()), tokens};
  }

  bool has_validation() const override { return !valid_.ids.empty(); }
  std::pair<double, double> validate(int64_t batches) override {
    at::NoGradGuard no_grad;
    model::EvalModeGuard eval(*model_);
    double loss_sum = 0, count = 0;
    const size_t b = static_cast<size_t>(c_.data.batch_size);
    for (size_t at = 0; at < valid_.ids.size() && at < static_cast<size_t>(batches) * b; at += b) {
      const size_t end = std::min(valid_.ids.size(), at + b);
      const at::Tensor ids = model::pad_sequences(valid_.ids, ctx_.tokenizer->pad_id(), at, end);
      const at::Tensor labels = at::tensor(std::vector<int64_t>(valid_.labels.begin() + static_cast<std::ptrdiff_t>(at),
                                                                valid_.labels.begin() + static_cast<std::ptrdiff_t>(end)));
      loss_sum += model_->loss(ids, labels).item<double>() * static_cast<double>(end - at);
      count += static_cast<double>(end - at);
    }
    return {loss_sum, count};
  }

  // Per slot ("en", then data.languages): correct, total.
  size_t eval_size() const override { return 2 * slot_names().size(); }
  bool eval_at_start() const override { return true; }
  std::vector<double> evaluate() override {
    std::vector<double> out(eval_size(), 0.0);
    if (test_.empty()) return out;  // not the gateway
    model::EvalModeGuard eval(*model_);
    for (size_t s = 0; s < test_.size(); ++s) {
      const Encoded& t = test_[s];
      for (size_t at = 0; at < t.ids.size(); at += 64) {
        const size_t end = std::min(t.ids.size(), at + 64);
        const at::Tensor predicted = model_->predict(model::pad_sequences(t.ids, ctx_.tokenizer->pad_id(), at, end));
        for (size_t i = at; i < end; ++i) out[2 * s] += predicted[static_cast<int64_t>(i - at)].item<int64_t>() == t.labels[i];
      }
      out[2 * s + 1] = static_cast<double>(t.ids.size());
    }
    return out;
  }
  nlohmann::json eval_json(const std::vector<double>& counts) const override {
    nlohmann::json j = nlohmann::json::object();
    const auto names = slot_names();
    for (size_t s = 0; s < names.size(); ++s)
      j[names[s]] = {{"accuracy", counts[2 * s + 1] > 0 ? counts[2 * s] / counts[2 * s + 1] : 0.0},
                     {"messages", counts[2 * s + 1]}};
    return j;
  }

  nlohmann::json summary() const override {
    return {{"packages", c_.data.packages},
            {"chance", 1.0 / static_cast<double>(c_.data.packages.size())},
            {"init", c_.model.init.empty() ? "random" : c_.model.init},
            {"freeze_encoder", c_.model.freeze_encoder},
            {"train_messages_this_worker", train_.ids.size()}};
  }

  void save_state(parallel::Checkpoint& checkpoint) const override { parallel::put_batcher(checkpoint, "train", passes_->state()); }
  void load_state(const parallel::Checkpoint& checkpoint) override { passes_->restore(parallel::get_batcher(checkpoint, "train")); }

  std::map<std::string, std::string> model_metadata() const override {
    std::string packages;
    for (const auto& p : c_.data.packages) packages += (packages.empty() ? "" : ",") + p;
    auto m = text_model_metadata(ctx_, "classifier");
    m["packages"] = packages;
    return m;
  }


 private:
  std::vector<std::string> slot_names() const {
    std::vector<std::string> names = {"en"};
    names.insert(names.end(), c_.data.languages.begin(), c_.data.languages.end());
    return names;
  }
  std::string held_out_summary(const TransferData& d) const {
    std::string s;
    for (const auto& name : slot_names()) s += str_cat(s.empty() ? "" : ", ", name, " ", d.test.at(name).size());
    return s;
  }

  const TaskContext& ctx_;
  const Config& c_;
  Encoded train_, valid_;
  std::vector<Encoded> test_;  // the gateway's: per slot
  std::unique_ptr<model::ShuffledPasses> passes_;
  model::Classifier model_{nullptr};
  std::vector<at::Tensor> params_;  // what trains: all of it, or the head (model.freeze_encoder)
};

}  // namespace

std::unique_ptr<Task> make_classifier_task(const TaskContext& context) {
  return std::make_unique<ClassifierTask>(context);
}

}  // namespace nebula::train
