#include "parallel/full_shard.h"
#include "parallel/shard_layout.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <mutex>

#include "nebula/error.h"
#include "parallel/generator_state.h"

namespace nebula::parallel {
namespace {

at::TensorOptions floats_on(const at::Device& device) { return at::TensorOptions().dtype(at::kFloat).device(device); }
at::Tensor no_values(const at::Device& device) { return at::empty({0}, floats_on(device)); }

// A unit's buffer keeps its storage object for good (views of it, saved by autograd between a
// layer's forward and backward, see whatever it holds) and only its bytes come and go: a fresh
// allocation from the storage's own allocator (host or GPU memory alike), its old values not
// kept (a gather overwrites them all).
// `blocks`: where the old bytes go and the new come from (ZeRO-3's unit buffers); null: the allocator's.
void set_storage_bytes(const at::Tensor& buffer, int64_t bytes, UnitBlocks* blocks = nullptr) {
  c10::StorageImpl* storage = buffer.storage().unsafeGetStorageImpl();
  const size_t old_bytes = storage->nbytes();
  if (old_bytes == static_cast<size_t>(bytes)) return;
  NEBULA_CHECK(storage->allocator() != nullptr, "ZeRO-3: a unit's buffer on ", buffer.device(), " has no allocator");
  c10::Allocator& allocator = *storage->allocator();
  c10::DataPtr fresh = blocks ? blocks->take(allocator, static_cast<size_t>(bytes)) : allocator.allocate(static_cast<size_t>(bytes));
  c10::DataPtr old = storage->set_data_ptr(std::move(fresh));
  storage->set_nbytes(static_cast<size_t>(bytes));
  if (blocks) blocks->keep(std::move(old), old_bytes);
}

// fn(), then done(), whether fn returns or throws.
template <typename Done>
void run_then(const std::function<void()>& fn, Done&& done) {
  try {
    fn();
  } catch (...) {
    done();
    throw;
  }
  done();
}

// One layer call of a training forward (FullShard's comment): the unit gathered for it and
// freed after it; in backward gathered again into the same storage for the gradients, which
// are reduce-scattered at once. With recompute the forward runs without autograd and backward
// runs the layer again; without, the layer's graph is kept from the forward (Call::out).
struct GatheredLayer : public torch::autograd::Function<GatheredLayer> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, FullShard* self, int64_t index,
                                                const at::Tensor& /*anchor*/, at::TensorList inputs) {
    FullShard::Call& call = self->call(static_cast<size_t>(index));
    std::vector<at::Tensor> in = inputs.vec();
    ctx->saved_data["self"] = reinterpret_cast<int64_t>(self);
    ctx->saved_data["call"] = index;
    self->gather(call.unit);
    self->prefetch_after(static_cast<size_t>(index), /*backward=*/false);
    at::Tensor out;
    if (self->recompute()) {
      out = call.body(in);
      self->release(call.unit);
      ctx->save_for_backward(in);
      return {out};
    }
    for (at::Tensor& t : in) t = t.detach().set_requires_grad(t.requires_grad());
    {
      at::AutoGradMode grad(true);
      call.out = call.body(in);
    }
    call.inputs = std::move(in);
    self->release(call.unit, /*keep_views=*/true);
    return {call.out.detach()};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto* self = reinterpret_cast<FullShard*>(ctx->saved_data["self"].toInt());
    const auto index = static_cast<size_t>(ctx->saved_data["call"].toInt());
    FullShard::Call& call = self->call(index);
    self->gather(call.unit);
    self->prefetch_after(index, /*backward=*/true);
    at::Tensor out;
    std::vector<at::Tensor> inputs;
    if (self->recompute()) {
      for (const at::Tensor& s : ctx->get_saved_variables()) inputs.push_back(s.detach().set_requires_grad(s.requires_grad()));
      const at::Device device = self->device();
      const at::Tensor now = generator_state(device);  // the forward's draws again, then carry on from here
      set_generator_state(device, call.generator_state);
      at::AutoGradMode grad(true);
      try {
        out = call.body(inputs);
      } catch (...) {
        set_generator_state(device, now);
        throw;
      }
      set_generator_state(device, now);
    } else {
      out = std::move(call.out);
      inputs = std::move(call.inputs);
    }
    std::vector<at::Tensor> targets = self->unit_params(call.unit);
    const size_t num_params = targets.size();
    for (const at::Tensor& t : inputs)
      if (t.requires_grad()) targets.push_back(t);
    std::vector<at::Tensor> grads;
    if (!targets.empty() && out.requires_grad()) {
      const at::Tensor g = grad_out.at(0).defined() ? grad_out[0] : at::zeros_like(out);
      grads = torch::autograd::grad({out}, targets, {g}, /*retain_graph=*/false, /*create_graph=*/false,
                                    /*allow_unused=*/true);
    } else {
      grads.assign(targets.size(), at::Tensor());
    }
    out = at::Tensor();
    self->reduce_gradients(call.unit, std::vector<at::Tensor>(grads.begin(), grads.begin() + static_cast<std::ptrdiff_t>(num_params)));
    self->release(call.unit);
    // One gradient per forward argument: none for self, index and the anchor.
    torch::autograd::variable_list result(3);
    size_t k = num_params;
    for (const at::Tensor& t : inputs) result.push_back(t.requires_grad() ? grads[k++] : at::Tensor());
    return result;
  }
};

