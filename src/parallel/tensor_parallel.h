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
#include "parallel/shard_layout.h"

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

// Each of `params`' dimension in `slices` (a model's split_for_tensor), -1 where it is not cut.
std::vector<int> slice_dims(const std::vector<model::TensorSlice>& slices, const std::vector<at::Tensor>& params);

// A group of one worker: a model "split" over it keeps every parameter whole (slice_parameter
// does not copy then) and says which it would cut along which dimension (slice_dims), for a
// site without slices that must know another site's SliceLayout.
class OneWorkerTensorGroup : public model::TensorGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce_sum(at::Tensor&) override {}
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
  // Each of `params`' cut dimension (SliceLayout's dims): 0 rows, 1 columns, -1 whole.
  std::vector<int> dims(const std::vector<at::Tensor>& params) const { return slice_dims(slices_, params); }
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

// How a site of tensor slices (T per replica, D replicas; rank = replica · T + slice, SiteGrid's
// order) holds the whole model's flat vector, for the WAN exchange of sites with different
// layouts. Slice t holds of each trainable parameter (`shapes`, the whole model's, in order) the
// part its `dims` entry says: -1 whole (a LayerNorm, a row-parallel bias: equal on every slice),
// 0 rows slice_of(rows, T, t), 1 columns slice_of(columns, T, t) (a 2-D weight: one run per row).
// Its own flat vector ("local") is those parts one after another, as the split model's
// parameters lie. Slice t *owns* its parts of the cut parameters, and slice 0 also the whole
// ones, so that every value has one owner; the D replicas of a slice cut what it owns into D
// pieces by position among its owned values (as StageLayout cuts a stage). A worker's runs are
// its piece's: what it sends and receives over the WAN. Plain arithmetic, no tensors.
class SliceLayout {
 public:
  // Throws std::invalid_argument for slices < 1, data < 1, a dims entry that is not -1, 0 or 1
  // (1 only for 2-D shapes), or dims and shapes of different lengths.
  SliceLayout(std::vector<std::vector<int64_t>> shapes, std::vector<int> dims, int64_t slices, int64_t data);

  int64_t total() const { return offsets_.back(); }
  int64_t slices() const { return slices_; }
  int64_t data() const { return data_; }
  int64_t workers() const { return slices_ * data_; }
  int64_t slice_of_rank(int64_t rank) const { return rank % slices_; }
  int64_t replica_of(int64_t rank) const { return rank / slices_; }
  // How many values slice t holds (its split model's trainable values) and owns.
  int64_t held(int64_t slice) const;
  int64_t owned(int64_t slice) const;
  // Worker `rank`'s runs of [offset, offset + numel), in flat order; `local` indexes its slice's
  // own flat vector.
  std::vector<ShardRun> runs(int64_t rank, int64_t offset, int64_t numel) const;
  // Every run slice t owns in [offset, offset + numel) (its D replicas' runs together).
  std::vector<ShardRun> owned_runs(int64_t slice, int64_t offset, int64_t numel) const;
  // The whole parameters' runs in [offset, offset + numel) at slice t's local positions: what
  // slice 0 gives the others after an exchange.
  std::vector<ShardRun> whole_runs(int64_t slice, int64_t offset, int64_t numel) const;
  // Every run slice t holds in [offset, offset + numel), owned or not (a resume onto another
  // layout reads a slice's whole local vector by them).
  std::vector<ShardRun> held_runs(int64_t slice, int64_t offset, int64_t numel) const;
  // Each parameter's cut dimension, as given.
  std::vector<int> dims() const;

 private:
  // Runs of slice t in [lo, hi) of the parameters passing `keep`, clipped to owned positions
  // [own_lo, own_hi) (owned positions counted over owned parameters only).
  template <typename Keep>
  std::vector<ShardRun> collect(int64_t slice, int64_t lo, int64_t hi, int64_t own_lo, int64_t own_hi, Keep keep) const;
  struct Param {
    int64_t rows = 0, cols = 1;  // a 1-D parameter: rows = its length
    int dim = -1;
  };
  // How many of p's values slice t keeps.
  int64_t kept_numel(const Param& p, int64_t slice) const;
  std::vector<Param> params_;
  std::vector<int64_t> offsets_;  // flat offset of each parameter, then the total
  int64_t slices_ = 1, data_ = 1;
};

}  // namespace nebula::parallel
