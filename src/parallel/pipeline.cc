#include "parallel/pipeline.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "nebula/error.h"
#include "parallel/generator_state.h"

namespace nebula::parallel {

std::vector<int> SiteGrid::data_ranks(int stage, int t) const {
  std::vector<int> out;
  for (int d = 0; d < data; ++d) out.push_back(rank(stage, d, t));
  return out;
}

std::vector<int> SiteGrid::tensor_ranks(int stage, int replica) const {
  std::vector<int> out;
  for (int t = 0; t < tensor; ++t) out.push_back(rank(stage, replica, t));
  return out;
}

std::vector<int64_t> balance_stages(const std::vector<int64_t>& layer_costs, int64_t first_cost, int64_t last_cost,
                                    int stages) {
  const auto n = static_cast<int64_t>(layer_costs.size());
  if (stages < 1 || stages > n)
    throw std::invalid_argument(str_cat(stages, " pipeline stages for a model of ", n, " layers (each stage runs ",
                                        "at least one layer)"));
  std::vector<int64_t> sum(static_cast<size_t>(n + 1), 0);  // prefix sums
  for (int64_t i = 0; i < n; ++i) sum[static_cast<size_t>(i + 1)] = sum[static_cast<size_t>(i)] + layer_costs[static_cast<size_t>(i)];
  auto range = [&](int64_t i, int64_t j) { return sum[static_cast<size_t>(j)] - sum[static_cast<size_t>(i)]; };
  // best[k][j]: the least largest cost of layers [0, j) on stages 0..k-1; from[k][j]: where
  // stage k-1 begins in it.
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  const auto P = static_cast<size_t>(stages);
  std::vector<std::vector<int64_t>> best(P + 1, std::vector<int64_t>(static_cast<size_t>(n + 1), kInf));
  std::vector<std::vector<int64_t>> from(P + 1, std::vector<int64_t>(static_cast<size_t>(n + 1), 0));
  best[0][0] = 0;
  for (size_t k = 1; k <= P; ++k)
    for (int64_t j = static_cast<int64_t>(k); j <= n; ++j)
      for (int64_t i = static_cast<int64_t>(k) - 1; i < j; ++i) {
        const int64_t before = best[k - 1][static_cast<size_t>(i)];
        if (before == kInf) continue;
        const int64_t own = range(i, j) + (k == 1 ? first_cost : 0) + (k == P ? last_cost : 0);
        const int64_t worst = std::max(before, own);
        if (worst < best[k][static_cast<size_t>(j)]) {
          best[k][static_cast<size_t>(j)] = worst;
          from[k][static_cast<size_t>(j)] = i;
        }
      }
  std::vector<int64_t> cuts(P + 1, 0);
  cuts[P] = n;
  for (size_t k = P; k >= 1; --k) cuts[k - 1] = from[k][static_cast<size_t>(cuts[k])];
  return cuts;
}

std::vector<int64_t> stage_bounds(const std::vector<int64_t>& unit_numel, const std::vector<int>& owner, int stages) {
  if (stages < 1 || owner.size() != unit_numel.size())
    throw std::invalid_argument(str_cat("stage_bounds: ", stages, " stages, ", owner.size(), " owners of ",
                                        unit_numel.size(), " units"));
  std::vector<int64_t> bounds(static_cast<size_t>(stages) + 1, 0);
  for (size_t u = 0; u < owner.size(); ++u) {
    if (owner[u] < 0 || owner[u] >= stages || (u > 0 && owner[u] < owner[u - 1]))
      throw std::invalid_argument(str_cat("stage_bounds: unit ", u, " on stage ", owner[u], " of ", stages,
                                          ": a stage's units must be consecutive, in stage order"));
    bounds[static_cast<size_t>(owner[u]) + 1] += unit_numel[u];
  }
  for (size_t s = 1; s < bounds.size(); ++s) bounds[s] += bounds[s - 1];
  return bounds;
}

std::vector<PipeOp> one_f_one_b(int stages, int micro_batches, int stage) {
  NEBULA_CHECK(stages >= 1 && micro_batches >= 1 && stage >= 0 && stage < stages, "1F1B schedule of stage ", stage,
               " of ", stages, " with ", micro_batches, " micro-batches");
  const int warm = std::min(stages - stage - 1, micro_batches);
  std::vector<PipeOp> ops;
  for (int i = 0; i < warm; ++i) ops.push_back({PipeOp::kForward, i});
  for (int i = 0; i + warm < micro_batches; ++i) {
    ops.push_back({PipeOp::kForward, i + warm});
    ops.push_back({PipeOp::kBackward, i});
  }
  for (int i = micro_batches - warm; i < micro_batches; ++i) ops.push_back({PipeOp::kBackward, i});
  return ops;
}

double bubble_fraction(int stages, int micro_batches) {
  return static_cast<double>(stages - 1) / static_cast<double>(micro_batches + stages - 1);
}

double simulated_bubble(int stages, int micro_batches, double forward_time, double backward_time) {
  const auto P = static_cast<size_t>(stages), M = static_cast<size_t>(micro_batches);
  std::vector<std::vector<PipeOp>> ops;
  for (int s = 0; s < stages; ++s) ops.push_back(one_f_one_b(stages, micro_batches, s));
  constexpr double kNotYet = -1;
  // done[kind][s][i]: when op (kind, i) ended on stage s.
  std::vector<std::vector<std::vector<double>>> done(2, std::vector<std::vector<double>>(P, std::vector<double>(M, kNotYet)));
  std::vector<size_t> next(P, 0);
  std::vector<double> free_at(P, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t s = 0; s < P; ++s) {
      if (next[s] == ops[s].size()) continue;
      const PipeOp op = ops[s][next[s]];
      const auto i = static_cast<size_t>(op.micro);
      double ready = free_at[s];
      if (op.kind == PipeOp::kForward && s > 0) ready = std::max(ready, done[0][s - 1][i]);
      if (op.kind == PipeOp::kBackward && s + 1 < P) ready = std::max(ready, done[1][s + 1][i]);
      const bool waiting = (op.kind == PipeOp::kForward && s > 0 && done[0][s - 1][i] == kNotYet) ||
                           (op.kind == PipeOp::kBackward && s + 1 < P && done[1][s + 1][i] == kNotYet);
      if (waiting) continue;
      free_at[s] = ready + (op.kind == PipeOp::kForward ? forward_time : backward_time);
      done[op.kind == PipeOp::kForward ? 0 : 1][s][i] = free_at[s];
      ++next[s];
      progress = true;
    }
  }
  for (size_t s = 0; s < P; ++s)
    NEBULA_CHECK(next[s] == ops[s].size(), "the 1F1B schedules of ", stages, " stages and ", micro_batches,
                 " micro-batches deadlock at stage ", s);
  const double makespan = *std::max_element(free_at.begin(), free_at.end());
  return 1.0 - static_cast<double>(M) * (forward_time + backward_time) / makespan;
}