// Parameter index by tensor, and each parameter's first value in the flat vector.
std::map<const c10::TensorImpl*, size_t> index_params(const std::vector<at::Tensor>& params, std::vector<int64_t>& start) {
  std::map<const c10::TensorImpl*, size_t> index_of;
  start.assign(1, 0);
  for (size_t i = 0; i < params.size(); ++i) {
    index_of[params[i].unsafeGetTensorImpl()] = i;
    start.push_back(start.back() + params[i].numel());
  }
  return index_of;
}

// Each layer's parameters [first, last), and which parameters no layer has.
std::vector<std::pair<size_t, size_t>> layer_params(const std::vector<at::Tensor>& params,
                                                    const std::vector<torch::nn::Module*>& layers,
                                                    const std::map<const c10::TensorImpl*, size_t>& index_of,
                                                    std::vector<bool>& covered) {
  covered.assign(params.size(), false);
  std::vector<std::pair<size_t, size_t>> out;
  for (torch::nn::Module* layer : layers) {
    std::vector<size_t> mine;
    for (const at::Tensor& p : layer->parameters()) {
      auto it = index_of.find(p.unsafeGetTensorImpl());
      if (it != index_of.end()) mine.push_back(it->second);
    }
    std::sort(mine.begin(), mine.end());
    const size_t first = mine.empty() ? 0 : mine.front(), last = mine.empty() ? 0 : mine.back() + 1;
    NEBULA_CHECK(last - first == mine.size(), "parallel.shard = \"full\": the trainable parameters of layer #",
                 out.size(), " are not consecutive among the model's: ZeRO-3 gathers a layer as one range");
    for (size_t i : mine) {
      NEBULA_CHECK(!covered[i], "parallel.shard = \"full\": trainable parameter #", i, " belongs to two layers");
      covered[i] = true;
    }
    out.emplace_back(first, last);
  }
  return out;
}

// The runs of parameters no layer covers.
std::vector<std::pair<size_t, size_t>> uncovered_runs(const std::vector<bool>& covered) {
  std::vector<std::pair<size_t, size_t>> runs;
  for (size_t i = 0; i < covered.size();) {
    if (covered[i]) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < covered.size() && !covered[j]) ++j;
    runs.emplace_back(i, j);
    i = j;
  }
  return runs;
}

// The sorted, distinct value bounds of the ranges (each [start[first], start[last])), from 0 to the end.
std::vector<int64_t> bounds_of(const std::vector<std::pair<size_t, size_t>>& ranges, const std::vector<int64_t>& start) {
  std::vector<int64_t> bounds{0, start.back()};
  for (const auto& [first, last] : ranges) {
    bounds.push_back(start[first]);
    bounds.push_back(start[last]);
  }
  std::sort(bounds.begin(), bounds.end());
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  if (bounds.size() == 1) bounds.push_back(0);  // no values: one empty unit
  return bounds;
}

}  // namespace

std::vector<int64_t> FullShard::unit_bounds(const std::vector<at::Tensor>& params,
                                            const std::vector<torch::nn::Module*>& layers) {
  std::vector<int64_t> start;
  std::vector<bool> covered;
  auto ranges = layer_params(params, layers, index_params(params, start), covered);
  for (const auto& run : uncovered_runs(covered)) ranges.push_back(run);
  return bounds_of(ranges, start);
}

