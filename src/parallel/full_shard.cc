#include "parallel/full_shard.h"
#include "parallel/shard_layout.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <mutex>

#include "nebula/error.h"

namespace nebula::parallel {
namespace {

at::Tensor generator_state() {
  at::Generator g = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

void set_generator_state(const at::Tensor& state) {
  at::Generator g = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

at::Tensor no_values() { return at::empty({0}, at::kFloat); }

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

// One layer call of a training forward: runs without autograd (the parameters gathered for it
// and freed after it), and in backward gathers them again and recomputes the layer with
// autograd to get the gradients (FullShard's comment).
struct GatheredLayer : public torch::autograd::Function<GatheredLayer> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, FullShard* self, int64_t index,
                                                const at::Tensor& /*anchor*/, at::TensorList inputs) {
    FullShard::Call& call = self->call(static_cast<size_t>(index));
    std::vector<at::Tensor> in = inputs.vec();
    self->gather(call.unit);
    at::Tensor out = call.body(in);
    self->release(call.unit);
    ctx->save_for_backward(in);
    ctx->saved_data["self"] = reinterpret_cast<int64_t>(self);
    ctx->saved_data["call"] = index;
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto* self = reinterpret_cast<FullShard*>(ctx->saved_data["self"].toInt());
    FullShard::Call& call = self->call(static_cast<size_t>(ctx->saved_data["call"].toInt()));
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    for (const at::Tensor& s : saved) inputs.push_back(s.detach().set_requires_grad(s.requires_grad()));
    self->gather(call.unit);
    at::Tensor out;
    {
      const at::Tensor now = generator_state();  // the forward's draws again, then carry on from here
      set_generator_state(call.generator_state);
      at::AutoGradMode grad(true);
      try {
        out = call.body(inputs);
      } catch (...) {
        set_generator_state(now);
        throw;
      }
      set_generator_state(now);
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
    self->reduce_gradients(call.unit, std::vector<at::Tensor>(grads.begin(), grads.begin() + static_cast<std::ptrdiff_t>(num_params)));
    self->release(call.unit);
    // One gradient per forward argument: none for self, index and the anchor.
    torch::autograd::variable_list result(3);
    size_t k = num_params;
    for (const at::Tensor& t : inputs) result.push_back(t.requires_grad() ? grads[k++] : at::Tensor());
    return result;
  }
};

}  // namespace

FullShard::FullShard(std::vector<at::Tensor> params, const std::vector<torch::nn::Module*>& layers,
                     collective::SiteGroup& site)
    : params_(std::move(params)), site_(site) {
  std::map<const c10::TensorImpl*, size_t> index_of;
  start_.push_back(0);
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    NEBULA_CHECK(p.scalar_type() == at::kFloat && p.device().is_cpu() && p.is_contiguous(),
                 "parallel.shard = \"full\" on site ", site_.site(), ": a trainable parameter is ", p.scalar_type(),
                 " on ", p.device(), "; ZeRO-3 runs contiguous float32 parameters on CPU sites only");
    index_of[p.unsafeGetTensorImpl()] = i;
    shapes_.push_back(p.sizes().vec());
    start_.push_back(start_.back() + p.numel());
  }
  total_numel_ = start_.back();
  const int64_t n = site_.size();
  shard_numel_ = parallel::shard_numel(total_numel_, n);

  // The layers' parameter ranges, and the runs of parameters outside them.
  std::vector<bool> covered(params_.size(), false);
  for (torch::nn::Module* layer : layers) {
    std::vector<size_t> mine;
    for (const at::Tensor& p : layer->parameters()) {
      auto it = index_of.find(p.unsafeGetTensorImpl());
      if (it != index_of.end()) mine.push_back(it->second);
    }
    std::sort(mine.begin(), mine.end());
    const size_t first = mine.empty() ? 0 : mine.front(), last = mine.empty() ? 0 : mine.back() + 1;
    NEBULA_CHECK(last - first == mine.size(), "parallel.shard = \"full\": the trainable parameters of layer #",
                 units_.size(), " are not consecutive among the model's: ZeRO-3 gathers a layer as one range");
    for (size_t i : mine) {
      NEBULA_CHECK(!covered[i], "parallel.shard = \"full\": trainable parameter #", i, " belongs to two layers");
      covered[i] = true;
    }
    unit_of_[layer] = units_.size();
    units_.push_back({first, last, start_[first], start_[last]});
  }
  for (size_t i = 0; i < params_.size();) {
    if (covered[i]) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < params_.size() && !covered[j]) ++j;
    rest_.push_back({i, j, start_[i], start_[j]});
    i = j;
  }
  unit_buffers_.resize(units_.size());

