// `sync`: plain synchronous data parallel, every step, every worker of every site (the baseline
// diloco and streaming are measured against). Gradients travel in buckets queued from autograd's
// hooks while backward still runs (like DDP), each with its own codec state on the WAN leg.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "strategy/strategy.h"

namespace nebula::strategy {

class SyncStrategy : public Strategy {
 public:
  // `codec` (may be null = exact) compresses the inter-site leg; gradients travel in buckets
  // of about `bucket_bytes`, each with its own codec state (error feedback).
  // Buffers (set_buffers) are averaged over every worker every step, exactly (no codec), in
  // one more all-reduce queued before the step's first gradient bucket.
  SyncStrategy(collective::Hierarchy& comm, std::unique_ptr<codec::Codec> codec = nullptr,
               uint64_t bucket_bytes = 4ull << 20, std::chrono::milliseconds timeout = std::chrono::minutes(10));
  std::string name() const override { return "sync"; }
  // Also registers a gradient hook on every parameter: once all gradients of a bucket exist,
  // the bucket is queued on the communication thread while backward goes on (like DDP).
  void init(const std::vector<at::Tensor>& params) override;
  void before_backward(double weight) override;
  // Waits for every bucket (queuing any not yet sent) and writes the averages into .grad.
  void sync_gradients(const std::vector<at::Tensor>& params, double weight) override;
  // Only the gradient buckets' codec states (error feedback) carry over from step to step.
  void save_state(StrategyState& out) const override { save_codec_states(comm_, out); }
  void load_state(const StrategyState& in) override { load_codec_states(comm_, in); }
  // Gradient buckets (of about bucket_bytes each; fixed by init()), and how many of this
  // step's are queued so far: read between backward and sync_gradients, the number the
  // gradient hooks queued while backward ran (0 without before_backward). Training thread.
  size_t num_buckets() const { return buckets_.size(); }
  size_t buckets_queued() const { return next_bucket_; }

 private:
  void on_gradient(size_t index, const at::Tensor& grad);  // autograd's thread
  void launch_ready_buckets();                               // in bucket order

  collective::Hierarchy& comm_;
  std::unique_ptr<codec::Codec> codec_;
  uint64_t bucket_bytes_;
  std::vector<at::Tensor> params_;
  std::vector<std::pair<size_t, size_t>> buckets_;  // parameter index ranges, in reverse order
  std::vector<size_t> bucket_of_;                    // parameter → bucket
  // One step's state. Hooks run on the thread that called backward (CPU autograd), so
  // the training thread owns all of it.
  bool armed_ = false;                               // before_backward was called
  double weight_ = 0;
  std::vector<at::Tensor> grads_;                    // this step's gradients, as they arrive
  std::vector<size_t> missing_;                      // per bucket: gradients still to come
  size_t next_bucket_ = 0;                           // the next bucket to queue
  std::vector<std::vector<at::Tensor>> sent_;        // per bucket: the tensors being reduced
  std::vector<std::shared_ptr<collective::Work>> works_;
  at::Tensor buffer_values_;                         // this step's buffers, being averaged
  std::shared_ptr<collective::Work> buffer_work_;
  std::chrono::milliseconds timeout_;
};

// Consecutive runs of `tensors` of about `bucket_bytes` float32 bytes each (a tensor larger
// than a bucket is a bucket of its own); returns the index ranges [begin, end).
std::vector<std::pair<size_t, size_t>> make_buckets(const std::vector<at::Tensor>& tensors, uint64_t bucket_bytes);

}  // namespace nebula::strategy
