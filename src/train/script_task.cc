// ScriptTask: the user's own TorchScript module on the site's tensor files (task.h,
// model/script_model.h, site_data.h's load_site_tensors).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <spdlog/spdlog.h>

#include <filesystem>

#include "model/mlm_batch.h"
#include "model/safetensors.h"
#include "model/script_model.h"
#include "train/site_data.h"
#include "train/task.h"

namespace nebula::train {
namespace {

class ScriptTask : public Task {
 public:
  explicit ScriptTask(const TaskContext& ctx)
      : c_(ctx.config),
        model_(model::ScriptModel::load(c_.model.script)),
        data_(load_site_tensors(c_, ctx.who.site, ctx.who.local_rank,
                                static_cast<int>(c_.sites[ctx.who.site].workers))),
        passes_(static_cast<size_t>(data_.train_rows()),
                batch_seed(c_, ctx.who)) {
    at::manual_seed(c_.job.seed);  // the module's own random ops (dropout)
    model_.to(ctx.device);
    model_.train(true);
    params_ = model_.trainable();
    int64_t n = 0;
    for (const auto& p : params_) n += p.numel();
    spdlog::info("{}: {} trainable parameters; {} training / {} held-out rows on this worker from {} file(s)",
                 c_.model.script, n, data_.train_rows(), data_.valid_rows(), data_.files.size());
    if (params_.empty())
      throw DataError(str_cat(c_.model.script, ": the module has no parameter that requires a gradient: nothing to train"));
  }

  torch::nn::Module& module() override { return model_.module(); }
  std::vector<at::Tensor> trainable() override { return params_; }

  Step forward(int64_t) override {
    std::vector<int64_t> rows(static_cast<size_t>(c_.data.batch_size));
    for (auto& r : rows) r = static_cast<int64_t>(passes_.next());
    const at::Tensor index = at::tensor(rows, at::kLong);
    return step_on(data_.train_inputs, data_.train_targets, index);
  }

  // The held-out rows in order, batch after batch (wrapping around).
  std::pair<double, double> validate(int64_t batches) override {
    const int64_t n = data_.valid_rows();
    if (n == 0) return {0.0, 0.0};
    at::NoGradGuard no_grad;
    model_.train(false);
    double loss_sum = 0, weight = 0;
    for (int64_t b = 0; b < batches; ++b) {
      const at::Tensor index = at::arange(b * c_.data.batch_size, (b + 1) * c_.data.batch_size, at::kLong) % n;
      Step s = step_on(data_.valid_inputs, data_.valid_targets, index);
      loss_sum += s.loss.item<double>() * s.weight;
      weight += s.weight;
    }
    model_.train(true);
    return {loss_sum, weight};
  }

  void save_state(parallel::Checkpoint& checkpoint) const override { parallel::put_batcher(checkpoint, "train", passes_.state()); }
  void load_state(const parallel::Checkpoint& checkpoint) override { passes_.restore(parallel::get_batcher(checkpoint, "train")); }

  nlohmann::json summary() const override {
    return {{"torchscript", std::filesystem::absolute(c_.job.run_dir + "/model.pt").string()},
            {"loss_kind", c_.model.loss}};
  }
  std::map<std::string, std::string> model_metadata() const override {
    return {{"format", "nebula"},
            {"kind", "torchscript"},
            {"script", std::filesystem::absolute(c_.model.script).string()},
            {"loss", c_.model.loss}};
  }
  // model.safetensors as for every task, and the trained module as TorchScript (model.pt).
  void save_model(const std::string& run_dir, const std::map<std::string, std::string>& metadata) override {
    Task::save_model(run_dir, metadata);
    model_.save(run_dir + "/model.pt");
  }

 private:
  // The loss on rows `index` of `inputs` / `targets`, on the model's device.
  Step step_on(const std::vector<at::Tensor>& all_inputs, const at::Tensor& all_targets, const at::Tensor& index) {
    std::vector<at::Tensor> inputs;
    for (const auto& x : all_inputs) inputs.push_back(x.index_select(0, index).to(model_.device()));
    const at::Tensor targets = all_targets.index_select(0, index).to(model_.device());
    const at::Tensor& first = inputs[0];
    const bool ids = !at::isFloatingType(first.scalar_type());  // token ids: every id of the first input is a token
    return {model_.loss(inputs, targets, c_.model.loss),
            static_cast<double>(model::ScriptModel::weight(targets, c_.model.loss)),
            ids ? first.numel() : first.size(0)};
  }

  const Config& c_;
  model::ScriptModel model_;
  SiteTensors data_;
  model::ShuffledPasses passes_;
  std::vector<at::Tensor> params_;
};

}  // namespace

std::unique_ptr<Task> make_script_task(const TaskContext& context) { return std::make_unique<ScriptTask>(context); }

}  // namespace nebula::train
