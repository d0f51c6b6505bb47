#include "parallel/tensor_parallel.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>

#include "nebula/error.h"

namespace nebula::parallel {

TensorSplit::TensorSplit(std::vector<model::TensorSlice> slices, std::function<void(model::TensorGroup*)> set_group,
                         SiteTensorGroup& group, std::pair<int64_t, int64_t> whole_numel,
                         std::vector<std::vector<int64_t>> whole_shapes)
    : slices_(std::move(slices)),
      set_group_(std::move(set_group)),
      group_(group),
      whole_numel_(whole_numel),
      whole_shapes_(std::move(whole_shapes)) {}

bool TensorSplit::sliced(const at::Tensor& param) const {
  return std::any_of(slices_.begin(), slices_.end(), [&](const model::TensorSlice& s) { return s.param.is_same(param); });
}

void TensorSplit::with_whole(const std::function<void()>& fn) {
  at::NoGradGuard no_grad;
  const int t = group_.size();
  std::vector<at::Tensor> kept;  // each slice's own storage, given back after
  for (const model::TensorSlice& s : slices_) {
    at::Tensor param = s.param;
    const at::Tensor mine = param.detach();
    kept.push_back(mine);
    // Gathered along dimension 0 (a column cut is gathered transposed): every worker's rows in
    // rank order, each a run of slice_of's rows.
    const at::Tensor rows = s.dim == 0 ? mine : mine.t();
    const int64_t per_row = rows.numel() / std::max<int64_t>(rows.size(0), 1);
    std::vector<int64_t> counts;
    for (int r = 0; r < t; ++r) counts.push_back(model::slice_of(s.whole, t, r).size() * per_row);
    std::vector<int64_t> shape = rows.sizes().vec();
    shape[0] = s.whole;
    at::Tensor full = at::empty(shape, mine.options());
    full.narrow(0, s.mine.begin, s.mine.size()).copy_(rows);
    group_.group().all_gather_parts(full.view({-1}), counts);
    param.set_data(s.dim == 0 ? full : full.t().contiguous());
  }
  set_group_(nullptr);
  struct Restore {
    TensorSplit& split;
    std::vector<at::Tensor>& kept;
    ~Restore() {
      for (size_t i = 0; i < kept.size(); ++i) {
        at::Tensor param = split.slices_[i].param;
        param.set_data(kept[i]);
      }
      split.set_group_(&split.group_);
    }
  } restore{*this, kept};
  fn();
}

}  // namespace nebula::parallel
