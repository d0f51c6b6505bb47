// Pipeline parallelism inside a site ([parallel] pipeline = P, micro_batches = M): a built-in
// model's layers cut into P stages, each held by its own workers; every step's batch is cut into
// M micro-batches that flow through the stages in a 1F1B schedule (PipeDream-Flush, as Megatron
// runs it), activations and their gradients sent between neighbouring stages over the site's
// c10d point-to-point (Gloo send/recv). After a step each stage's parameters hold the gradient
// of the whole batch's loss, as one worker running the whole model would compute it.
//
// Plain arithmetic (the grid, the cut, the schedule), the runner and a model held by stage; what
// a stage computes is the task's (StageModel, parallel/encoder_stage.h for the MLM encoder), so
// nothing here knows which model it is.
#pragma once

#include <ATen/core/Tensor.h>

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "collective/site_group.h"
#include "model/layer_gather.h"

namespace nebula::parallel {

// A site's workers as a data × pipeline × tensor grid. rank = (stage · data + replica) · tensor +
// t: the stages outermost (as Megatron orders them), then the data replicas, the tensor slices
// innermost (the workers that talk most are consecutive ranks); the gateway (rank 0) is the
// first stage's first replica's first slice.
struct SiteGrid {
  int data = 1, pipeline = 1, tensor = 1;
  int workers() const { return data * pipeline * tensor; }
  int stage(int rank) const { return rank / (data * tensor); }
  int replica(int rank) const { return rank / tensor % data; }
  int tensor_rank(int rank) const { return rank % tensor; }
  int rank(int stage, int replica, int t = 0) const { return (stage * data + replica) * tensor + t; }
  // The site ranks of slice t of stage s on every replica, ascending (their data-parallel group).
  std::vector<int> data_ranks(int stage, int t = 0) const;
  // The site ranks of the slices of stage s of replica r (the tensor group).
  std::vector<int> tensor_ranks(int stage, int replica) const;
};

// Stage s runs layers [cuts[s], cuts[s + 1]) (P + 1 values, 0 to the number of layers): the
// contiguous cut into `stages` runs of at least one layer each whose largest cost is least,
// where stage 0 also carries `first_cost` (the embeddings) and the last stage `last_cost` (the
// final norm); costs are parameter counts. Ties: the last stage starts as early as the optimum
// allows, then the one before it, and so on. std::invalid_argument for stages < 1 or more stages than layers.
std::vector<int64_t> balance_stages(const std::vector<int64_t>& layer_costs, int64_t first_cost, int64_t last_cost,
                                    int stages);

// Where each stage's values lie in the flat vector of the units' values (`unit_numel` each, in
// order) when unit u is on stage owner[u]: P + 1 bounds, stage s's [b_s, b_{s+1}).
// std::invalid_argument unless the owners rise with the units (a stage's units consecutive).
std::vector<int64_t> stage_bounds(const std::vector<int64_t>& unit_numel, const std::vector<int>& owner, int stages);

// One entry of a stage's schedule: the forward or the backward of micro-batch `micro`.
struct PipeOp {
  enum Kind { kForward, kBackward };
  Kind kind = kForward;
  int micro = 0;
  bool operator==(const PipeOp&) const = default;
};

// 1F1B: stage s of P runs min(P − s − 1, M) warm-up forwards, then one forward and one backward
// in turn, then the remaining backwards. At most P − s micro-batches' activations are alive on
// stage s at once (GPipe, all forwards then all backwards, keeps M).
std::vector<PipeOp> one_f_one_b(int stages, int micro_batches, int stage);

// The idle fraction of 1F1B with equal stages: (P − 1) / (M + P − 1).
double bubble_fraction(int stages, int micro_batches);

// The idle fraction of the P schedules run together, each forward taking `forward_time` and
// each backward `backward_time` on every stage, a transfer taking no time: 1 − busy / (P ·
// makespan). What the schedule achieves, against bubble_fraction's formula.
double simulated_bubble(int stages, int micro_batches, double forward_time, double backward_time);

// What one stage of a model computes for one micro-batch: the task's.
class StageModel {
 public:
  virtual ~StageModel() = default;
  // The forward of micro-batch `micro` on this stage. `inputs`: what the previous stage's
  // forward returned (empty on the first stage; floating-point ones require grad here). Returns
  // what goes to the next stage, or on the last stage one scalar: the micro-batch's loss, scaled
  // to its share of the step's loss (the M losses sum to the batch's).
  virtual std::vector<at::Tensor> forward(int micro, const std::vector<at::Tensor>& inputs) = 0;
};

class Pipeline {
 public:
  // `group`: the site's group, ranked as `grid` says; this worker's stage and replica are its
  // rank's. Each replica's P workers form one pipeline; stages talk only within their replica.
  // `recompute` ([parallel] recompute): a stage other than the last keeps only each in-flight
  // micro-batch's inputs (and `device`'s generator state), not its activations, and runs its
  // forward again, with autograd and the same dropout draws, just before the backward:
  // activation checkpointing at the stage boundary, one more forward per micro-batch for the
  // memory of min(P − s, M) micro-batches' activations (parallel/generator_state.h).
  Pipeline(collective::SiteGroup& group, SiteGrid grid, int micro_batches, bool recompute = false,
           at::Device device = at::kCPU);