  // This worker's shard, from the whole parameters; then the parameters let go of their values.
  at::NoGradGuard no_grad;
  shard_ = at::zeros({shard_numel_}, at::kFloat);
  const int64_t lo = site_.rank() * shard_numel_, hi = lo + shard_numel_;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t a = std::max(lo, start_[i]), b = std::min(hi, start_[i + 1]);
    if (a < b) shard_.narrow(0, a - lo, b - a).copy_(params_[i].reshape({-1}).narrow(0, a - start_[i], b - a));
  }
  shard_grad_ = at::zeros({shard_numel_}, at::kFloat);
  shard_.set_requires_grad(true);
  shard_.mutable_grad() = shard_grad_;
  for (auto& p : params_) {
    p.mutable_grad() = at::Tensor();
    p.set_data(no_values());
  }
  anchor_ = no_values().set_requires_grad(true);
}

FullShard::~FullShard() = default;

std::vector<int64_t> FullShard::counts(const Range& r) const {
  std::vector<int64_t> out(static_cast<size_t>(site_.size()));
  for (int q = 0; q < site_.size(); ++q) {
    const int64_t lo = std::max(r.begin, q * shard_numel_), hi = std::min(r.end, (q + 1) * shard_numel_);
    out[static_cast<size_t>(q)] = std::max<int64_t>(hi - lo, 0);
  }
  return out;
}

void FullShard::gather_range(const Range& r, at::Tensor& buffer) {
  at::NoGradGuard no_grad;
  buffer = at::empty({r.end - r.begin}, at::kFloat);
  const int64_t lo = std::max(r.begin, site_.rank() * shard_numel_);
  const int64_t hi = std::min(r.end, (site_.rank() + 1) * shard_numel_);
  if (lo < hi) buffer.narrow(0, lo - r.begin, hi - lo).copy_(shard_.detach().narrow(0, lo - site_.rank() * shard_numel_, hi - lo));
  if (r.end > r.begin) site_.all_gather_parts(buffer, counts(r));
  for (size_t i = r.first; i < r.last; ++i)
    params_[i].set_data(buffer.narrow(0, start_[i] - r.begin, start_[i + 1] - start_[i]).view(shapes_[i]));
}

void FullShard::drop_range(const Range& r) {
  for (size_t i = r.first; i < r.last; ++i) params_[i].set_data(no_values());
}

void FullShard::gather(size_t u) {
  if (!full_.defined()) gather_range(units_.at(u), unit_buffers_.at(u));
}

void FullShard::release(size_t u) {
  if (full_.defined()) return;
  drop_range(units_.at(u));
  unit_buffers_.at(u) = at::Tensor();
}

std::vector<at::Tensor> FullShard::unit_params(size_t u) const {
  const Range& r = units_.at(u);
  return {params_.begin() + static_cast<std::ptrdiff_t>(r.first), params_.begin() + static_cast<std::ptrdiff_t>(r.last)};
}

void FullShard::reduce_gradients(size_t u, const std::vector<at::Tensor>& grads) {
  const Range& r = units_.at(u);
  NEBULA_CHECK(grads.size() == r.last - r.first, "reduce_gradients: ", grads.size(), " gradients for ",
               r.last - r.first, " parameters");
  if (r.end == r.begin) return;
  at::NoGradGuard no_grad;
  at::Tensor buffer = at::zeros({r.end - r.begin}, at::kFloat);
  for (size_t i = r.first; i < r.last; ++i)
    if (grads[i - r.first].defined())
      buffer.narrow(0, start_[i] - r.begin, start_[i + 1] - start_[i]).copy_(grads[i - r.first].reshape({-1}));
  buffer.mul_(weight_);
  site_.reduce_scatter_parts(buffer, counts(r));
  const int64_t lo = std::max(r.begin, site_.rank() * shard_numel_);
  const int64_t hi = std::min(r.end, (site_.rank() + 1) * shard_numel_);
  if (lo < hi) shard_grad_.narrow(0, lo - site_.rank() * shard_numel_, hi - lo).add_(buffer.narrow(0, lo - r.begin, hi - lo));
}