void PieceKeeper::layer_built(torch::nn::Module& layer) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> params = layer.parameters();
  if (params.empty()) return;
  int64_t numel = 0;
  for (const at::Tensor& p : params) {
    NEBULA_CHECK(p.scalar_type() == at::kFloat && p.is_contiguous(), "parallel.shard = \"full\": a layer's parameter is ",
                 p.scalar_type(), p.is_contiguous() ? "" : " (not contiguous)", "; ZeRO-3 runs contiguous float32 parameters");
    numel += p.numel();
  }
  // The layer as one unit: the same cut FullShard's layout makes of it. The piece stays where
  // the layer was built (FullShard copies it onto the site's device).
  const ShardRun mine = ShardLayout({0, numel}, workers_).piece(0, rank_);
  at::Tensor piece = at::empty({mine.len}, params.front().options());
  int64_t at = 0;  // the layer's flat values so far
  for (at::Tensor& p : params) {
    const int64_t lo = std::max(mine.flat, at), hi = std::min(mine.flat + mine.len, at + p.numel());
    if (lo < hi) piece.narrow(0, lo - mine.flat, hi - lo).copy_(p.reshape({-1}).narrow(0, lo - at, hi - lo));
    at += p.numel();
    parked_.insert(p.unsafeGetTensorImpl());
    // Its shape and no values: a tensor of its sizes whose storage holds 0 bytes (as a unit's
    // buffer between gathers), on the site's device (so moving the model there leaves it be).
    // Nothing reads it before FullShard takes the piece instead.
    at::Tensor shell = at::empty(p.sizes(), floats_on(device_));
    set_storage_bytes(shell, 0);
    p.set_data(shell);
  }
  pieces_[params.front().unsafeGetTensorImpl()] = std::move(piece);
}

at::Tensor PieceKeeper::piece_of(const at::Tensor& first) const {
  auto it = pieces_.find(first.unsafeGetTensorImpl());
  return it == pieces_.end() ? at::Tensor() : it->second;
}

