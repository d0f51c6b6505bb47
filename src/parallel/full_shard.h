// ZeRO-3 ([parallel] shard = "full"): the model's trainable parameters live sharded over the
// site's N workers, and are gathered only while they are used, as FSDP does.
//
// Layout (parallel/shard_layout.h): the trainable parameters seen as one flat vector, cut into
// units — each module the model runs through run() (the built-in models': the embeddings, each
// layer, the final norms; a unit run several times a step, as the tied token embedding is, is
// gathered for each use), and each run of parameters between them (the "rest": a classifier's
// head) — and every unit into N pieces of ceil(n_u / N), one per
// worker. This worker keeps its piece of every unit for good (shard(), S values, with its
// gradient shard_grad()); AdamW's moments and diloco's outer state cover the same S values. So a
// unit's all-gather and reduce-scatter move (N - 1)/N of the unit per worker, every worker
// sending in every ring step, where a layer cut from one flat vector would lie inside one or two
// workers' shards and travel hop by hop, N - 1 times its size.
//
// A training step:
//   begin_step()      gathers the rest for the whole step;
//   forward           each layer (model/layer_gather.h: MlmEncoder's and Seq2Seq's) gathers its
//                     unit (SiteGroup::all_gather_parts) into the unit's buffer, runs, and frees
//                     the buffer's bytes (kept in UnitBlocks for the next unit of that size).
//                     Without recompute (the default) the layer runs with
//                     autograd and keeps its activations, as an unsharded layer would; with
//                     `recompute` only the layer's inputs are kept;
//   backward          reaches the layer: gathers the unit again into the same storage (the saved
//                     tensors see it), takes the gradients of its inputs and parameters (with
//                     recompute: after running the layer again with autograd, the generator
//                     restored so dropout draws the same masks), multiplies the parameters' by
//                     this worker's weight (set_grad_weight) and reduce-scatters them
//                     (SiteGroup::reduce_scatter_parts) into shard_grad(); frees the unit;
//   end_backward()    the rest's gradients, weighted, reduce-scattered into shard_grad() too;
//                     the rest freed.
// shard_grad() then holds Σ_workers w · g for this worker's pieces: the strategy divides by the
// site's weight. The cost: two all-gathers of the model per step instead of one (and with
// recompute one more forward of every layer, about a third more compute).
//
// Outside a step, validation runs layer by layer too (with_rest), and so does the gateway's
// evaluation, each layer gathered to the gateway alone (with_rest_to_root); the model file
// gathers every parameter on the gateway only (with_full_model): one model-sized copy, no
// gradients or moments. Checkpoints gather nothing: each rank saves its shard
// (InnerOptimizer::save), and a resume writes it straight back (from another layout, or from a
// checkpoint holding the parameters whole, the pieces this worker holds now, read by range).
//
// held_numel() counts the gathered values this worker holds now (a unit's storage while it is
// gathered), so a test can check that no more than the units in use are ever whole.
//
// One thread (the training thread) uses it, as the model. Float32 parameters, on the CPU or all on
// one GPU (the site's device): the shard, its gradient and the gathered units live there, and the
// site's collectives carry them through host copies (collective/site_group.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <map>
#include <set>
#include <vector>

#include <c10/core/Allocator.h>

#include "collective/site_group.h"
#include "model/layer_gather.h"
#include "parallel/shard_layout.h"
#include "util/thread_annotations.h"

namespace nebula::parallel {

struct FullShardOptions {
  bool recompute = false;  // [parallel] recompute: keep only the layers' inputs, run them again in backward
  // [parallel] prefetch: while a layer computes, the next layer's all-gather runs on a second
  // group of the site (its own thread), one layer ahead: forward in the order of the last
  // step's layer calls, backward in the reverse order of this step's. At most the rest, the
  // layer in use and the one ahead are gathered at once. Needs the `prefetch_group`.
  bool prefetch = false;
};

// ZeRO-3's initialisation without a whole model (model/layer_gather.h, BuildSink): installed
// while the task builds its model, it takes each layer as soon as it is built, keeps this
// worker's piece of it (the layer is one unit: ShardLayout's piece of a unit of the layer's size)
// and leaves its parameters holding no values (their shapes over storage of 0 bytes), so at most one
// layer is whole at a time. FullShard then takes the pieces instead of cutting them. The
// parameters outside the declared modules (the rest) stay whole until FullShard cuts them. Not for PEFT (whose trainable parameters are chosen after the model is built) nor for
// models loaded from a file (model.init): those are built whole, as before. `device`: the site's
// (where the model goes after it is built): the kept layers' parameters are left as shells there.
class PieceKeeper : public model::BuildSink {
 public:
  PieceKeeper(int64_t workers, int64_t rank, at::Device device = at::kCPU)
      : workers_(workers), rank_(rank), device_(device) {}
  void layer_built(torch::nn::Module& layer) override;
  // This worker's piece of the layer whose first parameter is `first`, or an undefined tensor
  // when that layer was not kept here.
  at::Tensor piece_of(const at::Tensor& first) const;
  bool kept(const at::Tensor& param) const { return parked_.count(param.unsafeGetTensorImpl()) > 0; }
  size_t layers() const { return pieces_.size(); }

