#include "parallel/inner_optimizer.h"

#include <ATen/ATen.h>
#include <torch/nn/utils/clip_grad.h>

#include <algorithm>
#include <cmath>

#include "nebula/error.h"
#include "parallel/optimizer_state.h"
#include "parallel/shard_layout.h"

namespace nebula::parallel {

InnerOptimizer::InnerOptimizer(std::vector<at::Tensor> params, double lr, double weight_decay,
                               const std::string& shard, collective::SiteGroup& site, FullShard* full,
                               uint64_t bucket_bytes)
    : params_(std::move(params)), site_(site), full_(full) {
  NEBULA_CHECK(shard == "none" || shard == "optimizer" || shard == "gradients" || shard == "full",
               "parallel.shard = \"", shard, "\": the inner optimizer runs \"none\", \"optimizer\" (ZeRO-1), "
               "\"gradients\" (ZeRO-2) or \"full\" (ZeRO-3)");
  NEBULA_CHECK((shard == "full" && site_.size() > 1) == (full != nullptr), "parallel.shard = \"", shard, "\" on a site of ",
               site_.size(), " workers: ZeRO-3's FullShard must be given exactly when the site shards its parameters");
  sharded_ = shard != "none" && site_.size() > 1;
  gradients_sharded_ = sharded_ && shard != "optimizer";
  if (full_) {  // ZeRO-3: the parameters are sharded already; AdamW optimizes this worker's shard
    total_numel_ = full_->total_numel();
    shard_numel_ = full_->shard_numel();
    shard_ = full_->shard();
    flat_grad_ = full_->shard_grad();
    optimized_ = {shard_};
  } else {
    for (const auto& p : params_) total_numel_ += p.numel();
  }
  if (sharded_ && !full_) {
    for (const auto& p : params_)
      NEBULA_CHECK(p.scalar_type() == at::kFloat && p.device() == params_.front().device(), "parallel.shard = \"",
                   shard, "\" on site ", site_.site(), ": a trainable parameter is ", p.scalar_type(), " on ",
                   p.device(), " where the first is on ", params_.front().device(),
                   "; sharding runs float32 parameters, all on the site's device (set shard = \"none\")");
    const at::TensorOptions on_device = at::TensorOptions().dtype(at::kFloat).device(params_.front().device());
    // The parameters move into one flat buffer of N S values (their storage from now on), and
    // AdamW optimizes a leaf that shares this worker's S of it: its step writes the shard in
    // place and the all-gather fills the others' in place, with no copy of the model.
    at::NoGradGuard no_grad;
    const int64_t n = site_.size();
    shard_numel_ = parallel::shard_numel(total_numel_, n);
    flat_ = at::zeros({shard_numel_ * n}, on_device);
    // ZeRO-1: the gradients in one flat buffer of the same layout; ZeRO-2: this worker's S only,
    // which the buckets fill while backward runs (gradient_buckets.h).
    flat_grad_ = at::zeros({gradients_sharded_ ? shard_numel_ : shard_numel_ * n}, on_device);
    int64_t offset = 0;
    for (auto& p : params_) {
      at::Tensor view = flat_.narrow(0, offset, p.numel()).view(p.sizes());
      view.copy_(p);
      p.set_data(view);
      if (!gradients_sharded_) {
        // Backward accumulates into a defined .grad in place: the gradients stay views of
        // flat_grad_ (zero_grad zeroes them, never drops them).
        grad_views_.push_back(flat_grad_.narrow(0, offset, p.numel()).view(p.sizes()));
        p.mutable_grad() = grad_views_.back();
      }
      offset += p.numel();
    }
    shard_ = flat_.narrow(0, site_.rank() * shard_numel_, shard_numel_).detach().set_requires_grad(true);
    shard_.mutable_grad() =
        gradients_sharded_ ? flat_grad_ : flat_grad_.narrow(0, site_.rank() * shard_numel_, shard_numel_);
    if (gradients_sharded_) {
      for (auto& p : params_) p.mutable_grad() = at::Tensor();
      buckets_ = std::make_unique<GradientBuckets>(params_, site_, flat_grad_, bucket_bytes);
    }
    optimized_ = {shard_};
  } else if (!full_) {
    optimized_ = params_;
  }
  adamw_ = std::make_unique<torch::optim::AdamW>(optimized_,
                                                 torch::optim::AdamWOptions(lr).weight_decay(weight_decay));
}

double scheduled_lr(const ModelConfig& m, int64_t step, int64_t steps) {
  NEBULA_CHECK(step >= 0 && steps > 0, "scheduled_lr: step ", step, " of ", steps);
  if (step < m.warmup_steps) return m.lr * static_cast<double>(step + 1) / static_cast<double>(m.warmup_steps);
  if (m.lr_schedule == "constant") return m.lr;
  const double span = static_cast<double>(std::max<int64_t>(1, steps - 1 - m.warmup_steps));
  const double progress = std::clamp(static_cast<double>(step - m.warmup_steps) / span, 0.0, 1.0);
  const double decay = m.lr_schedule == "cosine" ? 0.5 * (1 + std::cos(M_PI * progress)) : 1 - progress;
  NEBULA_CHECK(m.lr_schedule == "cosine" || m.lr_schedule == "linear", "model.lr_schedule '", m.lr_schedule, "'");
  return m.lr * (m.lr_floor + (1 - m.lr_floor) * decay);
}

void InnerOptimizer::set_lr(double lr) {
  for (auto& group : adamw_->param_groups())
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
}

double InnerOptimizer::clip_grad_norm(double max_norm) {
  NEBULA_CHECK(max_norm > 0, "clip_grad_norm: max_norm ", max_norm);
  if (norm_group_) {  // pipeline stages, tensor slices: the whole model's norm, from every part's squares
    at::NoGradGuard no_grad;
    // What this worker holds: its shard of the stage's gradients (ZeRO-2; the shards partition
    // the stage, counted once) or all of them (each replica of the stage has the same).
    std::vector<at::Tensor> grads;
    at::Tensor sq = at::zeros({1}, at::kDouble);
    if (gradients_sharded_) {
      grads.push_back(flat_grad_);
      const at::Tensor squares = flat_grad_.to(at::kDouble).pow(2);
      sq += (norm_shard_weights_.defined() ? squares * norm_shard_weights_ : squares).sum();
    } else {
      for (size_t i = 0; i < params_.size(); ++i)
        if (params_[i].grad().defined()) {
          grads.push_back(params_[i].grad());
          sq += params_[i].grad().to(at::kDouble).pow(2).sum() * (norm_weights_.empty() ? 1.0 : norm_weights_[i]);
        }
    }
    norm_group_->allreduce_sum(sq);
    const double norm = std::sqrt(sq.item<double>() / (gradients_sharded_ ? 1 : norm_copies_));
    if (norm > max_norm)
      for (const at::Tensor& g : grads) g.mul_(max_norm / (norm + 1e-6));
    return norm;
  }
  if (!gradients_sharded_) return torch::nn::utils::clip_grad_norm_(params_, max_norm);
  // ZeRO-2/3: this worker holds the site's average for its shard only.
  at::NoGradGuard no_grad;
  const at::Tensor& mine = flat_grad_;  // this worker's shard of the site's average
  at::Tensor sq = mine.pow(2).sum().reshape({1});
  site_.allreduce_sum(sq);
  const double norm = std::sqrt(sq.item<double>());
  if (norm > max_norm) mine.mul_(max_norm / (norm + 1e-6));
  return norm;
}

void InnerOptimizer::set_norm_group(collective::SiteGroup* group, int copies, std::vector<double> weights) {
  NEBULA_CHECK(!full_ && copies >= 1, "set_norm_group on a ", full_ ? "ZeRO-3 " : "", "optimizer with ", copies,
               " copies");
  NEBULA_CHECK(weights.empty() || weights.size() == params_.size(), "set_norm_group with ", weights.size(),
               " weights for ", params_.size(), " parameters");
  norm_group_ = group;
  norm_copies_ = copies;
  norm_weights_ = std::move(weights);
  if (gradients_sharded_ && !norm_weights_.empty()) {  // ZeRO-2: the weights of this worker's shard, elementwise
    at::Tensor flat = at::zeros({site_.size() * shard_numel_}, at::kDouble);  // the padding weighs nothing
    int64_t at = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      flat.narrow(0, at, params_[i].numel()).fill_(norm_weights_[i]);
      at += params_[i].numel();
    }
    norm_shard_weights_ = flat.narrow(0, site_.rank() * shard_numel_, shard_numel_).clone();
  }
}

