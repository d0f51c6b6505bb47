// ZeRO-3 ([parallel] shard = "full"): the model's trainable parameters live sharded over the
// site's N workers, and are gathered only while they are used.
//
// Layout: the trainable parameters seen as one flat vector of n values, padded to N equal
// shards of S = ceil(n / N), as ZeRO-1's (parallel/inner_optimizer.h): this worker keeps its shard
// r = values [r S, (r + 1) S) for good (shard(), with its gradient shard_grad()); AdamW's
// moments and diloco's outer state cover the same S values. So checkpoints, resharding and the
// strategies' parts are the same as with "optimizer" and "gradients".
//
// A training step:
//   begin_step()      gathers the parameters outside the layers (embeddings, final norms: the
//                     "rest", small next to the layers) for the whole step;
//   forward           each layer (model/layer_gather.h: MlmEncoder's and Seq2Seq's) gathers its
//                     parameters (a ring all-gather of the layer's range of the flat vector,
//                     SiteGroup::all_gather_parts), runs without autograd, and frees them; only
//                     the layer's inputs are kept;
//   backward          reaches the layer: gathers its parameters again, recomputes the layer with
//                     autograd (the generator restored, so dropout draws the same masks), takes
//                     the gradients of its inputs and parameters, multiplies the parameters'
//                     by this worker's weight (set_grad_weight) and reduce-scatters them
//                     (SiteGroup::reduce_scatter_parts) into shard_grad(); frees the layer;
//   end_backward()    the rest's gradients, weighted, reduce-scattered into shard_grad() too;
//                     the rest freed.
// shard_grad() then holds Σ_workers w · g for this worker's shard, as ZeRO-2's reduce-scatter
// leaves it (the same products, summed in the same ring order): the strategy divides by the
// site's weight. The cost: one more forward of every layer (activation recomputation, about a
// third more compute per step) and two all-gathers of the model per step instead of one.
//
// Outside a step, validation runs layer by layer too (with_rest); the gateway's evaluation and
// the model file gather every parameter on the gateway only (with_full_model): one model-sized
// copy, no gradients or moments. Checkpoints gather nothing: each rank saves its shard
// (InnerOptimizer::save); a resume writes it back inside with_full_model.
//
// One thread (the training thread) uses it, as the model. CPU float32 parameters only.
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

class FullShard : public model::LayerGather {
 public:
  // `params`: the trainable parameters, in the optimizer's order, whole (every worker's the
  // same). `layers`: the modules the model runs through run() (each layer's trainable
  // parameters must be consecutive in `params`). From here on the parameters hold no values
  // outside a gather (0-element tensors): this worker keeps only its shard.
  FullShard(std::vector<at::Tensor> params, const std::vector<torch::nn::Module*>& layers, collective::SiteGroup& site);
  ~FullShard() override;

  // This worker's S values of the flat parameter vector (a leaf: AdamW optimizes it in place),
  // and their gradient (the leaf's .grad).
  const at::Tensor& shard() const { return shard_; }
  const at::Tensor& shard_grad() const { return shard_grad_; }
  int64_t shard_numel() const { return shard_numel_; }
  int64_t total_numel() const { return total_numel_; }

  void begin_step();
  void set_grad_weight(double weight) { weight_ = weight; }
  void end_backward();

  // fn() with every parameter gathered (site collective: every worker calls it at the same
  // point). What fn writes into the parameters (a checkpoint's weights) is kept: this worker's
  // shard is taken from them afterwards. Nested calls gather once. `root_only`: only rank 0
  // gathers (the others send it their shards, and their fn must not use the model): the
  // gateway's evaluation and model file, with no model-sized copy on the other workers.
  void with_full_model(const std::function<void()>& fn, bool root_only = false);
  // fn() with the parameters outside the layers gathered, on every worker, for forwards
  // without autograd that gather each layer as it runs (validation): every worker must run
  // the same layers in the same order.
  void with_rest(const std::function<void()>& fn);

  at::Tensor run(torch::nn::Module& layer, const std::vector<at::Tensor>& inputs, const Body& body) override;

  // Autograd's side (GatheredLayer in full_shard.cc): the call's body and state, by index.
  struct Call {
    size_t unit;
    Body body;
    at::Tensor generator_state;  // the CPU generator before the forward (for the recomputation)
  };
  Call& call(size_t i) { return calls_.at(i); }
  // Gathers unit `u` (its parameters become views of a fresh buffer); release frees it.
  void gather(size_t u);
  void release(size_t u);
  // Adds weight · the unit's parameter gradients (`grads`, one per parameter, undefined = 0),
  // reduce-scattered over the site, into shard_grad().
  void reduce_gradients(size_t u, const std::vector<at::Tensor>& grads);
  std::vector<at::Tensor> unit_params(size_t u) const;

 private:
  struct Range {
    size_t first, last;  // parameters [first, last)
    int64_t begin, end;  // values [begin, end) of the flat vector
  };
  std::vector<int64_t> counts(const Range& r) const;  // each worker's part of the range
  void gather_range(const Range& r, at::Tensor& buffer);
  void drop_range(const Range& r);

  std::vector<at::Tensor> params_;
  std::vector<std::vector<int64_t>> shapes_;
  collective::SiteGroup& site_;
  int64_t total_numel_ = 0, shard_numel_ = 0;
  std::vector<int64_t> start_;        // each parameter's first value in the flat vector
  std::vector<Range> units_;          // one per layer
  std::map<const torch::nn::Module*, size_t> unit_of_;
  std::vector<Range> rest_;           // runs of parameters outside every layer
  std::vector<at::Tensor> unit_buffers_;  // per unit: its gathered values while gathered
  std::vector<at::Tensor> rest_buffers_, rest_grads_;  // per run, during a step
  at::Tensor shard_, shard_grad_;
  at::Tensor full_;                   // with_full_model: every value (N S)
  bool root_only_ = false;            // with_full_model on a rank other than 0: nothing gathered here
  int full_depth_ = 0;
  double weight_ = 1;
  std::vector<Call> calls_;           // this step's layer calls
  at::Tensor anchor_;                 // an empty leaf that needs a gradient: every layer call is differentiable
};

// fn() with the whole model present: gathered by full->with_full_model (ZeRO-3; `root_only`:
// on the gateway only), or directly when `full` is null (the parameters are whole already).
inline void with_whole_model(FullShard* full, const std::function<void()>& fn, bool root_only = false) {
  if (full)
    full->with_full_model(fn, root_only);
  else
    fn();
}

}  // namespace nebula::parallel