 private:
  int64_t workers_, rank_;
  at::Device device_;
  std::map<const c10::TensorImpl*, at::Tensor> pieces_;  // by the layer's first parameter
  std::set<const c10::TensorImpl*> parked_;              // every parameter of a kept layer
};

// The freed bytes of gathered units, kept for the next gather of a unit of the same size
// instead of going back to the heap: a step gathers and frees every layer twice, and glibc's
// heap, given a layer-sized block back, hands parts of it to smaller tensors (activations,
// gradients) and grows for the next layer (docs/architecture.md, ZeRO-3: a 57.5M-parameter
// worker's heap grew to 864-955 MiB for at most 575 MiB in use).
// Holds at most `capacity` free blocks (the units a step holds at once); a block beyond that
// goes back to its allocator. Thread-safe (the prefetch thread gathers too).
class UnitBlocks {
 public:
  explicit UnitBlocks(size_t capacity) : capacity_(capacity) {}
  // `bytes` from a kept block of that size, else from `allocator`.
  c10::DataPtr take(c10::Allocator& allocator, size_t bytes) EXCLUDES(mu_);
  // Keeps `block` (of `bytes`) for a later take, or frees it when `capacity` blocks are kept.
  void keep(c10::DataPtr block, size_t bytes) EXCLUDES(mu_);
  // Bytes held in kept blocks now.
  size_t kept_bytes() const EXCLUDES(mu_);

 private:
  const size_t capacity_;
  mutable Mutex mu_;
  std::vector<std::pair<size_t, c10::DataPtr>> free_ GUARDED_BY(mu_);
};

class FullShard : public model::LayerGather {
 public:
  // `params`: the trainable parameters, in the optimizer's order, whole (every worker's the
  // same). `layers`: the modules the model runs through run() (each layer's trainable
  // parameters must be consecutive in `params`). From here on the parameters hold no values
  // outside a gather (0-element tensors): this worker keeps only its shard.
  using Options = FullShardOptions;
  // `prefetch_group`: a second group of the site's workers (SiteGroup::fork), exactly when
  // options.prefetch; the prefetches' collectives run on it, from their own thread.
  // `kept`: the pieces a PieceKeeper kept while the model was built (its layers' parameters
  // hold no values, only their shapes); null: every parameter is whole.
  FullShard(std::vector<at::Tensor> params, const std::vector<torch::nn::Module*>& layers, collective::SiteGroup& site,
            Options options = {}, std::unique_ptr<collective::SiteGroup> prefetch_group = nullptr,
            const PieceKeeper* kept = nullptr);
  ~FullShard() override;

  // This worker's S values of the flat parameter vector (a leaf: AdamW optimizes it in place),
  // and their gradient (the leaf's .grad).
  const at::Tensor& shard() const { return shard_; }
  const at::Tensor& shard_grad() const { return shard_grad_; }
  int64_t shard_numel() const { return layout_.shard_numel(); }
  int64_t total_numel() const { return layout_.total(); }
  const ShardLayout& layout() const { return layout_; }
  // Where the parameters, the shard and the gathered units are (the site's device).
  const at::Device& device() const { return device_; }
  // The trainable parameters' shapes (the parameters themselves hold no values outside a gather).
  const std::vector<std::vector<int64_t>>& shapes() const { return shapes_; }
  // Parameter i's first value in the flat vector, and its number of values (whatever it holds now).
  int64_t param_begin(size_t i) const { return start_.at(i); }
  int64_t param_numel(size_t i) const { return start_.at(i + 1) - start_.at(i); }
  // The flat vector's unit bounds this model cuts into (ShardLayout): every layer's range and the
  // runs between them. The same on every site of the job, whatever its number of workers, so a
  // site can work out another's layout (wan.mode = "every_worker").
  static std::vector<int64_t> unit_bounds(const std::vector<at::Tensor>& params,
                                          const std::vector<torch::nn::Module*>& layers);
  // Values of gathered units this worker holds now, and the most it held at once since the last
  // reset_peak() (measured at every gather).
  int64_t held_numel() const;
  int64_t peak_held_numel() const { return peak_held_; }
  // Gathers a prefetch had done (or begun) before the layer asked for them.
  int64_t prefetch_hits() const { return prefetch_hits_; }
  // Bytes the prefetches sent to the site's other workers (their group's SiteGroup::bytes_sent).
  uint64_t prefetch_bytes_sent() const { return prefetch_group_ ? prefetch_group_->bytes_sent() : 0; }
  void reset_peak() { peak_held_ = held_numel(); }

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
  // fn() on rank 0 only, for the gateway's forwards without autograd (its evaluation): the
  // parameters outside the layers gathered to rank 0 for fn, and each layer gathered to it as it
  // runs and freed after, while the other workers send their pieces of whichever layer rank 0
  // names next (a broadcast before each gather) until fn ends; their fn is not called. So the
  // gateway holds at most the rest and one layer, and its peers wait in one layer's gather at a
  // time, not in the next collective while the gateway evaluates the whole model.
  void with_rest_to_root(const std::function<void()>& fn);

