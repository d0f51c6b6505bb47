#include <ATen/ATen.h>

#include "nebula/error.h"
#include "strategy/strategy.h"

namespace nebula::strategy {

at::Tensor flatten(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> views;
  for (const auto& t : tensors) views.push_back(t.reshape({-1}).to(at::kFloat));
  if (views.empty()) return at::empty({0}, at::kFloat);
  return at::cat(views);
}

void unflatten_into(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (const auto& t : tensors) {
    const int64_t n = t.numel();
    t.copy_(flat.narrow(0, offset, n).view(t.sizes()));
    offset += n;
  }
  NEBULA_CHECK(offset == flat.numel(), "flat buffer has ", flat.numel(), " elements, tensors ", offset);
}

void SyncStrategy::init(const std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  at::Tensor flat = flatten(params);
  comm_.broadcast_from_first(flat);
  unflatten_into(flat, params);
}

void SyncStrategy::sync_gradients(const std::vector<at::Tensor>& params, double weight) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params) {
    // A parameter that got no gradient this step still takes part (as zeros) so that every
    // worker's flat buffer has the same layout.
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    grads.push_back(p.grad());
  }
  at::Tensor flat = flatten(grads);
  comm_.allreduce(flat, {collective::ReduceOp::kWeightedMean, weight});
  unflatten_into(flat, grads);
}

std::unique_ptr<Strategy> make_strategy(const StrategyConfig& config, collective::Hierarchy& comm) {
  if (config.kind == "sync") return std::make_unique<SyncStrategy>(comm);
  throw ConfigError(str_cat("strategy.kind = \"", config.kind, "\" is not implemented (available: sync)"));
}

}  // namespace nebula::strategy
