// A Strategy decides how training uses the WAN. The training loop calls its hooks in plain
// sight (src/train/worker.cc):
//
//   strategy->init(params)                        once: every replica starts from the same weights
//   loop while strategy->keep_training(step, steps):
//         forward, zero_grad,
//         strategy->before_backward(w)            w = this worker's loss terms (its weight)
//         backward                                (buckets start crossing the WAN as it goes)
//         strategy->sync_gradients(params, w)     gradients now averaged over every worker
//         optimizer.step()
//         strategy->after_step(step)              e.g. DiLoCo's outer step every H steps
//   strategy->finish()                            waits for what is still in flight
//
// `sync` (sync.h) is plain synchronous data parallel: every step, every worker of every site (the
// baseline). `diloco` and `streaming` (diloco.h) synchronize rarely and are measured against it.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "codec/codec.h"
#include "collective/hierarchical.h"
#include "nebula/config.h"
#include "nebula/error.h"
#include "strategy/exchange_layout.h"

namespace nebula::strategy {

// What a strategy needs to continue after a restart (checkpoints): tensors and numbers by
// name (counters travel as doubles: exact below 2^53), a few strings and its decision log.
struct StrategyState {
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, double> numbers;
  std::map<std::string, std::string> strings;
  std::vector<std::string> decisions;
  // A resharding resume's tensors left in the checkpoint file, not in `tensors` (each new
  // worker reads only its part): their numbers of values, and values [begin, begin + len) of
  // one as float32 (train/worker_checkpoint.cc).
  std::map<std::string, int64_t> unread;
  std::function<at::Tensor(const std::string& name, int64_t begin, int64_t len)> read;
  // load_resharded: how the site that wrote it held the flat vector, when in pipeline stages or
  // tensor slices (its checkpoints record them); else its ZeRO cut, from the state itself.
  std::optional<SiteLayout> written;
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string name() const = 0;
  // The model's buffers (BatchNorm's running statistics and counters, ...), kept (not copied);
  // before init(). Forward changes them on each worker; the strategy keeps them as equal as
  // it keeps the weights: sync averages them over every worker every step; diloco and
  // streaming inside the site every step and over the sites at the end of every round (not
  // with [privacy]: they are statistics of the site's data, and are not noised). The average
  // is weighted like the gradients (by the workers' and sites' weights) and taken in float32;
  // integer buffers (num_batches_tracked) are averaged too and rounded, so every worker that
  // averages ends with the same values (exact below 2^24, float32's integers).
  void set_buffers(std::vector<at::Tensor> buffers) { buffers_ = std::move(buffers); }
  // Makes every worker's parameters (and buffers) equal to global rank 0's.
  virtual void init(const std::vector<at::Tensor>& params) = 0;
  // init() for a job with shard = "full" (ZeRO-3), on every site: the parameters hold no values
  // (FullShard has them: `shapes` are theirs), `shard` holds this worker's values in the site's
  // unit layout (a site of one worker: the whole flat vector). The replicas are checked to be
  // equal (they are built from one seed) rather than made so: a difference is an error.
  virtual void init_from_shard(const std::vector<at::Tensor>& /*params*/,
                               const std::vector<std::vector<int64_t>>& /*shapes*/, const at::Tensor& /*shard*/) {
    throw ConfigError(str_cat("parallel.shard = \"full\" does not run with strategy.kind = \"", name(), "\""));
  }
  // Called just before backward, with this worker's weight for the step, so that a strategy
  // can start sending gradients while backward still runs. Optional.
  virtual void before_backward(double weight) {}
  // Called after backward and before the optimizer step.
  virtual void sync_gradients(const std::vector<at::Tensor>& params, double weight) = 0;
  // ZeRO ([parallel] shard, parallel/inner_optimizer.h), after init() and before the first step,
  // on every worker of a site of N > 1 workers: the parameters are views of `params` (N S
  // values, this worker's shard the S from rank · S). A strategy with outer state per
  // parameter keeps only this worker's shard of it (diloco and streaming: θ_global, the outer
  // momentum); sync keeps none. With `grads` defined (shard = "gradients", ZeRO-2, and "full",
  // ZeRO-3) it is this worker's S gradient values: when sync_gradients runs it holds the sum over
  // the site's workers of weight · gradient already (ZeRO-2's buckets and ZeRO-3's layers
  // reduce-scatter in backward, parallel/inner_optimizer.h), no .grad holds anything, and
  // sync_gradients leaves the site's average there; strategies that cannot throw ConfigError.
  // With `gathered` false (shard = "full", ZeRO-3, parallel/full_shard.h) `params` is this
  // worker's S values only too, the parameters gathered layer by layer where they run.
  struct Sharding {
    at::Tensor params, grads;
    bool gathered = true;
  };
  // Before init(): set_sharding() will follow (the site's workers shard the training state),
  // so a strategy may make only this worker's part of its state in init(), never the whole.
  virtual void expect_sharding() {}
  // Before init(), on every worker of a job with shard = "full": the units ZeRO-3 cuts the flat
  // parameter vector into (parallel/shard_layout.h), the same on every site.
  virtual void set_unit_bounds(std::vector<int64_t> /*bounds*/) {}
  // Before init(), on every worker of a job whose sites hold the model differently (a site of
  // pipeline stages among others, [[sites]] parallel): how every site holds the flat vector of
  // the whole model's trainable parameters (`shapes`, in order), by site index. On a staged
  // site `params` (init, sync_gradients) are this worker's stage's only, and `stage` is the
  // group of its stage's data replicas (null elsewhere). init() then checks that every site
  // starts from the same weights (a CRC over the sites' parts) instead of making them so.
  struct Layouts {
    std::vector<SiteLayout> sites;
    std::vector<std::vector<int64_t>> shapes;
    collective::SiteGroup* stage = nullptr;   // a staged (sliced) site's worker: its stage's (slice's) replicas
    collective::SiteGroup* tensor = nullptr;  // a sliced site's worker: its replica's slices
  };
  virtual void set_layouts(Layouts /*layouts*/) {
    throw ConfigError(str_cat("strategy.kind = \"", name(), "\" does not run sites of pipeline stages or tensor slices in a job of "
                              "several sites (its whole gradients cross the WAN every step): use diloco or streaming"));
  }
  virtual void set_sharding(const Sharding& shards) {
    if (shards.grads.defined())
      throw ConfigError(str_cat("parallel.shard = \"", shards.gathered ? "gradients" : "full",
                                "\" does not run with strategy.kind = \"", name(),
                                "\" (its gradients cross the WAN every step, whole): use shard = \"optimizer\""));
  }
  // Called before after_step with the step's training loss on this worker (per predicted
  // token), for a strategy that watches quality (diloco's merge gap, merge_gap.h). Optional.
  virtual void observe_loss(double /*loss*/) {}
  // Called after the optimizer step `step` (0-based).
  virtual void after_step(int64_t step) {}
  // Whether to run step `step` (0-based) of a job of `steps` steps. Strategies whose sites
  // run different numbers of inner steps (heterogeneous diloco) count rounds instead.
  virtual bool keep_training(int64_t step, int64_t steps) { return step < steps; }
  // After the last step: completes every exchange still in flight.
  virtual void finish() {}
  // Runs `fn` (an evaluation) with the parameters holding the model every site agrees on, and
  // puts this worker's own back after it: diloco and streaming evaluate θ_global, not the
  // local replica halfway through a round; sync's replicas are the global model already.
  // Every worker of the site calls it at the same step (sharded, it is a site collective);
  // the training thread's, between steps.
  virtual void with_global_weights(const std::function<void()>& fn) { fn(); }
  // The decisions made while running (adaptive controller, per-site inner steps), one line
  // each, for the log and summary.json.
  virtual std::vector<std::string> decisions() const { return {}; }
  // Counters for metrics lines and summary.json (e.g. rejected updates, privacy spent).
  virtual std::map<std::string, double> metrics() const { return {}; }