  at::Tensor run(torch::nn::Module& layer, const std::vector<at::Tensor>& inputs, const Body& body) override;

  // Autograd's side (GatheredLayer in full_shard.cc): the call's body and state, by index.
  struct Call {
    size_t unit;
    Body body;
    at::Tensor generator_state;  // the device's generator before the forward (for the recomputation)
    // Without recompute: the layer's output with its graph, and the inputs it was run on.
    at::Tensor out;
    std::vector<at::Tensor> inputs;
  };
  bool recompute() const { return options_.recompute; }
  Call& call(size_t i) { return calls_.at(i); }
  // Gathers layer `u` (its parameters become views of the unit's buffer); release frees the
  // buffer's storage, and with `keep_views` leaves the parameters viewing it (a graph saved
  // them: the next gather refills the same storage), else empties them.
  void gather(size_t u);
  void release(size_t u, bool keep_views = false);
  // With prefetch: starts gathering the layer expected after call `call` (forward) or before it
  // (backward).
  void prefetch_after(size_t call, bool backward);
  // Adds weight · the unit's parameter gradients (`grads`, one per parameter, undefined = 0),
  // reduce-scattered over the site, into shard_grad(). A layer called more than once in the step
  // (the tied token embedding) adds its calls' gradients up and reduce-scatters them after the
  // last call's backward: the same sums as unsharded, holding that layer's gradient meanwhile.
  void reduce_gradients(size_t u, const std::vector<at::Tensor>& grads);
  std::vector<at::Tensor> unit_params(size_t u) const;

 private:
  struct Range {
    size_t first, last;  // parameters [first, last)
    int64_t begin, end;  // values [begin, end) of the flat vector
    size_t unit;         // its unit in layout_
  };
  // Gathers range r into its unit's buffer on every worker (`to_root`: on rank 0 only), the
  // parameters viewing it; drop frees the storage (and empties the parameters unless keep_views).
  void gather_range(const Range& r, bool to_root = false);
  void drop_range(const Range& r, bool keep_views = false);
  // Reduce-scatters `grads` (range r's values, weighted) and adds this worker's piece into shard_grad_.
  void reduce_range(const Range& r, at::Tensor grads);
  // Fills unit u's buffer (storage resized) by an all-gather on `group`; no other state touched,
  // so the prefetch thread may run it.
  void fill_unit(size_t u, collective::SiteGroup& group);
  // Prefetch: starts layer `l`'s gather on the prefetch group (one at a time: an earlier one is
  // waited for first); finish_prefetch waits for the one in flight and marks its unit gathered.
  void start_prefetch(size_t l);
  void finish_prefetch();
  // Gives unit buffer `buffer`'s storage `bytes` (0: none), through blocks_.
  void set_unit_bytes(const at::Tensor& buffer, int64_t bytes);


  std::vector<at::Tensor> params_;
  std::vector<std::vector<int64_t>> shapes_;
  collective::SiteGroup& site_;
  Options options_;
  at::Device device_ = at::kCPU;
  std::vector<int64_t> start_;        // each parameter's first value in the flat vector
  ShardLayout layout_;
  std::vector<Range> layers_;         // one per layer
  std::map<const torch::nn::Module*, size_t> layer_of_;
  std::vector<Range> rest_;           // runs of parameters outside every layer
  UnitBlocks blocks_;                 // freed unit bytes kept for the next gather
  std::vector<at::Tensor> buffers_;   // per unit: the gathered values (storage of 0 bytes while not gathered)
  std::vector<bool> gathered_;        // per unit
  std::vector<at::Tensor> rest_grads_;  // per run, during a step
  bool in_step_ = false, in_rest_ = false;
  at::Tensor shard_, shard_grad_;
  bool whole_ = false;                // inside with_full_model, holding every unit
  bool root_only_ = false;            // with_full_model on a rank other than 0: nothing gathered here
  bool to_root_ = false;              // inside with_rest_to_root on rank 0: each layer gathered to it as it runs
  double weight_ = 1;
  int64_t peak_held_ = 0;
  std::unique_ptr<collective::SiteGroup> prefetch_group_;
  std::future<void> prefetch_;        // the gather in flight on the prefetch thread (buffers_[prefetch_unit_] is its)
  size_t prefetch_unit_ = 0;
  int64_t prefetch_hits_ = 0;
  std::vector<size_t> last_calls_;    // the last step's layer calls, in forward order (the next forward's prediction)
  std::vector<Call> calls_;           // this step's layer calls
  std::vector<int> uses_left_;        // per layer: its calls this step whose backward has not run
  std::vector<at::Tensor> pending_grads_;  // per layer used more than once: its uses' gradients so far
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
