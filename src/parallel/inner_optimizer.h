// The inner optimizer of a worker: AdamW over the model's trainable parameters, whole or
// sharded over the site's workers ([parallel] shard, nebula/config.h).
//
//  shard = "none"       AdamW over every parameter: each worker holds both moments in full.
//  shard = "optimizer"  ZeRO-1. The parameters are seen as one flat vector of n elements,
//                       padded to N equal shards of S = ceil(n / N) (N = the site's workers);
//                       this worker's AdamW optimizes one tensor, its shard r = elements
//                       [r S, (r + 1) S), so it holds 2 S moments instead of 2 n. The
//                       parameters' storage becomes one flat buffer of N S values (set_data:
//                       the module's tensors stay the same objects), and AdamW's parameter is
//                       this worker's S of it, so step() updates the shard in place, from the
//                       shard's slice of the (already averaged) gradients, and the in-place
//                       ring all-gather fills in the other workers' shards: no copy of the
//                       model is made.
//                       Elementwise, this is the same AdamW update as shard = "none". One
//                       difference: a parameter without a gradient in a step is skipped by
//                       the whole AdamW but gets a zero gradient here (moments decay, weight
//                       decay applies); the strategies fill every gradient, so it does not
//                       arise in nebula's own loop.
//                       The gradients live in one flat buffer of the same layout (every
//                       .grad a view of it), so AdamW reads the shard's slice in place.
//  shard = "gradients"  ZeRO-2: as "optimizer", but the gradients are reduce-scattered bucket
//                       by bucket while backward runs (parallel/gradient_buckets.h, between
//                       before_backward and end_backward): flat_grad() is this worker's S
//                       values only, Σ_workers w · g after end_backward (the strategy divides
//                       by the site's weight), and every parameter's .grad stays undefined, so
//                       no worker holds the whole gradient. The same update up to the
//                       summation order of the site's gradients (bit-identical with 2 workers,
//                       whose sums are a + b either way; with more, each value is summed round
//                       the ring as one reduce-scatter of the whole gradient sums it).
//  shard = "full"       ZeRO-3 (parallel/full_shard.h): the parameters themselves are sharded in
//                       the same layout and gathered layer by layer; AdamW optimizes the
//                       FullShard's shard in place, from its gradient shard (summed by the
//                       layers' reduce-scatters in backward, averaged by the strategy), and
//                       nothing is all-gathered after the step.
//
// Checkpoints (save/load through optimizer_state.h) hold this worker's moments only: with
// shard = "optimizer", "gradients" or "full" a checkpoint is sharded, one shard per rank
// directory, and it holds this worker's shard of the trainable parameters too
// ("optim/0/param", S values; the model's other tensors stay whole in "model/..."), so no
// worker gathers the model to checkpoint it. load_resharded resumes them under another shard
// mode or number of workers.
#pragma once

#include <torch/optim/adamw.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "collective/site_group.h"
#include "nebula/config.h"
#include "parallel/checkpoint.h"
#include "parallel/full_shard.h"
#include "parallel/gradient_buckets.h"
#include "parallel/shard_layout.h"

namespace nebula::parallel {

// The learning rate of 0-based step `step` of a job of `steps` steps ([model] lr_schedule):
// linear warmup from lr/warmup_steps to lr over the first warmup_steps steps, then lr
// ("constant") or a decay to lr_floor·lr at the last step ("cosine": half a cosine; "linear").
double scheduled_lr(const ModelConfig& model, int64_t step, int64_t steps);

class InnerOptimizer {
 public:
  // nebula::Error for an unknown `shard`. `full`: ZeRO-3's sharded parameters (not owned), given
  // exactly when shard = "full" on a site of more than one worker.
  // `bucket_bytes`: ZeRO-2's gradient buckets ([parallel] bucket).
  InnerOptimizer(std::vector<at::Tensor> params, double lr, double weight_decay, const std::string& shard,
                 collective::SiteGroup& site, FullShard* full = nullptr, uint64_t bucket_bytes = 4ull << 20);