void InnerOptimizer::zero_grad() {
  if (!sharded_) {
    adamw_->zero_grad();
    return;
  }
  flat_grad_.zero_();
  if (buckets_)
    for (auto& p : params_) p.mutable_grad() = at::Tensor();
  else if (!full_)
    rebind_grads();
}

void InnerOptimizer::before_backward(double weight) {
  if (buckets_) buckets_->arm(weight);
  if (full_) full_->set_grad_weight(weight);
}

void InnerOptimizer::reduce_accumulated(double weight) {
  NEBULA_CHECK(!full_, "reduce_accumulated with ZeRO-3 (its layers reduce-scatter in their own backward)");
  if (buckets_) buckets_->take_accumulated(weight);
}

void InnerOptimizer::end_backward() {
  if (buckets_) buckets_->finish();
  if (full_) full_->end_backward();
}

void InnerOptimizer::rebind_grads() {
  // A caller that replaced a .grad (or dropped it) gets its values copied in (or zeros).
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    if (p.grad().defined() && p.grad().data_ptr() == grad_views_[i].data_ptr()) continue;
    if (p.grad().defined())
      grad_views_[i].copy_(p.grad());
    else
      grad_views_[i].zero_();
    p.mutable_grad() = grad_views_[i];
  }
}

void InnerOptimizer::step() {
  if (!sharded_) {
    adamw_->step();
    return;
  }
  at::NoGradGuard no_grad;
  // AdamW's gradient is the shard's slice of flat_grad_, averaged by the strategy (all of it:
  // ZeRO-1; this shard alone: ZeRO-2); the parameters are in place (flat_), whatever a
  // strategy wrote into them since the last step.
  if (!gradients_sharded_) rebind_grads();
  adamw_->step();
  if (!full_) site_.all_gather(shard_.detach(), flat_);  // ZeRO-3 gathers layer by layer when they run
}