namespace {
using Seconds = std::chrono::duration<double>;
constexpr int kHeaderTag = 15, kMaxTensors = 7, kMaxDims = 6, kHeaderSize = 1 + kMaxTensors * (2 + kMaxDims);
constexpr int kTieTag = 1 << 28;
// The tag of tensor k (kHeaderTag: the header) of micro-batch i, forward (0) or backward (1).
int tag_of(int micro, int direction, int k) { return (micro * 2 + direction) * 16 + k; }
}  // namespace

Pipeline::Pipeline(collective::SiteGroup& group, SiteGrid grid, int micro_batches, bool recompute, at::Device device)
    : group_(group),
      grid_(grid),
      micro_(micro_batches),
      stage_(grid.stage(group.rank())),
      recompute_(recompute),
      device_(device) {
  NEBULA_CHECK(grid.data >= 1 && grid.pipeline >= 1 && grid.workers() == group.size(), "site ", group.site(), ": a ",
               grid.data, " × ", grid.pipeline, " data × pipeline grid over ", group.size(), " workers");
  NEBULA_CHECK(micro_batches >= 1 && micro_batches < (kTieTag >> 5), "site ", group.site(), ": ", micro_batches,
               " micro-batches");
}

void Pipeline::tie(const at::Tensor& param, int owner, int user) {
  NEBULA_CHECK(owner >= 0 && owner < stages() && user >= 0 && user < stages(), "tie between stages ", owner, " and ",
               user, " of ", stages());
  ties_.push_back({param, owner, user});
}