FullShard::FullShard(std::vector<at::Tensor> params, const std::vector<torch::nn::Module*>& layers,
                     collective::SiteGroup& site, Options options, std::unique_ptr<collective::SiteGroup> prefetch_group,
                     const PieceKeeper* kept)
    : params_(std::move(params)), site_(site), options_(options), layout_({0, 0}, 1),
      blocks_(options.prefetch ? 3 : 2),  // freed blocks kept: a layer's, the embedding's, the one ahead's
      prefetch_group_(std::move(prefetch_group)) {
  NEBULA_CHECK(options_.prefetch == (prefetch_group_ != nullptr),
               "FullShard: prefetch needs its own group of the site (SiteGroup::fork), given exactly then");
  NEBULA_CHECK(!kept || kept->layers() == 0 || site_.size() > 1, "FullShard: pieces kept for a site of one worker");
  if (!params_.empty()) device_ = params_.front().device();
  for (const at::Tensor& p : params_) {
    NEBULA_CHECK(p.scalar_type() == at::kFloat && p.device() == device_ && p.is_contiguous(),
                 "parallel.shard = \"full\" on site ", site_.site(), ": a trainable parameter is ", p.scalar_type(),
                 " on ", p.device(), p.is_contiguous() ? "" : " (not contiguous)", " where the first is on ", device_,
                 "; ZeRO-3 runs contiguous float32 parameters, all on the site's device");
    shapes_.push_back(p.sizes().vec());
  }
  const auto index_of = index_params(params_, start_);
  std::vector<bool> covered;
  const auto layer_ranges = layer_params(params_, layers, index_of, covered);
  const auto rest_ranges = uncovered_runs(covered);
  std::vector<std::pair<size_t, size_t>> all = layer_ranges;
  all.insert(all.end(), rest_ranges.begin(), rest_ranges.end());
  layout_ = ShardLayout(bounds_of(all, start_), site_.size());
  const std::vector<int64_t>& bounds = layout_.bounds();
  auto range = [&](const std::pair<size_t, size_t>& pr) {
    const int64_t begin = start_[pr.first], end = start_[pr.second];
    // A range's unit: the one that starts at its first value (an empty range: any, it holds nothing).
    const size_t u = static_cast<size_t>(std::lower_bound(bounds.begin(), bounds.end(), begin) - bounds.begin());
    const size_t unit = std::min(u, layout_.units() - 1);
    NEBULA_CHECK(begin == end || layout_.unit_numel(unit) == end - begin, "FullShard: range [", begin, ", ", end,
                 ") is not one unit");
    return Range{pr.first, pr.second, begin, end, unit};
  };
  for (size_t l = 0; l < layers.size(); ++l) {
    layer_of_[layers[l]] = layers_.size();
    layers_.push_back(range(layer_ranges[l]));
  }
  uses_left_.assign(layers_.size(), 0);
  pending_grads_.assign(layers_.size(), at::Tensor());
  for (const auto& pr : rest_ranges) rest_.push_back(range(pr));

  // This worker's pieces: the ones kept while the model was built, the others cut from the
  // whole parameters; then the parameters let go of their values.
  at::NoGradGuard no_grad;
  shard_ = at::zeros({layout_.shard_numel()}, floats_on(device_));
  std::vector<bool> done(params_.size(), false);
  for (const Range& r : layers_) {
    const at::Tensor piece = r.last > r.first && kept ? kept->piece_of(params_[r.first]) : at::Tensor();
    for (size_t i = r.first; i < r.last; ++i)
      NEBULA_CHECK(piece.defined() == (kept && kept->kept(params_[i])), "FullShard: trainable parameter #", i,
                   " was ", piece.defined() ? "not kept with" : "kept apart from", " the rest of its layer");
    if (!piece.defined()) continue;
    const ShardRun mine = layout_.piece(r.unit, site_.rank());
    NEBULA_CHECK(piece.numel() == mine.len, "FullShard: the piece kept of layer unit ", r.unit, " has ", piece.numel(),
                 " values, the layout gives ", mine.len);
    shard_.narrow(0, mine.local, mine.len).copy_(piece);
    for (size_t i = r.first; i < r.last; ++i) done[i] = true;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    NEBULA_CHECK(done[i] || !kept || !kept->kept(params_[i]), "FullShard: trainable parameter #", i,
                 " was kept in pieces but belongs to no layer");
    if (done[i]) continue;
    for (const ShardRun& r : layout_.runs(site_.rank(), start_[i], start_[i + 1] - start_[i]))
      shard_.narrow(0, r.local, r.len).copy_(params_[i].reshape({-1}).narrow(0, r.flat - start_[i], r.len));
  }
  shard_grad_ = at::zeros({layout_.shard_numel()}, floats_on(device_));
  shard_.set_requires_grad(true);
  shard_.mutable_grad() = shard_grad_;
  for (size_t u = 0; u < layout_.units(); ++u) {
    buffers_.push_back(at::empty({layout_.unit_numel(u)}, floats_on(device_)));
    set_unit_bytes(buffers_.back(), 0);
  }
  gathered_.assign(layout_.units(), false);
  for (auto& p : params_) {
    p.mutable_grad() = at::Tensor();
    p.set_data(no_values(device_));
  }
  anchor_ = no_values(device_).set_requires_grad(true);
}

FullShard::~FullShard() {
  if (prefetch_.valid()) try {
      prefetch_.get();
    } catch (...) {  // a failed prefetch's error is the training thread's, if it is still waiting for it
    }
}

c10::DataPtr UnitBlocks::take(c10::Allocator& allocator, size_t bytes) {
  {
    MutexLock lock(mu_);
    for (auto it = free_.rbegin(); it != free_.rend(); ++it)  // the newest first: still in cache, likely
      if (it->first == bytes) {
        c10::DataPtr block = std::move(it->second);
        free_.erase(std::next(it).base());
        return block;
      }
  }
  return allocator.allocate(bytes);
}

void UnitBlocks::keep(c10::DataPtr block, size_t bytes) {
  if (bytes == 0 || !block || capacity_ == 0) return;  // freed here
  c10::DataPtr dropped;  // freed outside the lock
  MutexLock lock(mu_);
  if (free_.size() == capacity_) {  // the oldest goes: the sizes in use now are the newest
    dropped = std::move(free_.front().second);
    free_.erase(free_.begin());
  }
  free_.emplace_back(bytes, std::move(block));
}