namespace {
constexpr const char* kParamShard = "optim/0/param";
}  // namespace

bool InnerOptimizer::holds_parameter_shards(const Checkpoint& k) { return tensor_numel(k, kParamShard) >= 0; }

void InnerOptimizer::write_flat(const at::Tensor& values, int64_t begin) {
  at::NoGradGuard no_grad;
  const int64_t end = begin + values.numel();
  int64_t at = 0;
  for (auto& p : params_) {
    const int64_t lo = std::max(at, begin), hi = std::min(at + p.numel(), end);
    if (lo < hi) p.view({-1}).narrow(0, lo - at, hi - lo).copy_(values.narrow(0, lo - begin, hi - lo));
    at += p.numel();
  }
}

ShardLayout InnerOptimizer::layout() const {
  return full_ ? full_->layout() : ShardLayout::contiguous(total_numel_, sharded_ ? site_.size() : 1);
}

void InnerOptimizer::save(Checkpoint& out) const {
  save_optimizer(*adamw_, optimized_, out);
  if (sharded_) out.tensors[kParamShard] = shard_.detach();
  out.state["optim"]["shard"] = {{"numel", state_numel()}, {"rank", sharded_ ? site_.rank() : 0},
                                 {"of", sharded_ ? site_.size() : 1}};
  if (sharded_ && !layout().is_contiguous()) out.state["optim"]["shard"]["units"] = layout().bounds();
}