void Pipeline::send_activations(const std::vector<at::Tensor>& tensors, int dst, int tag) {
  NEBULA_CHECK(tensors.size() <= static_cast<size_t>(kMaxTensors), "a pipeline stage passes ", tensors.size(),
               " tensors on (at most ", kMaxTensors, ")");
  at::Tensor h = at::zeros({kHeaderSize}, at::kLong);
  auto* v = h.data_ptr<int64_t>();
  v[0] = static_cast<int64_t>(tensors.size());
  for (size_t k = 0; k < tensors.size(); ++k) {
    const at::Tensor& t = tensors[k];
    NEBULA_CHECK(t.dim() <= kMaxDims, "a pipeline stage passes on a tensor of ", t.dim(), " dimensions");
    int64_t* e = v + 1 + k * (2 + kMaxDims);
    e[0] = static_cast<int64_t>(t.scalar_type());
    e[1] = t.dim();
    for (int64_t d = 0; d < t.dim(); ++d) e[2 + d] = t.size(d);
  }
  group_.send(h, dst, tag + kHeaderTag);
  for (size_t k = 0; k < tensors.size(); ++k)
    group_.send(tensors[k].detach().contiguous(), dst, tag + static_cast<int>(k));
}

void Pipeline::forward(StageModel& model, int micro, double& loss) {
  Micro m;
  if (!first()) {  // what the previous stage sent: its header says the shapes
    const int from = neighbour(stage_ - 1), tag = tag_of(micro, 0, 0);
    at::Tensor h = at::empty({kHeaderSize}, at::kLong);
    group_.recv(h, from, tag + kHeaderTag);
    const auto* v = h.data_ptr<int64_t>();
    NEBULA_CHECK(v[0] >= 0 && v[0] <= kMaxTensors, "site ", group_.site(), ": a bad pipeline header from rank ", from);
    for (int64_t k = 0; k < v[0]; ++k) {
      const int64_t* e = v + 1 + k * (2 + kMaxDims);
      NEBULA_CHECK(e[1] >= 0 && e[1] <= kMaxDims, "site ", group_.site(), ": a bad pipeline header from rank ", from);
      at::Tensor t = at::empty(std::vector<int64_t>(e + 2, e + 2 + e[1]), at::TensorOptions(static_cast<at::ScalarType>(e[0])));
      group_.recv(t, from, tag + static_cast<int>(k));
      if (at::isFloatingType(t.scalar_type())) t.requires_grad_(true);
      m.inputs.push_back(t);
    }
  }
  const auto start = std::chrono::steady_clock::now();
  if (recomputes()) {  // no graph: backward() runs it again from the inputs and this state
    m.generator = generator_state(device_);
    at::NoGradGuard no_grad;
    m.outputs = model.forward(micro, m.inputs);
  } else {
    m.outputs = model.forward(micro, m.inputs);
  }
  timing_.compute_s += Seconds(std::chrono::steady_clock::now() - start).count();
  if (last()) {
    NEBULA_CHECK(m.outputs.size() == 1 && m.outputs[0].numel() == 1, "the last pipeline stage's forward returns ",
                 m.outputs.size(), " tensors, not the micro-batch's loss");
    loss += m.outputs[0].item<double>();
  } else {
    send_activations(m.outputs, neighbour(stage_ + 1), tag_of(micro, 0, 0));
  }
  live_[micro] = std::move(m);
}