size_t UnitBlocks::kept_bytes() const {
  MutexLock lock(mu_);
  size_t n = 0;
  for (const auto& [bytes, block] : free_) n += bytes;
  return n;
}

void FullShard::set_unit_bytes(const at::Tensor& buffer, int64_t bytes) { set_storage_bytes(buffer, bytes, &blocks_); }

int64_t FullShard::held_numel() const {
  int64_t n = 0;
  for (size_t u = 0; u < buffers_.size(); ++u)
    n += prefetch_.valid() && u == prefetch_unit_  // being filled on the prefetch thread: whole, soon
             ? layout_.unit_numel(u)
             : static_cast<int64_t>(buffers_[u].storage().nbytes() / sizeof(float));
  return n;
}

void FullShard::fill_unit(size_t u, collective::SiteGroup& group) {
  const at::Tensor& buffer = buffers_[u];
  const ShardRun mine = layout_.piece(u, site_.rank());
  set_unit_bytes(buffer, layout_.unit_numel(u) * static_cast<int64_t>(sizeof(float)));
  // Written around autograd (a tensor of its own over the bytes: no version bump): a graph may
  // hold views of this storage.
  if (mine.len > 0)
    at::from_blob(buffer.data_ptr<float>() + (mine.flat - layout_.unit_begin(u)), {mine.len}, buffer.options())
        .copy_(shard_.detach().narrow(0, mine.local, mine.len));
  group.all_gather_parts(buffer, layout_.piece_counts(u));
}

void FullShard::finish_prefetch() {
  if (!prefetch_.valid()) return;
  prefetch_.get();  // rethrows the gather's error
  gathered_[prefetch_unit_] = true;
  peak_held_ = std::max(peak_held_, held_numel());
}

void FullShard::start_prefetch(size_t l) {
  const size_t u = layers_.at(l).unit;
  if (gathered_[u] || layout_.unit_numel(u) == 0 || (prefetch_.valid() && prefetch_unit_ == u)) return;
  finish_prefetch();  // one ahead at most
  prefetch_unit_ = u;
  prefetch_ = std::async(std::launch::async, [this, u] { fill_unit(u, *prefetch_group_); });
  peak_held_ = std::max(peak_held_, held_numel());
}

void FullShard::prefetch_after(size_t call, bool backward) {
  if (!options_.prefetch || whole_) return;
  // Forward: the layer the last step called next (the same on every worker: they run the same
  // model); backward: the one called before this (autograd runs the layers back to front).
  if (!backward && call + 1 < last_calls_.size())
    start_prefetch(last_calls_[call + 1]);
  else if (backward && call > 0)
    start_prefetch(calls_.at(call - 1).unit);
}

void FullShard::gather_range(const Range& r, bool to_root) {
  const size_t u = r.unit;
  const at::Tensor& buffer = buffers_[u];
  const bool here = !to_root || site_.rank() == 0;
  if (prefetch_.valid() && prefetch_unit_ == u) {
    finish_prefetch();
    ++prefetch_hits_;
  }
  if (r.end > r.begin && !gathered_[u]) {
    if (to_root) {
      const ShardRun mine = layout_.piece(u, site_.rank());
      if (here) set_unit_bytes(buffer, (r.end - r.begin) * static_cast<int64_t>(sizeof(float)));
      site_.gather_parts_to_root(shard_.detach().narrow(0, mine.local, mine.len), here ? buffer : at::Tensor(),
                                 layout_.piece_counts(u));
    } else {
      fill_unit(u, site_);
    }
    gathered_[u] = here;
    peak_held_ = std::max(peak_held_, held_numel());
  }
  if (!here) return;
  for (size_t i = r.first; i < r.last; ++i)
    if (params_[i].numel() == 0 && start_[i + 1] > start_[i])
      params_[i].set_data(buffer.narrow(0, start_[i] - r.begin, start_[i + 1] - start_[i]).view(shapes_[i]));
}

void FullShard::drop_range(const Range& r, bool keep_views) {
  set_unit_bytes(buffers_[r.unit], 0);
  gathered_[r.unit] = false;
  if (!keep_views)
    for (size_t i = r.first; i < r.last; ++i) params_[i].set_data(no_values(device_));
}