  // Checkpoints. can_save(): whether the state is complete between steps now (nothing on
  // the WAN); the same answer on every worker of a site. save_state/load_state: after init(),
  // between steps. load_state throws DataError naming what is missing or does not fit.
  virtual bool can_save() const { return true; }
  // Completes what is on the WAN now, early (streaming with delay >= H/F is never idle
  // between steps: a checkpoint or stop that waited `delay` steps drains it instead).
  virtual void drain() {}
  virtual void save_state(StrategyState& out) const = 0;
  virtual void load_state(const StrategyState& in) = 0;
  // Resume under another layout ([parallel] shard or the site's workers changed since the
  // checkpoint): the states of every worker of the site that wrote it, in rank order (their
  // sharded tensors possibly unread: StrategyState::read). The default takes rank 0's (a state
  // that is the same on every worker, or the gateway's alone).
  virtual void load_resharded(const std::vector<StrategyState>& ranks) { load_state(ranks.at(0)); }
  // After a resume, on every worker of every site: brings the sites to one global state if
  // their checkpoints differ (e.g. one site's newest checkpoint is a round behind).
  virtual void reconcile() {}
  // Elastic rejoin (diloco, streaming): this site restarted and joins the running job.
  virtual void join() { throw Error(str_cat(name(), " cannot rejoin a running job: use diloco or streaming")); }

 protected:
  std::vector<at::Tensor> buffers_;  // set_buffers(); the training thread's
};

// The gateway's codec states (error feedback ...) as "codec/TAG/I/..." entries, and back.
void save_codec_states(const collective::Hierarchy& comm, StrategyState& out);
void load_codec_states(collective::Hierarchy& comm, const StrategyState& in);

// `num_sites` and `site_index` describe the job (diloco/streaming exchange per-site numbers).
// `privacy` ([privacy]) applies to diloco/streaming.
std::unique_ptr<Strategy> make_strategy(const StrategyConfig& config, collective::Hierarchy& comm,
                                        std::chrono::milliseconds timeout = std::chrono::minutes(10),
                                        size_t num_sites = 1, size_t site_index = 0,
                                        const PrivacyConfig& privacy = {});
// The codec [strategy] asks for; null for "none". `kind` overrides config.codec (e.g. the
// controller's choice).
std::unique_ptr<codec::Codec> make_wan_codec(const StrategyConfig& config, const std::string& kind = "");
codec::CodecOptions wan_codec_options(const StrategyConfig& config);

// Makes every worker's `params` equal to global rank 0's. Replicas built from the same seed
// are usually equal already, so first a CRC-32 of rank 0's values is compared everywhere (a
// few bytes on the WAN); the full broadcast runs only where some replica differs.
void make_replicas_equal(collective::Hierarchy& comm, const std::vector<at::Tensor>& params);
// The comparison alone: whether global rank 0's `crc` equals every worker's that `counts` (a job
// collective: every worker calls it; a few bytes on the WAN).
bool replicas_agree(collective::Hierarchy& comm, uint32_t crc, bool counts = true);

// Flattens tensors into one contiguous float32 vector in host memory (whatever their device),
// and back (in place, onto their device; integer tensors get the values rounded to the nearest).
at::Tensor flatten(const std::vector<at::Tensor>& tensors);
void unflatten_into(const at::Tensor& flat, const std::vector<at::Tensor>& tensors);

}  // namespace nebula::strategy
