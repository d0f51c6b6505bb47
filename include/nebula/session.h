// nebula as a library: your own LibTorch training loop, with nebula's communication across
// sites — the hierarchical all-reduce and the WAN strategies — the way DDP wraps a model.
//
//   #include <nebula/session.h>
//
//   nebula::Config config = nebula::load_config("job.toml");           // [[sites]], [wan], [strategy], [security]
//   nebula::Session session(config, "alpha", 0);                       // or nebula::Session(config, placement)
//   nebula::Synchronizer sync(session, params);                        // every replica now starts equal
//   for (int64_t step = 0; sync.keep_training(step); ++step) {
//     at::Tensor loss = ...;                                           // forward on this worker's own data
//     optimizer.zero_grad();
//     sync.before_backward(weight);                                    // weight: e.g. the batch's examples
//     loss.backward();
//     sync.sync_gradients(weight);                                     // sync: gradients averaged over the job
//     optimizer.step();
//     sync.after_step(step);                                           // diloco/streaming: outer steps
//   }
//   sync.finish();
//   session.allreduce(t);                                              // any float tensor, averaged over every worker
//
// A Session is one worker of one site: it joins the site's c10d group (rendezvous at the
// site's `store`) and, on local rank 0 (the site's gateway), dials or accepts the other
// sites' gateways over mutual TLS per [security], with [wan]'s emulation if configured.
// Every worker of every site must construct its Session (the constructor blocks until all
// have, bounded by job.timeout) and make the same collective calls in the same order.
// Workers are started however you like: `--site/--rank`, or nebula::resolve_placement reads
// torchrun's, Open MPI's or Slurm's variables (nebula/placement.h).
//
// The Synchronizer runs config.strategy (sync | diloco | streaming, with its codec, outer
// optimizer, update guard and differential privacy) over the given parameters; there can be
// one per Session. Checkpoints, elastic rejoin and evaluation are `nebula worker`'s; a library
// user keeps their own.
//
// Errors are nebula exceptions (nebula/error.h): ConfigError for the config, Timeout when a
// peer does not come, PeerLost when one goes, DataError for bad data, all naming what and who.
// Not thread-safe: one thread per Session.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "nebula/config.h"
#include "nebula/placement.h"

namespace nebula {

// LibTorch's intra-op threads and OpenBLAS's pool (which LibTorch's setting does not reach).
// Several workers on one machine: give each 1, or they fight over the cores.
void set_cpu_threads(int threads);

class Session {
 public:
  // Worker `local_rank` of the site named `site` (ConfigError if there is no such site or rank).
  Session(const Config& config, const std::string& site, int local_rank);
  Session(const Config& config, const Placement& placement);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const Config& config() const;
  const std::string& site() const;
  size_t site_index() const;
  int local_rank() const;
  int site_workers() const;
  // Over the whole job: this worker's position (sites in config order) and the number of workers.
  int global_rank() const;
  int world_size() const;

  // In place on a contiguous float32 tensor: the mean over every worker of every site (each worker
  // counting `weight`, e.g. its number of examples). One exchange inside each site, one across
  // the WAN between gateways.
  void allreduce(at::Tensor& t, double weight = 1.0);
  // In place on a contiguous CPU tensor: the sum over every worker. float32 goes the
  // allreduce's way (sites' sums added in site order: every worker ends with the same floats);
  // any other dtype is all-gathered and added in global rank order (exact for integers).
  void allreduce_sum(at::Tensor& t);
  // Makes every worker's `t` equal to global rank 0's (float32).
  void broadcast(at::Tensor& t);
  // allreduce (or with `sum` the plain sum) with [strategy] codec on the WAN leg: each gateway
  // encodes its site's sum once and every worker ends with the same floats (the Python
  // backend's all-reduce in a job of strategy.kind = "sync"). Only codecs without per-tensor
  // state: a call cannot say which logical tensor it carries. wan_codec() says which codec
  // that is ("none", "fp16", "bf16", or "int8"/"int4" with strategy.codec_error_feedback =
  // false), or throws ConfigError naming strategy.codec.
  void allreduce_encoded(at::Tensor& t, double weight, bool sum);
  std::string wan_codec();

  // Exact collectives of any dtype on contiguous CPU tensors, built on
  // collective::Hierarchy::all_gather_bytes (one gather inside each site, one exchange between
  // the gateways, one broadcast inside each site; never a lossy codec).
  // `t` becomes global rank `root`'s; only the root's site sends its bytes over the WAN.
  // Every worker's `t` must have the root's dtype and number of elements (nebula::Error
  // naming both otherwise).
  void broadcast(at::Tensor& t, int root);
  // Every worker's `t`, in global rank order (each the dtype and shape it had there).
  std::vector<at::Tensor> allgather(const at::Tensor& t);
  // Waits until every worker of every site is here.
  void barrier();
  // Waits until every worker of this site is here.
  void site_barrier();

  // What crossed the WAN from this worker (the gateway; 0 on the others), in bytes.
  uint64_t wan_bytes_sent() const;
  uint64_t wan_bytes_received() const;

  struct Impl;

 private:
  friend class Synchronizer;
  std::unique_ptr<Impl> impl_;
};

class Synchronizer {
 public:
  // Makes every worker's `params` equal to global rank 0's. The tensors are kept (not
  // copied): pass the ones the optimizer updates (float32; CUDA ones go through pinned host
  // memory, a path not yet run on a GPU). A Synchronizer must not outlive its Session.
  // `buffers` (e.g. module->buffers(): BatchNorm's running statistics) are kept equal too:
  // averaged as the strategy implies (strategy.h, Strategy::set_buffers).
  Synchronizer(Session& session, std::vector<at::Tensor> params, std::vector<at::Tensor> buffers = {});
  ~Synchronizer();
  Synchronizer(const Synchronizer&) = delete;
  Synchronizer& operator=(const Synchronizer&) = delete;

  // Whether to run step `step` (0-based) of config.job.steps (or of `steps`). Use it as the
  // loop condition: heterogeneous diloco runs more inner steps on faster sites.
  bool keep_training(int64_t step) const;
  bool keep_training(int64_t step, int64_t steps) const;
  void before_backward(double weight = 1.0);
  void sync_gradients(double weight = 1.0);
  // With [strategy] max_loss_penalty > 0 the controller watches quality from the training loss
  // (controller.h, "Watching quality"): hand it each step's loss (this worker's, before
  // after_step), as `nebula worker` does. watches_quality() says whether it is wanted.
  void observe_loss(double loss);
  bool watches_quality() const;
  void after_step(int64_t step);
  // After the last step: completes what is still on the WAN (every worker calls it).
  void finish();

  std::string name() const;
  // Counters: outer steps, hash checks, rejected updates, privacy spent (see the README).
  std::map<std::string, double> metrics() const;
  // The decisions made so far (adaptive controller, per-site inner steps), one line each.
  std::vector<std::string> decisions() const;

  // Checkpoints of the strategy's own state (diloco: the global weights and outer momentum of
  // this worker's part, codec error feedback, counters); the parameters themselves are the
  // caller's to save. Between steps only, when can_save() (nothing on the WAN; drain() makes
  // it so early). load_state after construction, on every worker, each its own state.
  struct State {
    std::map<std::string, at::Tensor> tensors;
    std::map<std::string, double> numbers;
    std::map<std::string, std::string> strings;
    std::vector<std::string> decisions;
  };
  bool can_save() const;
  void drain();
  State state() const;
  void load_state(const State& state);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nebula
