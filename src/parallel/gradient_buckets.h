// ZeRO-2's gradients ([parallel] shard = "gradients"): reduce-scattered bucket by bucket while
// backward runs, so no worker ever holds the model's whole gradient.
//
// The trainable parameters, in flat order, are cut from the back into buckets of about
// `bucket_bytes` (backward makes the last parameters' gradients first; a parameter larger than
// a bucket is a bucket of its own). Between arm(w) and finish(), a hook after each parameter's
// gradient accumulator (autograd's AccumulateGrad: it runs once per backward, with every use of
// the parameter summed) copies w · p.grad into its bucket's buffer and drops p.grad; when a
// bucket holds all its parameters' gradients it is reduce-scattered over the site
// (SiteGroup::reduce_scatter_parts: ZeRO-1/2's contiguous layout, worker q's shard the values
// [q S, (q + 1) S)), this worker's part added into `shard_grad`, and its buffer freed. Buckets go
// strictly in order, the same on every worker whatever order the hooks fire in; finish() sends
// the ones still incomplete (a parameter backward did not reach counts as 0) in that order. So
// `shard_grad` ends holding Σ_workers w · g on this worker's shard, each value summed in the
// same order as one reduce-scatter of the whole gradient (the ring's), and every p.grad is
// undefined: a reader of .grad sees no gradient, never a partial one.
//
// Memory: the buckets filled but not yet sent (at most those behind the first incomplete one:
// the parameters backward is still working on) and the gradient autograd is computing. Outside
// arm()/finish() the hooks leave gradients alone (a backward of the caller's own keeps its .grad).
//
// One thread (the training thread, where CPU backward runs). CPU float32 parameters.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "collective/site_group.h"

namespace torch::autograd {
struct Node;
}

namespace nebula::parallel {

class GradientBuckets {
 public:
  // `params`: the trainable parameters (leaves), in flat order, n values in all; `shard_grad`:
  // this worker's S = shard_numel(n, N) values, where the sums go (added to).
  GradientBuckets(std::vector<at::Tensor> params, collective::SiteGroup& site, at::Tensor shard_grad,
                  uint64_t bucket_bytes);
  ~GradientBuckets();
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;

  // Before backward: this worker's weight for the step.
  void arm(double weight);
  // After backward: the buckets backward left incomplete sent, in order; disarmed.
  void finish();
  // The same for gradients a backward accumulated in .grad while disarmed (a pipeline stage's
  // micro-batches, parallel/pipeline.h): arm(weight), every parameter's gradient taken in
  // backward's order (the last first), finish().
  void take_accumulated(double weight);
  bool armed() const { return armed_; }

  size_t buckets() const { return buckets_.size(); }
  // Gradient values held in bucket buffers now, and the most at once since reset_peak().
  int64_t held_numel() const { return held_; }
  int64_t peak_held_numel() const { return peak_held_; }
  void reset_peak() { peak_held_ = held_; }
  // Buckets sent while backward still ran (from a hook), since the start.
  int64_t sent_in_backward() const { return sent_in_backward_; }

  // The hook's side (a parameter's gradient is accumulated).
  void on_gradient(size_t param);

 private:
  struct Bucket {
    size_t first, last;  // parameters [first, last)
    int64_t begin, end;  // values [begin, end) of the flat vector
    at::Tensor values;   // w · the gradients, while filling (undefined otherwise)
    size_t missing = 0;
  };
  at::Tensor& values_of(Bucket& b);  // its buffer, allocated (zeros) and counted as held on first use
  void send_ready();  // every complete bucket from next_, in order
  void send(Bucket& b);

  std::vector<at::Tensor> params_;
  collective::SiteGroup& site_;
  at::Tensor shard_grad_;
  int64_t shard_numel_ = 0;
  std::vector<int64_t> start_;  // each parameter's first value
  std::vector<Bucket> buckets_;  // in the order they go (from the back of the flat vector)
  std::vector<size_t> bucket_of_;
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks_;  // accumulator, hook key
  size_t next_ = 0;
  bool armed_ = false;
  bool in_hook_send_ = false;
  double weight_ = 1;
  int64_t held_ = 0, peak_held_ = 0, sent_in_backward_ = 0;
};

}  // namespace nebula::parallel
