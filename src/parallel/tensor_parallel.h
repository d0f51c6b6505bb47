// Tensor parallelism inside a site ([parallel] tensor = T; the model's side is
// model/tensor_parallel.h): the T workers of one data replica (SiteGrid's tensor ranks,
// consecutive) each hold a slice of every layer and compute each layer together over a c10d
// group of their own; each slice's data-parallel replicas (the same tensor rank of every
// replica) run the strategy and the optimizer over theirs, as a pipeline stage's replicas do.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "collective/site_group.h"
#include "model/tensor_parallel.h"

namespace nebula::parallel {

// model::TensorGroup over a site's c10d subgroup (the T workers of one replica).
class SiteTensorGroup : public model::TensorGroup {
 public:
  explicit SiteTensorGroup(collective::SiteGroup& group) : group_(group) {}
  int rank() const override { return group_.rank(); }
  int size() const override { return group_.size(); }
  void all_reduce_sum(at::Tensor& t) override { group_.allreduce_sum(t); }
  collective::SiteGroup& group() { return group_; }

 private:
  collective::SiteGroup& group_;
};

// A model cut for tensor parallelism, held by one worker: its slices, and the whole model lent
// for a while (evaluation, the model file).
class TensorSplit {
 public:
  // `slices`: what the model's split_for_tensor returned; `set_group(g)`: the model's
  // set_tensor_group (null while whole). `whole_numel`: the whole model's parameter values and
  // of them the trainable ones; `whole_shapes`: the whole model's trainable parameters' shapes
  // (both taken before the cut).
  TensorSplit(std::vector<model::TensorSlice> slices, std::function<void(model::TensorGroup*)> set_group,
              SiteTensorGroup& group, std::pair<int64_t, int64_t> whole_numel,
              std::vector<std::vector<int64_t>> whole_shapes);
  // Whether `param` is one of the slices (else it is whole, and equal, on every worker of the group).
  bool sliced(const at::Tensor& param) const;
  std::pair<int64_t, int64_t> whole_numel() const { return whole_numel_; }
  const std::vector<std::vector<int64_t>>& whole_shapes() const { return whole_shapes_; }
  // fn() with every slice all-gathered whole on every worker of the group and the model computing
  // without the group; the slices kept again after (also if fn throws). A collective of the group.
  void with_whole(const std::function<void()>& fn);

 private:
  std::vector<model::TensorSlice> slices_;
  std::function<void(model::TensorGroup*)> set_group_;
  SiteTensorGroup& group_;
  std::pair<int64_t, int64_t> whole_numel_;
  std::vector<std::vector<int64_t>> whole_shapes_;
};

}  // namespace nebula::parallel