void InnerOptimizer::load(const Checkpoint& in) {
  const auto& optim = in.state.contains("optim") ? in.state["optim"] : nlohmann::json::object();
  const int64_t numel = optim.contains("shard") ? optim["shard"].value("numel", int64_t{-1}) : total_numel_;
  if (numel != state_numel())
    throw DataError(str_cat("checkpoint of step ", in.step, ": its optimizer state covers ", numel,
                            " elements, this worker's covers ", state_numel(), " (parallel.shard or the site's "
                            "workers changed since the checkpoint): resume with the settings it was written with"));
  load_optimizer(*adamw_, optimized_, in);
  if (sharded_ && holds_parameter_shards(in)) {
    const at::Tensor& values = in.tensors.at(kParamShard);
    if (values.numel() != shard_numel_)
      throw DataError(str_cat("checkpoint of step ", in.step, ": its parameter shard has ", values.numel(),
                              " values, this worker's has ", shard_numel_, ": the model changed"));
    if (full_) {  // ZeRO-3: the same layout (the caller reshards otherwise): straight into the shard
      at::NoGradGuard no_grad;
      shard_.detach().copy_(values.reshape({-1}).to(at::kFloat));
    } else {
      write_flat(values.reshape({-1}).to(at::kFloat), site_.rank() * shard_numel_);
      site_.all_gather(shard_.detach(), flat_);
    }
  }
}

