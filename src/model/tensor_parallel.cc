#include "model/tensor_parallel.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "nebula/error.h"

namespace nebula::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

TensorGroup& group_of(AutogradContext* ctx) {
  return *reinterpret_cast<TensorGroup*>(ctx->saved_data["group"].toInt());  // NOLINT: the caller's, alive through backward
}

void all_reduce(at::Tensor& t, TensorGroup& group) {
  if (group.size() > 1) group.all_reduce_sum(t);
}

// f: identity forward, the gradient summed over the group in backward.
struct CopyToGroup : torch::autograd::Function<CopyToGroup> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, TensorGroup* group) {
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);  // NOLINT
    return x.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    at::Tensor g = grad[0].contiguous().clone();
    all_reduce(g, group_of(ctx));
    return {g, at::Tensor()};
  }
};

// g: the sum over the group forward, the gradient as it is in backward.
struct ReduceFromGroup : torch::autograd::Function<ReduceFromGroup> {
  static at::Tensor forward(AutogradContext* /*ctx*/, const at::Tensor& x, TensorGroup* group) {
    at::Tensor y = x.contiguous().clone();
    all_reduce(y, *group);
    return y;
  }
  static variable_list backward(AutogradContext*, variable_list grad) { return {grad[0], at::Tensor()}; }
};

}  // namespace

SliceRange slice_of(int64_t total, int parts, int part) {
  NEBULA_CHECK(total >= 0 && parts > 0 && part >= 0 && part < parts, "slice ", part, " of ", parts, " of ", total);
  const int64_t each = (total + parts - 1) / parts;
  const int64_t begin = std::min(total, part * each);
  return {begin, std::min(total, begin + each)};
}

at::Tensor copy_to_tensor_group(const at::Tensor& x, TensorGroup& group) { return CopyToGroup::apply(x, &group); }

at::Tensor reduce_from_tensor_group(const at::Tensor& x, TensorGroup& group) {
  return ReduceFromGroup::apply(x, &group);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t begin,
                                        TensorGroup& group, double label_smoothing, int64_t vocab) {
  NEBULA_CHECK(logits.dim() == 2 && targets.dim() == 1 && logits.size(0) == targets.size(0) && logits.size(1) > 0,
               "vocabulary-parallel cross-entropy of logits ", logits.sizes(), " and targets ", targets.sizes());
  NEBULA_CHECK(label_smoothing >= 0 && label_smoothing < 1 && (label_smoothing == 0 || vocab >= logits.size(1)),
               "label_smoothing ", label_smoothing, " over a vocabulary of ", vocab);
  const int64_t n = logits.size(0), rows = logits.size(1);
  // The largest logit over the whole vocabulary (for a stable exp; no gradient: the value does
  // not depend on it): each worker's maxima in its own row of a [T, n] sum.
  at::Tensor maxima = at::zeros({group.size(), n}, logits.options().requires_grad(false));
  {
    at::NoGradGuard no_grad;
    if (n > 0) maxima[group.rank()].copy_(logits.detach().amax(1));
    all_reduce(maxima, group);
  }
  const at::Tensor shifted = logits - maxima.amax(0).unsqueeze(1);
  const at::Tensor sum_exp = reduce_from_tensor_group(shifted.exp().sum(1), group);
  // The target's (shifted) logit, from the worker whose rows hold it.
  const at::Tensor mine = targets.ge(begin).logical_and(targets.lt(begin + rows));
  const at::Tensor local = (targets - begin).clamp(0, rows - 1).unsqueeze(1);
  const at::Tensor target = reduce_from_tensor_group(shifted.gather(1, local).squeeze(1) * mine.to(logits.scalar_type()), group);
  const at::Tensor nll = sum_exp.log() - target;  // log Σ_v exp(z_v − m) − (z_t − m) per row
  if (label_smoothing == 0) return nll.mean();
  // torch's smoothing: (1 − ε) nll + ε · (log Σ exp − mean_v z_v), the mean over every worker's rows.
  const at::Tensor mean_logit = reduce_from_tensor_group(shifted.sum(1), group) / static_cast<double>(vocab);
  return ((1 - label_smoothing) * nll + label_smoothing * (sum_exp.log() - mean_logit)).mean();
}

void slice_parameter(const at::Tensor& param, int64_t dim, const TensorGroup& group, std::vector<TensorSlice>& out) {
  NEBULA_CHECK(dim >= 0 && dim < param.dim(), "slicing a parameter of shape ", param.sizes(), " along ", dim);
  const int64_t whole = param.size(dim);
  const SliceRange mine = slice_of(whole, group.size(), group.rank());
  NEBULA_CHECK(mine.size() > 0, "a parameter of shape ", param.sizes(), " cut along dimension ", dim, " into ",
               group.size(), " slices leaves worker ", group.rank(), " of the tensor group none of it");
  if (group.size() > 1) {  // one worker keeps it whole: nothing to cut
    at::NoGradGuard no_grad;
    at::Tensor p = param;  // the same tensor: set_data keeps it (and what holds it) the parameter
    p.set_data(param.detach().narrow(dim, mine.begin, mine.size()).contiguous().clone());
  }
  out.push_back({param, dim, whole, mine});
}

}  // namespace nebula::model
