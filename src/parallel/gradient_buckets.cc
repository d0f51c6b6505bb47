#include "parallel/gradient_buckets.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "nebula/error.h"
#include "parallel/shard_layout.h"

namespace nebula::parallel {
namespace {

// Runs after a parameter's AccumulateGrad: its .grad holds this backward's gradient.
struct AccumulatedHook : torch::autograd::FunctionPostHook {
  AccumulatedHook(GradientBuckets* owner, size_t param) : owner(owner), param(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    owner->on_gradient(param);
    return outputs;
  }
  GradientBuckets* owner;
  size_t param;
};

}  // namespace

GradientBuckets::GradientBuckets(std::vector<at::Tensor> params, collective::SiteGroup& site, at::Tensor shard_grad,
                                 uint64_t bucket_bytes)
    : params_(std::move(params)), site_(site), shard_grad_(std::move(shard_grad)) {
  NEBULA_CHECK(bucket_bytes >= sizeof(float), "GradientBuckets: buckets of ", bucket_bytes, " bytes");
  start_.assign(1, 0);
  for (const at::Tensor& p : params_) {
    NEBULA_CHECK(p.is_leaf() && p.requires_grad() && p.scalar_type() == at::kFloat && p.device() == shard_grad_.device(),
                 "GradientBuckets: parameter #", start_.size() - 1, " is not a float32 leaf that needs a gradient on ",
                 shard_grad_.device(), " (the gradient shard's device)");
    start_.push_back(start_.back() + p.numel());
  }
  shard_numel_ = parallel::shard_numel(start_.back(), site_.size());
  NEBULA_CHECK(shard_grad_.numel() == shard_numel_ && shard_grad_.is_contiguous() && shard_grad_.scalar_type() == at::kFloat,
               "GradientBuckets: a gradient shard of ", shard_grad_.numel(), " values for ", start_.back(),
               " over ", site_.size(), " workers (want ", shard_numel_, ", float32, contiguous)");
  // Cut from the back: the first bucket backward fills is the first to go.
  const auto limit = static_cast<int64_t>(bucket_bytes / sizeof(float));
  bucket_of_.assign(params_.size(), 0);
  for (size_t last = params_.size(); last > 0;) {
    size_t first = last - 1;
    while (first > 0 && start_[last] - start_[first - 1] <= limit) --first;
    buckets_.push_back({first, last, start_[first], start_[last], at::Tensor(), 0});
    for (size_t i = first; i < last; ++i) bucket_of_[i] = buckets_.size() - 1;
    last = first;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::grad_accumulator(params_[i]);
    NEBULA_CHECK(acc != nullptr, "GradientBuckets: parameter #", i, " has no gradient accumulator");
    const uintptr_t key = acc->add_post_hook(std::make_unique<AccumulatedHook>(this, i));
    hooks_.emplace_back(std::move(acc), key);
  }
}

GradientBuckets::~GradientBuckets() {
  for (auto& [acc, key] : hooks_) acc->del_post_hook(key);
}

void GradientBuckets::arm(double weight) {
  // (A backward that threw left it armed: this step starts afresh.)
  weight_ = weight;
  next_ = 0;
  for (Bucket& b : buckets_) {
    b.missing = b.last - b.first;
    b.values = at::Tensor();
  }
  held_ = 0;
  armed_ = true;
}

void GradientBuckets::on_gradient(size_t i) {
  if (!armed_) return;
  at::Tensor& p = params_.at(i);
  Bucket& b = buckets_[bucket_of_[i]];
  NEBULA_CHECK(b.missing > 0, "GradientBuckets: parameter #", i, " got two gradients in one backward");
  at::NoGradGuard no_grad;
  if (p.grad().defined())
    values_of(b).narrow(0, start_[i] - b.begin, start_[i + 1] - start_[i]).add_(p.grad().reshape({-1}), weight_);
  p.mutable_grad() = at::Tensor();
  --b.missing;
  in_hook_send_ = true;
  send_ready();
  in_hook_send_ = false;
}

at::Tensor& GradientBuckets::values_of(Bucket& b) {
  if (!b.values.defined()) {
    b.values = at::zeros({b.end - b.begin}, shard_grad_.options());  // a parameter backward does not reach adds 0
    held_ += b.end - b.begin;
    peak_held_ = std::max(peak_held_, held_);
  }
  return b.values;
}

void GradientBuckets::send_ready() {
  while (next_ < buckets_.size() && buckets_[next_].missing == 0) send(buckets_[next_++]);
}

void GradientBuckets::send(Bucket& b) {
  at::NoGradGuard no_grad;
  if (b.end > b.begin) {
    values_of(b);
    const std::vector<int64_t> cuts = part_cuts(shard_numel_, site_.size(), b.begin, b.end - b.begin);
    std::vector<int64_t> counts;
    for (size_t q = 0; q + 1 < cuts.size(); ++q) counts.push_back(cuts[q + 1] - cuts[q]);
    site_.reduce_scatter_parts(b.values, counts);
    const auto r = static_cast<size_t>(site_.rank());
    const int64_t mine = cuts[r + 1] - cuts[r];
    if (mine > 0)
      shard_grad_.narrow(0, b.begin + cuts[r] - site_.rank() * shard_numel_, mine).add_(b.values.narrow(0, cuts[r], mine));
  }
  if (b.values.defined()) held_ -= b.end - b.begin;
  b.values = at::Tensor();
  b.missing = 0;
  if (in_hook_send_) ++sent_in_backward_;
}

void GradientBuckets::take_accumulated(double weight) {
  arm(weight);
  for (size_t i = params_.size(); i-- > 0;) on_gradient(i);
  finish();
}

void GradientBuckets::finish() {
  NEBULA_CHECK(armed_, "GradientBuckets::finish without arm()");
  armed_ = false;
  for (; next_ < buckets_.size(); ++next_) send(buckets_[next_]);
}

}  // namespace nebula::parallel