void Pipeline::backward(StageModel& model, int micro) {
  auto it = live_.find(micro);
  NEBULA_CHECK(it != live_.end(), "pipeline backward of micro-batch ", micro, " before its forward");
  Micro m = std::move(it->second);
  live_.erase(it);
  if (recomputes()) {  // the forward again, with autograd and the first run's dropout draws
    const auto start = std::chrono::steady_clock::now();
    const at::Tensor now = generator_state(device_);
    set_generator_state(device_, m.generator);
    try {
      m.outputs = model.forward(micro, m.inputs);
    } catch (...) {
      set_generator_state(device_, now);
      throw;
    }
    set_generator_state(device_, now);
    timing_.compute_s += Seconds(std::chrono::steady_clock::now() - start).count();
  }
  std::vector<at::Tensor> outputs, grads;
  if (last()) {
    outputs = m.outputs;
  } else {  // the next stage's gradients of what this one sent it, for the floating-point ones
    for (size_t k = 0; k < m.outputs.size(); ++k) {
      const at::Tensor& out = m.outputs[k];
      if (!at::isFloatingType(out.scalar_type())) continue;
      at::Tensor g = at::empty(out.sizes(), out.options().requires_grad(false));
      group_.recv(g, neighbour(stage_ + 1), tag_of(micro, 1, static_cast<int>(k)));
      if (out.requires_grad()) {
        outputs.push_back(out);
        grads.push_back(g);
      }
    }
  }
  const auto start = std::chrono::steady_clock::now();
  if (!outputs.empty()) torch::autograd::backward(outputs, grads);
  timing_.compute_s += Seconds(std::chrono::steady_clock::now() - start).count();
  if (first()) return;
  for (size_t k = 0; k < m.inputs.size(); ++k) {
    const at::Tensor& in = m.inputs[k];
    if (!at::isFloatingType(in.scalar_type())) continue;
    const at::Tensor g = in.grad().defined() ? in.grad() : at::zeros_like(in).detach();
    group_.send(g.contiguous(), neighbour(stage_ - 1), tag_of(micro, 1, static_cast<int>(k)));
  }
}

double Pipeline::run(StageModel& model) {
  const auto start = std::chrono::steady_clock::now();
  timing_ = {};
  // Tied parameters: the user's copy takes the owner's values.
  for (size_t k = 0; k < ties_.size(); ++k) {
    const Tie& t = ties_[k];
    if (t.owner == t.user) continue;
    const int tag = kTieTag + 2 * static_cast<int>(k);
    if (stage_ == t.owner) group_.send(t.param.detach(), neighbour(t.user), tag);
    if (stage_ == t.user) {
      at::NoGradGuard no_grad;
      group_.recv(t.param.detach(), neighbour(t.owner), tag);
    }
  }
  double loss = 0;
  for (const PipeOp& op : one_f_one_b(stages(), micro_, stage_)) {
    if (op.kind == PipeOp::kForward)
      forward(model, op.micro, loss);
    else
      backward(model, op.micro);
  }
  // The loss, known on the last stage, for every stage's metrics.
  constexpr int kLossTag = kTieTag - 1;
  at::Tensor shared = at::full({1}, loss, at::kDouble);
  if (last()) {
    for (int s = 0; s + 1 < stages(); ++s) group_.send(shared, neighbour(s), kLossTag);
  } else {
    group_.recv(shared, neighbour(stages() - 1), kLossTag);
    loss = shared.item<double>();
  }
  // Tied parameters: the user's gradient joins the owner's.
  for (size_t k = 0; k < ties_.size(); ++k) {
    const Tie& t = ties_[k];
    if (t.owner == t.user) continue;
    const int tag = kTieTag + 2 * static_cast<int>(k) + 1;
    if (stage_ == t.user) {
      const at::Tensor g = t.param.grad().defined() ? t.param.grad() : at::zeros_like(t.param).detach();
      group_.send(g.contiguous(), neighbour(t.owner), tag);
    }
    if (stage_ == t.owner) {
      at::Tensor g = at::empty(t.param.sizes(), t.param.options().requires_grad(false));
      group_.recv(g, neighbour(t.user), tag);
      if (t.param.grad().defined())
        t.param.mutable_grad().add_(g);
      else
        t.param.mutable_grad() = g;
    }
  }
  group_.wait_sends();
  for (const Tie& t : ties_)  // the user's copy accumulates nothing from one step to the next
    if (stage_ == t.user && t.owner != t.user) t.param.mutable_grad() = at::Tensor();
  timing_.wall_s = Seconds(std::chrono::steady_clock::now() - start).count();
  return loss;
}

void StageKeeper::layer_built(torch::nn::Module& layer) {
  if (keep_(built_++, layer)) return;
  at::NoGradGuard no_grad;
  std::vector<std::vector<int64_t>>& shapes = dropped_[&layer];
  for (at::Tensor& p : layer.parameters()) {
    shapes.push_back(p.sizes().vec());
    p.set_data(at::empty({0}, p.options()));
  }
}