  void zero_grad();
  // Around the step's backward, with this worker's weight: ZeRO-2's buckets and ZeRO-3's layers
  // weight this worker's gradients and reduce-scatter them over the site as backward makes them;
  // after end_backward() flat_grad() holds Σ_workers w · g on this worker's shard. Site
  // collectives; nothing happens unsharded or with ZeRO-1 (the strategy averages the .grad).
  void before_backward(double weight);
  void end_backward();
  // ZeRO-2's buckets (null otherwise): a test's spy on what they hold.
  const GradientBuckets* gradient_buckets() const { return buckets_.get(); }
  // One AdamW step on the gradients in the parameters' .grad(); when sharded a
  // site collective (every worker of the site calls it at the same step).
  void step();
  // The learning rate of the next step() (scheduled_lr).
  void set_lr(double lr);
  // Scales the gradients that the next step() uses (the site's average, after the strategy's
  // sync) so that their global L2 norm is at most max_norm > 0, and returns the norm before.
  // The same scale on every worker of the site: sharded gradients' norm is summed over the
  // site (a site collective then, like step()).
  double clip_grad_norm(double max_norm);
  // After a backward that ran without before_backward (a pipeline stage's micro-batches, each
  // accumulating into .grad): ZeRO-2 reduce-scatters weight · the accumulated gradients now, as
  // its buckets do during a backward; otherwise there is nothing to do.
  void reduce_accumulated(double weight);
  // Pipeline stages (parallel/pipeline.h): the parameters are one stage's, so clip_grad_norm's
  // squares are summed over `group` (the site: every stage of every replica, a collective then)
  // and divided by `copies` (the data replicas, which hold the same averaged gradients; ZeRO-2's
  // shards partition the stage and count once), so the norm is the whole model's. Not ZeRO-3.
  // Tensor slices (parallel/tensor_parallel.h) likewise, `weights` (one per parameter, empty:
  // all 1) counting a parameter whole on every slice's worker once: 1 / tensor for it, 1 for a
  // slice (ZeRO-2: elementwise over this worker's shard of the gradients).
  void set_norm_group(collective::SiteGroup* group, int copies, std::vector<double> weights = {});

  // Elements whose AdamW moments this worker holds (n, or S when sharded).
  int64_t state_numel() const { return sharded_ ? shard_numel_ : total_numel_; }
  int64_t total_numel() const { return total_numel_; }
  bool sharded() const { return sharded_; }
  // ZeRO-1: flat_grad() is N S values, every parameter's .grad a view of it (the strategy
  // averages them whole). ZeRO-2 and ZeRO-3: this worker's S gradient values only, summed over
  // the site in backward (end_backward), which the strategy divides by the site's weight.
  bool gradients_sharded() const { return gradients_sharded_; }
  const at::Tensor& flat_grad() const { return flat_grad_; }
  // Sharded: the parameters' storage, N S values (Strategy::set_sharding); ZeRO-3: this
  // worker's S of them (params_gathered() false); undefined otherwise.
  const at::Tensor& flat_params() const { return full_ ? shard_ : flat_; }
  bool params_gathered() const { return full_ == nullptr; }
  // Who holds which of the flat vector's values: ZeRO-3's units (FullShard::layout), else one
  // unit over the site's workers (one worker unsharded).
  ShardLayout layout() const;

  // Sharded: this worker's shard of the trainable parameters goes in too ("optim/0/param").
  void save(Checkpoint& out) const;
  // Sharded, from a checkpoint that holds the parameters' shard: it is written back and the
  // site all-gathers (ZeRO-1/2; a site collective); ZeRO-3 writes it into FullShard's shard
  // (the same layout: nothing gathered).
  void load(const Checkpoint& in);
  // Whether the checkpoint holds the trainable parameters as shards ("optim/0/param"), not
  // whole in "model/...".
  static bool holds_parameter_shards(const Checkpoint& k);
  // Resume under another layout ([parallel] shard or the site's workers changed since the
  // checkpoint): `ranks` are the checkpoints of every worker of the site that wrote them, in
  // rank order, all of one step. This worker reads of every old one's moments (and parameter
  // shard) only the values of its own part (all of them unsharded): elementwise the same AdamW
  // state, and no whole copy when sharded (ranks whose tensors were left unread in their files
  // are read by range). Sharded, the parameters go straight into this worker's shard (ZeRO-1/2
  // then all-gather them: a site collective). DataError naming what does not fit.
  void load_resharded(const std::vector<const Checkpoint*>& ranks);

 private:
  std::vector<at::Tensor> params_;     // the model's (kept, not copied)
  std::vector<at::Tensor> optimized_;  // what AdamW holds: params_, or {shard_}
  collective::SiteGroup& site_;
  FullShard* full_;
  collective::SiteGroup* norm_group_ = nullptr;  // set_norm_group
  int norm_copies_ = 1;
  std::vector<double> norm_weights_;  // per parameter; empty: 1 each
  at::Tensor norm_shard_weights_;     // ZeRO-2 with weights: per value of this worker's gradient shard
  void rebind_grads();  // every .grad back to its view of flat_grad_
  // Writes `values` into the flat parameter vector from `begin` (what lies past its n values,
  // the padding, is dropped), through the parameters: whole ones (ZeRO-3: inside a gather).
  void write_flat(const at::Tensor& values, int64_t begin);

  bool sharded_ = false, gradients_sharded_ = false;
  int64_t total_numel_ = 0, shard_numel_ = 0;
  at::Tensor flat_;                    // N S: the parameters' storage (sharded only)
  at::Tensor flat_grad_;               // the parameters' gradients: N S (ZeRO-1), S (ZeRO-2/3)
  std::vector<at::Tensor> grad_views_;  // each parameter's view of flat_grad_
  at::Tensor shard_;                   // a leaf sharing this worker's S of flat_ (grad: of flat_grad_)
  std::unique_ptr<GradientBuckets> buckets_;  // ZeRO-2
  std::unique_ptr<torch::optim::AdamW> adamw_;
};

}  // namespace nebula::parallel