  int stage() const { return stage_; }
  int stages() const { return grid_.pipeline; }
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ + 1 == grid_.pipeline; }
  int micro_batches() const { return micro_; }
  // Whether this stage recomputes its forward in backward (`recompute`, not on the last stage:
  // its backward follows its forward at once, nothing waits in between).
  bool recomputes() const { return recompute_ && !last(); }

  // A parameter two stages use (the token embedding: the first stage embeds with it, the last
  // projects onto the vocabulary with it). `owner` trains it; `user` holds a copy, given the
  // owner's values at the start of every run(), whose gradient is added to the owner's at the
  // end. Every stage calls it, in the same order, with its own tensor (of the full shape on the
  // owner and the user; any elsewhere).
  void tie(const at::Tensor& param, int owner, int user);

  // One step: the forward and backward of every micro-batch, in 1F1B order; the parameters'
  // gradients accumulate in .grad (zero them before). Returns the sum of the micro-batches'
  // losses (the last stage's, sent to the others).
  double run(StageModel& model);

  // The last run()'s seconds computing (forwards and backwards) and in all: the measured
  // bubble of a stage is 1 − compute / wall.
  struct Timing {
    double compute_s = 0, wall_s = 0;
  };
  const Timing& last_timing() const { return timing_; }

 private:
  struct Micro {  // one micro-batch in flight on this stage
    std::vector<at::Tensor> inputs, outputs;  // outputs: the loss alone on the last stage; no graph when recomputed
    at::Tensor generator;                     // recomputes(): the device's generator before the forward
  };
  void forward(StageModel& model, int micro, double& loss);
  void backward(StageModel& model, int micro);
  // A forward's outputs to the next stage: a header of their dtypes and shapes, then each.
  void send_activations(const std::vector<at::Tensor>& tensors, int dst, int tag);
  int neighbour(int stage) const {
    return grid_.rank(stage, grid_.replica(group_.rank()), grid_.tensor_rank(group_.rank()));
  }

  collective::SiteGroup& group_;
  SiteGrid grid_;
  int micro_, stage_;
  bool recompute_;
  at::Device device_;
  struct Tie {
    at::Tensor param;
    int owner, user;
  };
  std::vector<Tie> ties_;
  std::map<int, Micro> live_;  // micro-batches between their forward and backward
  Timing timing_;
};

// While a built-in model is built (model::SinkScope), lets go of each layer this worker's stage
// does not hold as soon as the layer is built (model::layer_built), so the model is never whole
// here. keep(i, layer): whether the i-th layer built (in build order) stays.
class StageKeeper : public model::BuildSink {
 public:
  explicit StageKeeper(std::function<bool(size_t, torch::nn::Module&)> keep) : keep_(std::move(keep)) {}
  void layer_built(torch::nn::Module& layer) override;
  // The shapes of the parameters of `layer` if it was let go here, else null.
  const std::vector<std::vector<int64_t>>* shapes_of(const torch::nn::Module* layer) const;

 private:
  std::function<bool(size_t, torch::nn::Module&)> keep_;
  size_t built_ = 0;
  std::map<const torch::nn::Module*, std::vector<std::vector<int64_t>>> dropped_;
};

// A built-in model cut into stages, held by one worker: the units (embeddings, layers, norms:
// what ZeRO-3 gathers, model/layer_gather.h) of the other stages have their parameters let go
// (no values; their shapes remembered), so a worker holds its stage's share of the model only.
class StagedModel {
 public:
  // `units` in parameter order, unit u trained by stage owner[u]; `used` the units this worker's
  // stage also runs without training them (a tie's copy, Pipeline::tie). Lets go of the rest
  // now; `built`: the keeper the model was built under (its units let go already), or null
  // (the model was built whole, from the job's seed).
  StagedModel(std::vector<torch::nn::Module*> units, std::vector<int> owner, int stage, std::vector<size_t> used = {},
              const StageKeeper* built = nullptr);
  // The trainable parameters of this stage's units, in parameter order: what its optimizer and
  // the strategy get.
  std::vector<at::Tensor> trainable() const;
  // The whole model's parameter values (`trainable`: those that need a gradient), every stage's.
  int64_t whole_numel(bool trainable) const;
  // The shapes of the whole model's trainable parameters, every stage's, in parameter order:
  // the flat vector the sites exchange (strategy::Strategy::set_layouts).
  std::vector<std::vector<int64_t>> trainable_shapes() const;
  // Each unit's parameter values (`trainable`: those that need a gradient), every stage's.
  std::vector<int64_t> unit_numel(bool trainable) const;
  // fn() with the whole model on the first-stage workers of replicas [0, replicas): each other
  // stage's worker of those replicas sends its units' parameters to its replica's first-stage
  // worker, which lets them go again afterwards. Every worker of the site calls it (a site
  // collective); fn runs on those first-stage workers only, or with `everywhere` on every worker
  // (a fn that is itself a collective).
  void with_whole(collective::SiteGroup& group, const SiteGrid& grid, int replicas, const std::function<void()>& fn,
                  bool everywhere = false);

 private:
  std::vector<torch::nn::Module*> units_;
  std::vector<int> owner_;
  int stage_;
  std::vector<std::vector<std::vector<int64_t>>> shapes_;  // per unit, per parameter
};

}  // namespace nebula::parallel
