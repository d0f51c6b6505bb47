#include "parallel/tensor_parallel.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <stdexcept>
#include <string>

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

std::vector<int> slice_dims(const std::vector<model::TensorSlice>& slices, const std::vector<at::Tensor>& params) {
  std::vector<int> out;
  for (const at::Tensor& p : params) {
    int dim = -1;
    for (const model::TensorSlice& s : slices)
      if (s.param.is_same(p)) dim = static_cast<int>(s.dim);
    out.push_back(dim);
  }
  return out;
}

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

SliceLayout::SliceLayout(std::vector<std::vector<int64_t>> shapes, std::vector<int> dims, int64_t slices, int64_t data)
    : slices_(slices), data_(data) {
  if (slices < 1 || data < 1)
    throw std::invalid_argument("SliceLayout: " + std::to_string(slices) + " slices × " + std::to_string(data) +
                                " replicas");
  if (dims.size() != shapes.size())
    throw std::invalid_argument("SliceLayout: " + std::to_string(dims.size()) + " dims for " +
                                std::to_string(shapes.size()) + " parameters");
  offsets_.push_back(0);
  for (size_t i = 0; i < shapes.size(); ++i) {
    Param p;
    p.dim = dims[i];
    int64_t n = 1;
    for (int64_t d : shapes[i]) n *= d;
    if (p.dim < -1 || p.dim > 1 || (p.dim == 1 && shapes[i].size() != 2) || (p.dim == 0 && shapes[i].empty()))
      throw std::invalid_argument("SliceLayout: parameter #" + std::to_string(i) + " of " +
                                  std::to_string(shapes[i].size()) + " dimensions cut along " + std::to_string(p.dim));
    p.rows = shapes[i].empty() ? 1 : shapes[i][0];
    p.cols = p.rows > 0 ? n / p.rows : 0;
    params_.push_back(p);
    offsets_.push_back(offsets_.back() + n);
  }
}

namespace {
// Columns (dim 1) or rows (else) of a parameter that slice t keeps.
model::SliceRange kept(int64_t whole, int64_t slices, int64_t t) {
  return model::slice_of(whole, static_cast<int>(slices), static_cast<int>(t));
}
}  // namespace

int64_t SliceLayout::kept_numel(const Param& p, int64_t slice) const {
  return p.dim == -1  ? p.rows * p.cols
         : p.dim == 0 ? kept(p.rows, slices_, slice).size() * p.cols
                      : p.rows * kept(p.cols, slices_, slice).size();
}

int64_t SliceLayout::held(int64_t slice) const {
  int64_t n = 0;
  for (const Param& p : params_) n += kept_numel(p, slice);
  return n;
}

int64_t SliceLayout::owned(int64_t slice) const {
  int64_t n = held(slice);
  if (slice != 0)
    for (const Param& p : params_)
      if (p.dim == -1) n -= p.rows * p.cols;
  return n;
}

template <typename Keep>
std::vector<ShardRun> SliceLayout::collect(int64_t slice, int64_t lo, int64_t hi, int64_t own_lo, int64_t own_hi,
                                           Keep keep) const {
  std::vector<ShardRun> out;
  int64_t local = 0, own = 0;  // slice's local and owned positions at the start of parameter i
  auto add = [&](int64_t flat, int64_t at_local, int64_t at_own, int64_t len, bool owned) {
    // [flat, flat + len) clipped to [lo, hi) and, owned, to owned positions [own_lo, own_hi).
    int64_t a = std::max(flat, lo), b = std::min(flat + len, hi);
    if (owned) {
      a = std::max(a, flat + (own_lo - at_own));
      b = std::min(b, flat + (own_hi - at_own));
    }
    if (a >= b) return;
    if (!out.empty() && out.back().flat + out.back().len == a && out.back().local + out.back().len == at_local + (a - flat))
      out.back().len += b - a;
    else
      out.push_back({a, at_local + (a - flat), b - a});
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    const int64_t flat = offsets_[i];
    const bool owned = p.dim != -1 || slice == 0;
    const bool take = keep(p, owned) && flat < hi && offsets_[i + 1] > lo;
    if (p.dim == -1) {
      if (take) add(flat, local, own, p.rows * p.cols, owned);
    } else if (p.dim == 0) {
      const model::SliceRange r = kept(p.rows, slices_, slice);
      if (take) add(flat + r.begin * p.cols, local, own, r.size() * p.cols, owned);
    } else {
      const model::SliceRange c = kept(p.cols, slices_, slice);
      const int64_t w = c.size();
      if (take && w > 0) {  // one run per row; only the rows that meet [lo, hi)
        const int64_t first = std::max<int64_t>(0, (lo - flat) / p.cols);
        const int64_t last = std::min<int64_t>(p.rows, (hi - flat + p.cols - 1) / p.cols);
        for (int64_t row = first; row < last; ++row)
          add(flat + row * p.cols + c.begin, local + row * w, own + row * w, w, owned);
      }
    }
    const int64_t n = kept_numel(p, slice);
    local += n;
    if (owned) own += n;
  }
  return out;
}

std::vector<ShardRun> SliceLayout::owned_runs(int64_t slice, int64_t offset, int64_t numel) const {
  return collect(slice, offset, offset + numel, 0, INT64_MAX / 2, [](const Param&, bool owned) { return owned; });
}

std::vector<ShardRun> SliceLayout::whole_runs(int64_t slice, int64_t offset, int64_t numel) const {
  return collect(slice, offset, offset + numel, 0, INT64_MAX / 2, [](const Param& p, bool) { return p.dim == -1; });
}

std::vector<ShardRun> SliceLayout::held_runs(int64_t slice, int64_t offset, int64_t numel) const {
  return collect(slice, offset, offset + numel, 0, INT64_MAX / 2, [](const Param&, bool) { return true; });
}

std::vector<int> SliceLayout::dims() const {
  std::vector<int> out;
  for (const Param& p : params_) out.push_back(p.dim);
  return out;
}

std::vector<ShardRun> SliceLayout::runs(int64_t rank, int64_t offset, int64_t numel) const {
  if (rank < 0 || rank >= workers()) return {};
  const int64_t t = slice_of_rank(rank), q = replica_of(rank);
  const int64_t n = owned(t), piece = shard_numel(n, data_);
  const int64_t own_lo = std::min(q * piece, n), own_hi = std::min((q + 1) * piece, n);
  if (own_lo >= own_hi) return {};
  return collect(t, offset, offset + numel, own_lo, own_hi, [](const Param&, bool owned) { return owned; });
}

}  // namespace nebula::parallel