const std::vector<std::vector<int64_t>>* StageKeeper::shapes_of(const torch::nn::Module* layer) const {
  auto it = dropped_.find(layer);
  return it == dropped_.end() ? nullptr : &it->second;
}

StagedModel::StagedModel(std::vector<torch::nn::Module*> units, std::vector<int> owner, int stage,
                         std::vector<size_t> used, const StageKeeper* built)
    : units_(std::move(units)), owner_(std::move(owner)), stage_(stage) {
  NEBULA_CHECK(owner_.size() == units_.size(), owner_.size(), " owners for ", units_.size(), " units");
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    const bool keep = owner_[u] == stage_ || std::find(used.begin(), used.end(), u) != used.end();
    if (const auto* dropped = built ? built->shapes_of(units_[u]) : nullptr) {
      NEBULA_CHECK(!keep, "pipeline stage ", stage_, ": unit ", u, " was let go while the model was built, but the "
                   "stage holds it (the keeper and the cut disagree)");
      shapes_.push_back(*dropped);
      continue;
    }
    std::vector<std::vector<int64_t>> shapes;
    for (at::Tensor& p : units_[u]->parameters()) {
      shapes.push_back(p.sizes().vec());
      if (!keep) p.set_data(at::empty({0}, p.options()));
    }
    shapes_.push_back(std::move(shapes));
  }
}

std::vector<at::Tensor> StagedModel::trainable() const {
  std::vector<at::Tensor> out;
  for (size_t u = 0; u < units_.size(); ++u)
    if (owner_[u] == stage_)
      for (const at::Tensor& p : units_[u]->parameters())
        if (p.requires_grad()) out.push_back(p);
  return out;
}

int64_t StagedModel::whole_numel(bool trainable) const {
  const std::vector<int64_t> units = unit_numel(trainable);
  return std::accumulate(units.begin(), units.end(), int64_t{0});
}

std::vector<std::vector<int64_t>> StagedModel::trainable_shapes() const {
  std::vector<std::vector<int64_t>> out;
  for (size_t u = 0; u < units_.size(); ++u) {
    const std::vector<at::Tensor> params = units_[u]->parameters();
    for (size_t k = 0; k < params.size(); ++k)
      if (params[k].requires_grad()) out.push_back(shapes_[u][k]);
  }
  return out;
}

std::vector<int64_t> StagedModel::unit_numel(bool trainable) const {
  std::vector<int64_t> out;
  for (size_t u = 0; u < units_.size(); ++u) {
    const std::vector<at::Tensor> params = units_[u]->parameters();
    int64_t n = 0;
    for (size_t k = 0; k < params.size(); ++k) {
      if (trainable && !params[k].requires_grad()) continue;
      int64_t count = 1;
      for (int64_t d : shapes_[u][k]) count *= d;
      n += count;
    }
    out.push_back(n);
  }
  return out;
}

void StagedModel::with_whole(collective::SiteGroup& group, const SiteGrid& grid, int replicas,
                             const std::function<void()>& fn, bool everywhere) {
  const int rank = group.rank(), replica = grid.replica(rank);
  const bool lent = replica < replicas;  // this worker's replica borrows the model
  const bool holder = lent && grid.stage(rank) == 0, sender = lent && !holder;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> borrowed;  // the holder's copies of other stages' parameters
  for (size_t u = 0; u < units_.size(); ++u) {
    if (owner_[u] == 0) continue;  // the first stage's own
    std::vector<at::Tensor> params = units_[u]->parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      const int tag = static_cast<int>(u * 64 + k);
      if (sender && owner_[u] == stage_) group.send(params[k].detach().contiguous(), grid.rank(0, replica), tag);
      if (holder) {
        if (params[k].numel() == 0) {  // let go here: take the owner's for fn
          params[k].set_data(at::empty(shapes_[u][k], params[k].options()));
          borrowed.push_back(params[k]);
        }
        group.recv(params[k].detach(), grid.rank(owner_[u], replica), tag);
      }
    }
  }
  group.wait_sends();
  auto give_back = [&] {
    for (at::Tensor& p : borrowed) p.set_data(at::empty({0}, p.options()));
  };
  if (holder || everywhere) {
    try {
      fn();
    } catch (...) {
      give_back();
      throw;
    }
  }
  give_back();
  if (!everywhere) group.barrier();
}

}  // namespace nebula::parallel
