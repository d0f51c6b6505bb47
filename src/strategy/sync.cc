#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: ATen.h no longer brings it in LibTorch 2.x

#include "nebula/error.h"
#include "strategy/sync.h"

namespace nebula::strategy {

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
  std::vector<at::Tensor> state = params;
  state.insert(state.end(), buffers_.begin(), buffers_.end());
  make_replicas_equal(comm_, state);

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
  if (!buffers_.empty()) {  // forward has updated them: average this step's values
    at::NoGradGuard no_grad;
    buffer_values_ = flatten(buffers_);
    collective::AllreduceOptions o;
    o.weight = weight;
    buffer_work_ = comm_.allreduce_async({buffer_values_}, std::move(o));
  }
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
    collective::AllreduceOptions o;
    o.weight = weight_;
    o.codec = codec_.get();
    o.tag = k;
    o.per_tensor = per_tensor;
    works_.push_back(comm_.allreduce_async(std::move(bucket), std::move(o)));
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
  if (buffer_work_) {
    buffer_work_->wait(deadline);
    at::NoGradGuard no_grad;
    unflatten_into(buffer_values_, buffers_);
    buffer_work_.reset();
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].grad().defined()) params[i].mutable_grad() = at::zeros_like(params[i]);
    params[i].mutable_grad().copy_(grads_[i]);
  }
  works_.clear();
  armed_ = false;
}

}  // namespace nebula::strategy
