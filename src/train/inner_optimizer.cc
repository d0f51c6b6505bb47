#include "train/inner_optimizer.h"

#include <ATen/ATen.h>

#include "nebula/error.h"
#include "train/optimizer_state.h"

namespace nebula::train {

InnerOptimizer::InnerOptimizer(std::vector<at::Tensor> params, double lr, double weight_decay,
                               const std::string& shard, collective::SiteGroup& site)
    : params_(std::move(params)), site_(site) {
  NEBULA_CHECK(shard == "none" || shard == "optimizer", "parallel.shard = \"", shard,
               "\": the inner optimizer runs \"none\" or \"optimizer\" (ZeRO-1) only");
  for (const auto& p : params_) total_numel_ += p.numel();
  sharded_ = shard == "optimizer" && site_.size() > 1;
  if (sharded_) {
    for (const auto& p : params_)
      NEBULA_CHECK(p.scalar_type() == at::kFloat && p.device().is_cpu(), "parallel.shard = \"optimizer\" on site ",
                   site_.site(), ": a trainable parameter is ", p.scalar_type(), " on ", p.device(),
                   "; ZeRO-1 runs float32 parameters on CPU sites only (set shard = \"none\")");
    // The parameters move into one flat buffer of N S values (their storage from now on), and
    // AdamW optimizes a leaf that shares this worker's S of it: its step writes the shard in
    // place and the all-gather fills the others' in place, with no copy of the model.
    at::NoGradGuard no_grad;
    const int64_t n = site_.size();
    shard_numel_ = (total_numel_ + n - 1) / n;
    flat_ = at::zeros({shard_numel_ * n});
    int64_t offset = 0;
    for (auto& p : params_) {
      at::Tensor view = flat_.narrow(0, offset, p.numel()).view(p.sizes());
      view.copy_(p);
      p.set_data(view);
      offset += p.numel();
    }
    shard_ = flat_.narrow(0, site_.rank() * shard_numel_, shard_numel_).detach().set_requires_grad(true);
    optimized_ = {shard_};
  } else {
    optimized_ = params_;
  }
  adamw_ = std::make_unique<torch::optim::AdamW>(optimized_,
                                                 torch::optim::AdamWOptions(lr).weight_decay(weight_decay));
}

void InnerOptimizer::zero_grad() {
  if (!sharded_) {
    adamw_->zero_grad();
    return;
  }
  for (auto& p : params_)
    if (p.grad().defined()) p.mutable_grad().zero_();
}

void InnerOptimizer::step() {
  if (!sharded_) {
    adamw_->step();
    return;
  }
  at::NoGradGuard no_grad;
  // The shard's slice of the (already averaged) gradients; the parameters are already in
  // place (flat_), whatever a strategy wrote into them since the last step.
  const int64_t begin = site_.rank() * shard_numel_;
  at::Tensor grad = at::zeros({shard_numel_});
  int64_t offset = 0;
  for (const auto& p : params_) {
    const int64_t lo = std::max(offset, begin), hi = std::min(offset + p.numel(), begin + shard_numel_);
    if (lo < hi && p.grad().defined())
      grad.narrow(0, lo - begin, hi - lo).copy_(p.grad().reshape({-1}).narrow(0, lo - offset, hi - lo));
    offset += p.numel();
  }
  shard_.mutable_grad() = grad;
  adamw_->step();
  site_.all_gather(shard_.detach(), flat_);
}

void InnerOptimizer::save(Checkpoint& out) const {
  save_optimizer(*adamw_, optimized_, out);
  out.state["optim"]["shard"] = {{"numel", state_numel()}, {"rank", sharded_ ? site_.rank() : 0},
                                 {"of", sharded_ ? site_.size() : 1}};
}

void InnerOptimizer::load(const Checkpoint& in) {
  const auto& optim = in.state.contains("optim") ? in.state["optim"] : nlohmann::json::object();
  const int64_t numel = optim.contains("shard") ? optim["shard"].value("numel", int64_t{-1}) : total_numel_;
  if (numel != state_numel())
    throw DataError(str_cat("checkpoint of step ", in.step, ": its optimizer state covers ", numel,
                            " elements, this worker's covers ", state_numel(), " (parallel.shard or the site's "
                            "workers changed since the checkpoint): resume with the settings it was written with"));
  load_optimizer(*adamw_, optimized_, in);
}

}  // namespace nebula::train
