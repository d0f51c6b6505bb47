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

std::vector<std::pair<size_t, size_t>> make_buckets(const std::vector<at::Tensor>& tensors, uint64_t bucket_bytes) {
  std::vector<std::pair<size_t, size_t>> buckets;
  size_t begin = 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t b = static_cast<uint64_t>(tensors[i].numel()) * sizeof(float);
    if (i > begin && bytes + b > bucket_bytes) {
      buckets.emplace_back(begin, i);
      begin = i;
      bytes = 0;
    }
    bytes += b;
  }
  if (begin < tensors.size()) buckets.emplace_back(begin, tensors.size());
  return buckets;
}

SyncStrategy::SyncStrategy(collective::Hierarchy& comm, std::unique_ptr<codec::Codec> codec, uint64_t bucket_bytes,
                           std::chrono::milliseconds timeout)
    : comm_(comm), codec_(std::move(codec)), bucket_bytes_(bucket_bytes), timeout_(timeout) {}

void SyncStrategy::init(const std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  at::Tensor flat = flatten(params);
  comm_.broadcast_from_first(flat);
  unflatten_into(flat, params);

  // Backward produces gradients roughly in reverse order of the parameters, so buckets are
  // cut from the back: the first bucket to fill is the first to go.
  params_ = params;
  std::vector<at::Tensor> reversed(params.rbegin(), params.rend());
  buckets_.clear();
  for (auto [b, e] : make_buckets(reversed, bucket_bytes_)) buckets_.emplace_back(b, e);
  bucket_of_.assign(params.size(), 0);
  for (size_t k = 0; k < buckets_.size(); ++k)
    for (size_t r = buckets_[k].first; r < buckets_[k].second; ++r) bucket_of_[params.size() - 1 - r] = k;
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].requires_grad())
      params[i].register_hook([this, i](const at::Tensor& grad) { on_gradient(i, grad); });
}

void SyncStrategy::before_backward(double weight) {
  NEBULA_CHECK(works_.empty(), "before_backward called twice without sync_gradients");
  armed_ = true;
  weight_ = weight;
  grads_.assign(params_.size(), at::Tensor());
  missing_.assign(buckets_.size(), 0);
  for (size_t k = 0; k < buckets_.size(); ++k) missing_[k] = buckets_[k].second - buckets_[k].first;
  next_bucket_ = 0;
  sent_.assign(buckets_.size(), {});
}

void SyncStrategy::on_gradient(size_t index, const at::Tensor& grad) {
  if (!armed_ || grads_[index].defined()) return;
  grads_[index] = grad.detach().to(at::kFloat).contiguous().clone();
  if (--missing_[bucket_of_[index]] == 0) launch_ready_buckets();
}

void SyncStrategy::launch_ready_buckets() {
  // Strictly in bucket order, the same on every worker, whatever order the hooks fired in.
  const bool per_tensor = codec_ && codec_->id() == codec::CodecId::kPowerSgd;
  while (next_bucket_ < buckets_.size() && missing_[next_bucket_] == 0) {
    const size_t k = next_bucket_++;
    std::vector<at::Tensor> bucket;
    for (size_t r = buckets_[k].first; r < buckets_[k].second; ++r) bucket.push_back(grads_[params_.size() - 1 - r]);
    sent_[k] = bucket;
    works_.push_back(comm_.allreduce_async(
        std::move(bucket), {collective::ReduceOp::kWeightedMean, weight_, codec_.get(), k, per_tensor}));
  }
}

void SyncStrategy::sync_gradients(const std::vector<at::Tensor>& params, double weight) {
  NEBULA_CHECK(params.size() == params_.size(), "sync_gradients with ", params.size(), " parameters, init had ",
               params_.size());
  if (!armed_) before_backward(weight);  // called without the hook: send everything now
  // Parameters that got no gradient this step take part as zeros, so every worker sends the
  // same buckets.
  for (size_t i = 0; i < params.size(); ++i) {
    if (grads_[i].defined()) continue;
    grads_[i] = params[i].grad().defined() ? params[i].grad().detach().to(at::kFloat).contiguous().clone()
                                           : at::zeros_like(params[i], at::kFloat);
    --missing_[bucket_of_[i]];
  }
  launch_ready_buckets();
  const Deadline deadline = Deadline::after(timeout_);
  for (auto& w : works_) w->wait(deadline);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].grad().defined()) params[i].mutable_grad() = at::zeros_like(params[i]);
    params[i].mutable_grad().copy_(grads_[i]);
  }
  works_.clear();
  armed_ = false;
}

std::unique_ptr<codec::Codec> make_wan_codec(const StrategyConfig& config) {
  if (config.codec == "none") return nullptr;  // exact float32, no codec header
  codec::CodecOptions o;
  o.kind = config.codec;
  o.block = config.codec_block;
  o.stochastic = config.codec_stochastic;
  o.density = config.codec_density;
  o.rank = config.codec_rank;
  o.error_feedback = config.codec_error_feedback;
  return codec::make_codec(o);
}

std::unique_ptr<Strategy> make_strategy(const StrategyConfig& config, collective::Hierarchy& comm,
                                        std::chrono::milliseconds timeout) {
  if (config.kind == "sync")
    return std::make_unique<SyncStrategy>(comm, make_wan_codec(config), config.bucket_bytes, timeout);
  throw ConfigError(str_cat("strategy.kind = \"", config.kind, "\" is not implemented (available: sync)"));
}

}  // namespace nebula::strategy