void InnerOptimizer::load_resharded(const std::vector<const Checkpoint*>& ranks) {
  NEBULA_CHECK(!ranks.empty(), "load_resharded without checkpoints");
  const Checkpoint& first = *ranks[0];
  auto optim_of = [](const Checkpoint& k) {
    return k.state.contains("optim") ? k.state["optim"] : nlohmann::json::object();
  };
  const nlohmann::json optim = optim_of(first);
  const int64_t of = optim.contains("shard") ? optim["shard"].value("of", int64_t{1}) : 1;
  if (of != static_cast<int64_t>(ranks.size()) && of != 1)
    throw DataError(str_cat("checkpoint of step ", first.step, ": its optimizer state is cut into ", of,
                            " shards, but ", ranks.size(), " workers' checkpoints were found"));
  auto steps_of = [&](const Checkpoint& k) {
    const nlohmann::json o = optim_of(k);
    if (!o.contains("steps") || !o["steps"].is_array())
      throw DataError(str_cat("checkpoint of step ", k.step, ": no optimizer steps"));
    return o["steps"].get<std::vector<int64_t>>();
  };
  // The old layout: one flat shard per worker cut by its units (none recorded: one unit), or
  // (of = 1) one tensor per parameter.
  std::vector<int64_t> bounds{0, total_numel_};
  if (optim.contains("shard") && optim["shard"].contains("units")) bounds = optim["shard"]["units"].get<std::vector<int64_t>>();
  if (bounds.empty() || bounds.back() != total_numel_)
    throw DataError(str_cat("checkpoint of step ", first.step, ": its shards are cut into units of ",
                            bounds.empty() ? 0 : bounds.back(), " values for a model of ", total_numel_,
                            " parameters: the model changed"));
  const ShardLayout old(bounds, of);
  // Each parameter's number of values (ZeRO-3's parameters hold none outside a gather: their shapes').
  auto numel_of = [&](size_t i) { return full_ ? full_->param_numel(i) : params_[i].numel(); };
  auto name_of = [&](size_t i, const std::string& kind) {
    return of == 1 ? str_cat("optim/", i, "/", kind) : kind == "param" ? std::string(kParamShard) : str_cat("optim/0/", kind);
  };
  auto check_sizes = [&](const std::string& kind, const std::string& what) {
    for (size_t q = 0; q < ranks.size() && of > 1; ++q)
      if (const int64_t n = tensor_numel(*ranks[q], name_of(0, kind)); n != old.shard_numel())
        throw DataError(str_cat("checkpoint of step ", ranks[q]->step, ": worker ", q, "'s shard of ", what, " has ", n,
                                " values, its layout ", old.shard_numel(), ": the model changed"));
    for (size_t i = 0; i < params_.size() && of == 1; ++i)
      if (tensor_numel(first, name_of(i, kind)) != numel_of(i))
        throw DataError(str_cat("checkpoint of step ", first.step, ": no ", what, " of ", numel_of(i),
                                " values for parameter ", i, " (", name_of(i, kind), "): the model changed"));
  };
  // Values [flat, flat + out.numel()) of the flat vector's `kind` from the old workers'
  // checkpoints: only the ranges asked for are read (from the files, when left unread there).
  auto fill = [&](const std::string& kind, at::Tensor out, int64_t flat) {
    const int64_t len = out.numel();
    if (of == 1) {
      int64_t at = 0;
      for (size_t i = 0; i < params_.size(); ++i) {
        const int64_t n = numel_of(i), lo = std::max(at, flat), hi = std::min(at + n, flat + len);
        if (lo < hi) out.narrow(0, lo - flat, hi - lo).copy_(read_range(first, name_of(i, kind), lo - at, hi - lo));
        at += n;
      }
      return;
    }
    for (int64_t q = 0; q < of; ++q)
      for (const ShardRun& r : old.runs(q, flat, len))
        out.narrow(0, r.flat - flat, r.len).copy_(read_range(*ranks[static_cast<size_t>(q)], name_of(0, kind), r.local, r.len));
  };
  // This worker's part of `kind`: its shard (padding zero) in its layout, or one tensor per parameter.
  auto mine = [&](const std::string& kind) {
    std::vector<at::Tensor> out;
    if (sharded_) {
      out.push_back(at::zeros({shard_numel_}, at::kFloat));
      for (const ShardRun& r : layout().runs(site_.rank(), 0, total_numel_)) fill(kind, out[0].narrow(0, r.local, r.len), r.flat);
      return out;
    }
    int64_t offset = 0;
    for (const auto& p : params_) {
      out.push_back(at::empty(p.sizes(), at::kFloat));
      fill(kind, out.back().view({-1}), offset);
      offset += p.numel();
    }
    return out;
  };
  // The one step count every parameter's moments share.
  const std::vector<int64_t> first_steps = steps_of(first);
  int64_t step = first_steps.empty() ? 0 : first_steps[0];
  for (int64_t s : first_steps)
    if (s != step)
      throw DataError(str_cat("checkpoint of step ", first.step, ": its parameters took different numbers of AdamW "
                              "steps (", s, " and ", step, "), so its state cannot be resharded"));
  Checkpoint now;
  now.step = first.step;
  std::vector<int64_t> now_steps(optimized_.size(), step);
  if (step > 0) {
    if (of == 1)
      NEBULA_CHECK(first_steps.size() == params_.size(), "checkpoint of step ", first.step, ": optimizer state for ",
                   first_steps.size(), " parameters, this model has ", params_.size());
    for (const Checkpoint* k : ranks)
      if (of > 1 && steps_of(*k) != first_steps)
        throw DataError(str_cat("checkpoint of step ", k->step, ": the workers' shards took different AdamW steps"));
    for (const auto& [kind, what] : {std::pair{"exp_avg", "AdamW's first moment"}, std::pair{"exp_avg_sq", "AdamW's second moment"}}) {
      check_sizes(kind, what);
      const std::vector<at::Tensor> part = mine(kind);
      for (size_t i = 0; i < part.size(); ++i) now.tensors[str_cat("optim/", i, "/", kind)] = part[i];
    }
  }
  now.state["optim"] = {{"steps", now_steps}, {"shard", {{"numel", state_numel()}}}};
  load(now);
  // The trainable parameters, when the old workers saved them as shards: this worker's shard
  // (ZeRO-1/2 then all-gather the site's; ZeRO-3 holds only it), or all of them unsharded.
  if (holds_parameter_shards(first)) {
    for (const Checkpoint* k : ranks)
      if (!holds_parameter_shards(*k))
        throw DataError(str_cat("checkpoint of step ", k->step, ": one worker's holds no parameter shard"));
    check_sizes("param", "the parameters");
    at::NoGradGuard no_grad;
    if (sharded_) {
      shard_.detach().copy_(mine("param")[0]);
      if (!full_) site_.all_gather(shard_.detach(), flat_);
    } else {
      at::Tensor whole = at::empty({total_numel_}, at::kFloat);
      fill("param", whole, 0);
      write_flat(whole, 0);
    }
  }
}

}  // namespace nebula::parallel