void FullShard::gather(size_t u) {
  if (!whole_) gather_range(layers_.at(u));
}

void FullShard::release(size_t u, bool keep_views) {
  if (!whole_) drop_range(layers_.at(u), keep_views);
}

std::vector<at::Tensor> FullShard::unit_params(size_t u) const {
  const Range& r = layers_.at(u);
  return {params_.begin() + static_cast<std::ptrdiff_t>(r.first), params_.begin() + static_cast<std::ptrdiff_t>(r.last)};
}

void FullShard::reduce_range(const Range& r, at::Tensor grads) {
  if (r.end == r.begin) return;
  grads.mul_(weight_);
  site_.reduce_scatter_parts(grads, layout_.piece_counts(r.unit));
  const ShardRun mine = layout_.piece(r.unit, site_.rank());
  if (mine.len > 0) shard_grad_.narrow(0, mine.local, mine.len).add_(grads.narrow(0, mine.flat - r.begin, mine.len));
}

void FullShard::reduce_gradients(size_t u, const std::vector<at::Tensor>& grads) {
  const Range& r = layers_.at(u);
  NEBULA_CHECK(grads.size() == r.last - r.first, "reduce_gradients: ", grads.size(), " gradients for ",
               r.last - r.first, " parameters");
  at::NoGradGuard no_grad;
  at::Tensor buffer = at::zeros({r.end - r.begin}, floats_on(device_));
  for (size_t i = r.first; i < r.last; ++i)
    if (grads[i - r.first].defined())
      buffer.narrow(0, start_[i] - r.begin, start_[i + 1] - start_[i]).copy_(grads[i - r.first].reshape({-1}));
  // A unit used more than once this step (the tied token embedding): its uses' gradients are
  // added up first, in the order backward reaches them, and reduce-scattered once, after the
  // last, as autograd adds a shared parameter's gradients before it accumulates them: the same
  // sums as unsharded training's.
  at::Tensor& pending = pending_grads_.at(u);
  if (uses_left_.at(u) > 0) --uses_left_[u];
  if (uses_left_[u] > 0) {
    if (pending.defined())
      pending.add_(buffer);
    else
      pending = std::move(buffer);
    return;
  }
  if (pending.defined()) buffer = std::move(pending.add_(buffer));
  pending = at::Tensor();
  reduce_range(r, buffer);
}

void FullShard::begin_step() {
  NEBULA_CHECK(!whole_ && !in_step_ && !in_rest_, "FullShard::begin_step inside a step or with_full_model");
  calls_.clear();
  uses_left_.assign(layers_.size(), 0);
  pending_grads_.assign(layers_.size(), at::Tensor());
  in_step_ = true;
  rest_grads_.resize(rest_.size());
  for (size_t k = 0; k < rest_.size(); ++k) {
    const Range& r = rest_[k];
    gather_range(r);
    // Backward accumulates the rest's gradients in place into these views (defined .grad).
    rest_grads_[k] = at::zeros({r.end - r.begin}, floats_on(device_));
    for (size_t i = r.first; i < r.last; ++i)
      params_[i].mutable_grad() =
          rest_grads_[k].narrow(0, start_[i] - r.begin, start_[i + 1] - start_[i]).view(shapes_[i]);
  }
}

void FullShard::end_backward() {
  NEBULA_CHECK(in_step_, "FullShard::end_backward without begin_step");
  at::NoGradGuard no_grad;
  // A layer some of whose calls backward did not reach (their outputs outside the loss): the
  // gradients of the calls it did reach, in layer order.
  for (size_t l = 0; l < layers_.size(); ++l)
    if (pending_grads_[l].defined()) {
      at::Tensor grads = std::move(pending_grads_[l]);
      pending_grads_[l] = at::Tensor();
      reduce_range(layers_[l], grads);
    }
  uses_left_.assign(layers_.size(), 0);
  for (size_t k = 0; k < rest_.size(); ++k) {
    const Range& r = rest_[k];
    reduce_range(r, rest_grads_[k]);
    for (size_t i = r.first; i < r.last; ++i) params_[i].mutable_grad() = at::Tensor();
    drop_range(r);
  }
  rest_grads_.clear();
  // A prefetch the backward did not use (a layer called in another order than predicted): freed.
  finish_prefetch();
  for (const Range& r : layers_)
    if (gathered_[r.unit]) drop_range(r);
  last_calls_.clear();
  for (const Call& c : calls_) last_calls_.push_back(c.unit);
  calls_.clear();
  in_step_ = false;
}