void FullShard::begin_step() {
  NEBULA_CHECK(!full_.defined() && rest_buffers_.empty(), "FullShard::begin_step inside a step or with_full_model");
  calls_.clear();
  rest_buffers_.resize(rest_.size());
  rest_grads_.resize(rest_.size());
  for (size_t k = 0; k < rest_.size(); ++k) {
    const Range& r = rest_[k];
    gather_range(r, rest_buffers_[k]);
    // Backward accumulates the rest's gradients in place into these views (defined .grad).
    rest_grads_[k] = at::zeros({r.end - r.begin}, at::kFloat);
    for (size_t i = r.first; i < r.last; ++i)
      params_[i].mutable_grad() =
          rest_grads_[k].narrow(0, start_[i] - r.begin, start_[i + 1] - start_[i]).view(shapes_[i]);
  }
}

void FullShard::end_backward() {
  NEBULA_CHECK(rest_buffers_.size() == rest_.size(), "FullShard::end_backward without begin_step");
  at::NoGradGuard no_grad;
  const int64_t lo_shard = site_.rank() * shard_numel_;
  for (size_t k = 0; k < rest_.size(); ++k) {
    const Range& r = rest_[k];
    at::Tensor& g = rest_grads_[k];
    g.mul_(weight_);
    if (r.end > r.begin) site_.reduce_scatter_parts(g, counts(r));
    const int64_t lo = std::max(r.begin, lo_shard), hi = std::min(r.end, lo_shard + shard_numel_);
    if (lo < hi) shard_grad_.narrow(0, lo - lo_shard, hi - lo).add_(g.narrow(0, lo - r.begin, hi - lo));
    for (size_t i = r.first; i < r.last; ++i) params_[i].mutable_grad() = at::Tensor();
    drop_range(r);
  }
  rest_buffers_.clear();
  rest_grads_.clear();
  calls_.clear();
}

void FullShard::with_full_model(const std::function<void()>& fn, bool root_only) {
  if (full_.defined() || root_only_) {
    fn();
    return;
  }
  NEBULA_CHECK(rest_buffers_.empty(), "FullShard::with_full_model inside a training step or with_rest");
  const bool here = !root_only || site_.rank() == 0;  // this worker holds the model during fn
  {
    at::NoGradGuard no_grad;
    const std::vector<int64_t> counts(static_cast<size_t>(site_.size()), shard_numel_);
    if (here) full_ = at::empty({shard_numel_ * site_.size()}, at::kFloat);
    if (!root_only)
      site_.all_gather(shard_.detach(), full_);
    else
      site_.gather_parts_to_root(shard_.detach(), full_, counts);
    if (here)
      for (size_t i = 0; i < params_.size(); ++i)
        params_[i].set_data(full_.narrow(0, start_[i], start_[i + 1] - start_[i]).view(shapes_[i]));
    root_only_ = !here;
  }
  auto done = [&] {
    root_only_ = false;
    if (!here) return;
    at::NoGradGuard no_grad;
    shard_.detach().copy_(full_.narrow(0, site_.rank() * shard_numel_, shard_numel_));
    for (auto& p : params_) p.set_data(no_values());
    full_ = at::Tensor();
  };
  run_then(fn, done);
}

void FullShard::with_rest(const std::function<void()>& fn) {
  NEBULA_CHECK(rest_buffers_.empty() && !full_.defined() && !root_only_,
               "FullShard::with_rest inside a training step or with_full_model");
  rest_buffers_.resize(rest_.size());
  for (size_t k = 0; k < rest_.size(); ++k) gather_range(rest_[k], rest_buffers_[k]);
  auto done = [&] {
    for (const Range& r : rest_) drop_range(r);
    rest_buffers_.clear();
  };
  run_then(fn, done);
}

at::Tensor FullShard::run(torch::nn::Module& layer, const std::vector<at::Tensor>& inputs, const Body& body) {
  auto it = unit_of_.find(&layer);
  NEBULA_CHECK(it != unit_of_.end(), "parallel.shard = \"full\": the model ran a layer it did not declare");
  NEBULA_CHECK(!root_only_, "parallel.shard = \"full\": the model ran on worker ", site_.rank(),
               " inside the gateway's evaluation, where only the gateway holds it");
  if (full_.defined()) return body(inputs);
  if (!at::GradMode::is_enabled()) {  // e.g. a no-grad forward inside a step: gather, run, free
    gather(it->second);
    at::Tensor out = body(inputs);
    release(it->second);
    return out;
  }
  calls_.push_back({it->second, body, generator_state()});
  return GatheredLayer::apply(this, static_cast<int64_t>(calls_.size() - 1), anchor_, at::TensorList(inputs))[0];
}

}  // namespace nebula::parallel