void FullShard::with_full_model(const std::function<void()>& fn, bool root_only) {
  if (whole_ || root_only_) {
    fn();
    return;
  }
  NEBULA_CHECK(!in_step_ && !in_rest_, "FullShard::with_full_model inside a training step or with_rest");
  const bool here = !root_only || site_.rank() == 0;  // this worker holds the model during fn
  std::vector<Range> all = layers_;
  all.insert(all.end(), rest_.begin(), rest_.end());
  {
    at::NoGradGuard no_grad;
    for (const Range& r : all) gather_range(r, root_only);
    whole_ = here;
    root_only_ = !here;
  }
  auto done = [&] {
    whole_ = root_only_ = false;
    if (!here) return;
    at::NoGradGuard no_grad;
    // What fn wrote is kept: this worker's pieces taken back from the units.
    for (const Range& r : all) {
      const ShardRun mine = layout_.piece(r.unit, site_.rank());
      if (mine.len > 0)
        shard_.detach().narrow(0, mine.local, mine.len).copy_(buffers_[r.unit].narrow(0, mine.flat - r.begin, mine.len));
      drop_range(r);
    }
  };
  run_then(fn, done);
}

void FullShard::with_rest(const std::function<void()>& fn) {
  NEBULA_CHECK(!in_step_ && !in_rest_ && !whole_ && !root_only_,
               "FullShard::with_rest inside a training step or with_full_model");
  in_rest_ = true;
  for (const Range& r : rest_) gather_range(r);
  auto done = [&] {
    for (const Range& r : rest_) drop_range(r);
    in_rest_ = false;
  };
  run_then(fn, done);
}

void FullShard::with_rest_to_root(const std::function<void()>& fn) {
  NEBULA_CHECK(!in_step_ && !in_rest_ && !whole_ && !root_only_,
               "FullShard::with_rest_to_root inside a training step, with_rest or with_full_model");
  at::NoGradGuard no_grad;
  for (const Range& r : rest_) gather_range(r, true);
  at::Tensor next = at::empty({1}, at::kLong);  // the layer rank 0 runs next; -1: fn has ended
  if (site_.rank() != 0) {
    for (site_.broadcast_from_root(next); next.item<int64_t>() >= 0; site_.broadcast_from_root(next))
      gather_range(layers_.at(static_cast<size_t>(next.item<int64_t>())), true);
    return;
  }
  in_rest_ = to_root_ = true;
  auto done = [&] {
    in_rest_ = to_root_ = false;
    next.fill_(-1);
    site_.broadcast_from_root(next);
    for (const Range& r : rest_) drop_range(r);
  };
  run_then(fn, done);
}

at::Tensor FullShard::run(torch::nn::Module& layer, const std::vector<at::Tensor>& inputs, const Body& body) {
  auto it = layer_of_.find(&layer);
  NEBULA_CHECK(it != layer_of_.end(), "parallel.shard = \"full\": the model ran a layer it did not declare");
  NEBULA_CHECK(!root_only_, "parallel.shard = \"full\": the model ran on worker ", site_.rank(),
               " inside the gateway's evaluation, where only the gateway holds it");
  if (whole_) return body(inputs);
  // A no-grad forward (e.g. inside a step), or the gateway's in with_rest_to_root: gather, run, free.
  if (to_root_ || !at::GradMode::is_enabled()) {
    if (to_root_) {  // the other workers are waiting for this layer's name
      at::Tensor next = at::full({1}, static_cast<int64_t>(it->second), at::kLong);
      site_.broadcast_from_root(next);
    }
    gather_range(layers_.at(it->second), to_root_);
    at::Tensor out = body(inputs);
    release(it->second);
    return out;
  }
  calls_.push_back({it->second, body, recompute() ? generator_state(device_) : at::Tensor(), {}, {}});
  ++uses_left_.at(it->second);
  return GatheredLayer::apply(this, static_cast<int64_t>(calls_.size() - 1), anchor_, at::TensorList(inputs))[0];
}

}  // namespace nebula::parallel
