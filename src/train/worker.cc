// One worker process: set-up, resume, the training loop, the end. run_worker (at the bottom)
// reads top to bottom; the loop's body is Trainer::train.
#include "train/worker.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>
#include <torch/cuda.h>

#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <thread>
#include <tuple>

#include "collective/hierarchical.h"
#include "nebula/error.h"
#include "nebula/log.h"
#include "nebula/session.h"
#include "parallel/full_shard.h"
#include "parallel/inner_optimizer.h"
#include "site/site_comm.h"
#include "strategy/strategy.h"
#include "train/metrics.h"
#include "train/site_data.h"
#include "train/task.h"
#include "train/worker_checkpoint.h"
#include "util/allocator.h"

namespace nebula::train {
namespace {

// The site's device for this worker: "cuda" is GPU local_rank mod the GPUs this process sees
// (one per worker, as torchrun's LOCAL_RANK would choose).
at::Device worker_device(const Config& c, const SiteConfig& site, int local_rank) {
  if (site.device == "cpu") return at::kCPU;
  if (!torch::cuda::is_available())
    throw ConfigError(str_cat(c.source_path, ": site '", site.name, "' has device = \"", site.device,
                              "\", but this LibTorch sees no CUDA device (a CPU-only build, or no GPU here): build "
                              "nebula against a CUDA LibTorch (scripts/build.sh -DTorch_DIR=...; bench/gpu_check.sh "
                              "does it) on a machine with a GPU, or set device = \"cpu\""));
  const auto count = static_cast<int64_t>(torch::cuda::device_count());
  const int64_t index = site.device == "cuda" ? local_rank % count : std::stoll(site.device.substr(5));
  if (index >= count)
    throw ConfigError(str_cat(c.source_path, ": site '", site.name, "' has device = \"", site.device, "\", but this ",
                              "process sees ", count, " GPU(s) (CUDA_VISIBLE_DEVICES?)"));
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
}

// What a task is built from: the config, this worker, its device and, for text tasks, the
// job's SentencePiece vocabulary. A worker never trains the vocabulary itself: every site must
// use the same one, and only the tokenizer site may train it on its own data.
TaskContext task_context(const Config& c, const WorkerIdentity& who) {
  const SiteConfig& site = c.sites.at(who.site);
  TaskContext ctx{c, who, std::nullopt, "", {}, worker_device(c, site, who.local_rank)};
  if (ctx.device.is_cuda()) spdlog::info("training on {}", ctx.device.str());
  if (c.model.kind == "torchscript") return ctx;  // it reads tensors
  ctx.tokenizer_path = c.data.tokenizer.empty() ? default_tokenizer_path(c) : c.data.tokenizer;
  if (!std::filesystem::exists(ctx.tokenizer_path)) {
    const SiteConfig* from = tokenizer_site(c);
    throw ConfigError(str_cat(
        ctx.tokenizer_path, ": no vocabulary (",
        c.data.tokenizer.empty() ? "RUN_DIR/tokenizer.model, as data.tokenizer is not set" : "data.tokenizer", " in ",
        c.source_path, "): train it once with `nebula tokenizer CONFIG --out FILE` ",
        from ? str_cat("on site '", from->name, "' (data.tokenizer_site), ") : std::string("(data.tokenizer_corpus), "),
        "copy FILE to every site and set data.tokenizer = FILE; `nebula run` does this by itself"));
  }
  const data::Tokenizer& tok = ctx.tokenizer.emplace(data::Tokenizer::load(ctx.tokenizer_path));
  ctx.ids = {tok.pad_id(), tok.unk_id(), tok.bos_id(), tok.eos_id(), tok.mask_id(), 5, tok.vocab_size()};
  if (c.model.kind != "classifier")  // the text tasks' data, before the worker joins anyone (TaskContext::text)
    ctx.text = std::make_shared<SiteText>(
        load_site_text(c, who.site, data_replica(c, who).local_rank, site_grid(c, site).data));
  return ctx;
}

std::unique_ptr<Task> make_task(const TaskContext& ctx, transport::Link* teacher) {
  const std::string& kind = ctx.config.model.kind;
  return kind == "seq2seq"       ? make_translation_task(ctx, teacher)
         : kind == "torchscript" ? make_script_task(ctx)
         : kind == "classifier"  ? make_classifier_task(ctx)
                                 : make_mlm_task(ctx);
}

// SIGINT/SIGTERM: the training loop checkpoints and stops at the end of the step.
std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

// A stop that every worker of the site agrees on, at the end of a step: SIGINT/SIGTERM, or in
// tests NEBULA_TEST_STOP_AT_STEP=N (as if SIGTERM had come after step N on every site: a
// deterministic moment for resume tests; a signal before N is held until N).
class StopRequest {
 public:
  explicit StopRequest(collective::SiteGroup& group) : group_(group) {
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    // The stop is polled at the end of a step: a blocking call the signal lands in (a checkpoint's
    // write, a socket read; the launcher SIGTERMs the others as soon as one worker stops) is
    // restarted, not failed with EINTR.
    sa.sa_flags = SA_RESTART;
    ::sigaction(SIGINT, &sa, nullptr);
    ::sigaction(SIGTERM, &sa, nullptr);
    const char* v = std::getenv("NEBULA_TEST_STOP_AT_STEP");
    stop_at_ = v ? std::atoll(v) : -1;
  }
  // After step `steps_done`: the signal the site stops on, 0 for none; the same on every
  // worker of the site (a one-value all-reduce; the largest signal number wins). Once a stop
  // is seen it stays.
  int poll(int64_t steps_done) {
    float stop = g_stop_signal.load() != 0 ? static_cast<float>(g_stop_signal.load()) : 0.0f;
    // NEBULA_TEST_STOP_AT_STEP: every worker of every site stops after step N, whichever site
    // gets there first (its exit makes the launcher signal the others, which would otherwise
    // stop wherever they are): a signal before N waits for N.
    if (stop_at_ >= 0 && steps_done < stop_at_) stop = 0;
    if (steps_done == stop_at_) stop = SIGTERM;
    if (group_.size() > 1) {
      at::Tensor flag = at::full({1}, stop, at::kFloat);
      group_.allreduce_sum(flag);
      if (flag.item<float>() > 0 && stop == 0) stop = SIGTERM;  // another worker of the site was told
    }
    if (stop > 0 && !signal_) {
      signal_ = static_cast<int>(stop);
      spdlog::warn("stopping (signal {}): checkpoint at the first step with nothing on the WAN", signal_);
    }
    return signal_;
  }

 private:
  collective::SiteGroup& group_;
  int64_t stop_at_ = -1;
  int signal_ = 0;
};

// When a checkpoint is written: every checkpoint.every steps and on a stop, at the first step
// after that at which the strategy has nothing on the WAN (can_save); a streaming strategy
// that is never idle between steps is drained once `delay` steps have passed.
class CheckpointSchedule {
 public:
  CheckpointSchedule(const Config& c, strategy::Strategy& strategy) : c_(c), strategy_(strategy) {}
  // After step `steps_done`: whether to checkpoint now.
  bool due(int64_t steps_done, bool stopping) {
    const bool every = c_.checkpoint.every > 0 && steps_done % c_.checkpoint.every == 0;
    if ((every || stopping) && !pending_) {
      pending_ = true;
      since_ = steps_done;
    }
    if (!pending_) return false;
    if (!strategy_.can_save() && steps_done - since_ >= c_.strategy.delay) strategy_.drain();
    if (!strategy_.can_save()) return false;
    pending_ = false;
    return true;
  }

 private:
  const Config& c_;
  strategy::Strategy& strategy_;
  bool pending_ = false;  // since step since_
  int64_t since_ = 0;
};

// The loss and throughput of the steps since the last metrics line.
struct MetricsWindow {
  double loss = 0, predicted = 0;  // Σ loss · weight, Σ weight
  int64_t tokens = 0;
  Clock::time_point start = Clock::now();
  void add(const Task::Step& step, double step_loss) {
    tokens += step.tokens;
    loss += step_loss * step.weight;
    predicted += step.weight;
  }
};

// Everything one worker trains with, built in this order by the constructor: the site's
// communication, the task (model and data), the strategy, ZeRO (FullShard, the inner
// optimizer), metrics and checkpoints.
class Trainer {
 public:
  Trainer(const TaskContext& ctx, bool rejoin, Clock::time_point start);
  // --resume / --rejoin: the newest checkpoint the site (or the job) agrees on, then the
  // strategy brings the sites to one global state (reconcile) or takes the running job's (join).
  void resume(bool rejoin);
  void evaluate_at_start();
  // The loop. Returns 0 after the last step, or 128 + the signal after a stop (checkpointed).
  int train();
  // Completes the strategy's exchanges; validation, evaluation, the job's totals; the first
  // live site's gateway writes summary.json and the model file.
  void finish();

 private:
  int stop(int signal);
  // [parallel] pipeline > 1: this worker's stage, its runner and its replicas' group.
  void connect_stage(Millis timeout, at::Device device);
  // [parallel] tensor > 1: this worker's tensor group, its slices and their replicas' group.
  void connect_tensor(Millis timeout);
  // The group of the workers that hold the same part of the model as this one (`ranks`), and
  // with one training site its own one-site hierarchy (the strategy runs over it).
  void connect_replicas(const std::string& name, const std::vector<int>& ranks, Millis timeout);
  // Whether the sites hold the model in different layouts the strategy must know (a site of
  // pipeline stages in a job of several training sites: diloco and streaming exchange by
  // position), and every training site's layout, in mesh order.
  bool by_layouts() const;
  std::vector<strategy::SiteLayout> site_layouts();
  strategy::SiteLayout site_layout(const SiteConfig& site);
  std::vector<int> tensor_dims_;  // the tensor split's, once a site has slices
  // One metrics line per `log_every` steps (and one for the last, partial window).
  void write_metrics(int64_t steps_done);
  // Evaluation on the gateway: a metrics line {"site", "step", "eval"} with this site's values
  // (zeros on the other workers). Every worker of the site calls it: with ZeRO-3 they send the
  // gateway each layer as it runs (FullShard::with_rest_to_root), no whole model anywhere.
  std::vector<double> evaluate(int64_t steps_done);
  // Validation runs on every worker: ZeRO-3 gathers layer by layer, as in training, when every
  // worker of the site has validation data (the same forwards everywhere), else the whole model.
  std::pair<double, double> validate();
  // fn() with the whole model here (ZeRO-3 gathers it; `gateway`: only the gateway needs it).
  // Pipeline stages: the other stages lend the gateway their layers (fn runs on every worker).
  // Tensor slices: gathered whole on every worker.
  void whole(const std::function<void()>& fn, bool gateway = false) {
    if (pipeline_) return task_->with_whole(*comm_.group, 1, fn, /*everywhere=*/true);
    if (tensor_) return tensor_->with_whole(fn);
    parallel::with_whole_model(full_.get(), fn, gateway);
  }
  // Bytes this worker sent to its site's other workers so far (all of its groups).
  uint64_t site_bytes_sent() const {
    return comm_.group->bytes_sent() + (comm_.comm_group ? comm_.comm_group->bytes_sent() : 0) +
           (full_ ? full_->prefetch_bytes_sent() : 0) + (tensor_group_ ? tensor_group_->bytes_sent() : 0) +
           (data_group_ ? data_group_->bytes_sent() : 0);
  }
  // `wan`: the WAN counters before the totals' own exchange.
  nlohmann::json summary(int64_t steps, const std::vector<double>& totals, size_t by_worker_at,
                         const collective::CommStats& wan) const;

  const Config& c_;
  const WorkerIdentity who_;
  const SiteConfig& site_;
  const int workers_;
  const Clock::time_point start_;
  PhasePeaks phases_{PhasePeaks::kInit};  // peak memory per phase, from here (the set-up) on
  site::SiteComm comm_;
  std::unique_ptr<Task> task_;
  // [parallel] pipeline > 1: this worker's stage and its runner.
  std::unique_ptr<parallel::Pipeline> pipeline_;
  Task::Stage* stage_ = nullptr;
  // [parallel] tensor > 1: the workers of this worker's replica (its tensor group) and its slices.
  std::unique_ptr<collective::SiteGroup> tensor_group_;
  std::unique_ptr<parallel::SiteTensorGroup> tensor_comm_;
  parallel::TensorSplit* tensor_ = nullptr;  // the task's
  // With stages or slices, the strategy and the optimizer work over the replicas of this
  // worker's part (data_group_: a stage's, a slice's; with one training site a one-site
  // hierarchy over it, data_comm_).
  std::unique_ptr<collective::SiteGroup> data_group_;
  std::unique_ptr<collective::GatewayMesh> data_mesh_;
  std::unique_ptr<collective::Hierarchy> data_comm_;
  double pipeline_compute_s_ = 0, pipeline_wall_s_ = 0;  // Pipeline::Timing summed over the steps
  std::vector<at::Tensor> params_;                 // the trainable parameters (ZeRO-3: views of this worker's shard)
  int64_t trainable_values_ = 0, model_values_ = 0;  // before any sharding
  std::unique_ptr<strategy::Strategy> strategy_;
  std::unique_ptr<parallel::FullShard> full_;      // ZeRO-3 only
  std::unique_ptr<parallel::InnerOptimizer> optimizer_;
  std::unique_ptr<WorkerCheckpoints> checkpoints_;
  MetricsWriter metrics_;
  MetricsWindow window_;
  double last_loss_ = 0, last_predicted_ = 0;      // the last full window's
  int64_t step_ = 0, tokens_ = 0;
  std::vector<double> eval_start_;
  bool resumed_ = false;
  int64_t last_eval_step_ = -1;
  std::vector<double> last_eval_;
};

Trainer::Trainer(const TaskContext& ctx, bool rejoin, Clock::time_point start)
    : c_(ctx.config),
      who_(ctx.who),
      site_(c_.sites.at(who_.site)),
      workers_(static_cast<int>(site_.workers)),
      start_(start),
      // The site's c10d group, and on the gateway the WAN mesh to the other training sites
      // (with [distill] the one other site is the teacher: its link goes to the task).
      comm_(site::connect_site(c_, who_, rejoin)),
      metrics_(c_.job.run_dir + "/metrics.jsonl") {
  // ZeRO-3: each layer is cut as soon as it is built (parallel::PieceKeeper), so the model is
  // never whole here; not for PEFT or a model loaded from a file (built whole, then cut).
  const bool zero3 = c_.parallel.shard == "full" && workers_ > 1;
  std::unique_ptr<parallel::PieceKeeper> keeper;
  if (zero3 && c_.peft.kind == "none" && c_.model.init.empty())
    keeper = std::make_unique<parallel::PieceKeeper>(workers_, comm_.group->rank(), ctx.device);
  {
    model::SinkScope building(keeper.get());
    task_ = make_task(ctx, comm_.teacher.get());
  }
  const auto timeout = std::chrono::duration_cast<Millis>(c_.job.timeout);
  if (site_grid(c_, site_).pipeline > 1) connect_stage(timeout, ctx.device);
  if (site_grid(c_, site_).tensor > 1) connect_tensor(timeout);
  params_ = task_->trainable();
  std::tie(model_values_, trainable_values_) = task_->model_numel();
  // A one-site job's stages (tensor slices) each run the strategy over their replicas (data_comm_); sites of
  // different layouts run it over the site, each stage's replicas as its data parallel group.
  strategy_ = strategy::make_strategy(c_.strategy, data_comm_ ? *data_comm_ : *comm_.comm, timeout,
                                      comm_.training_names.size(), comm_.training_index, c_.privacy);
  strategy_->set_buffers(task_->module().buffers());  // BatchNorm statistics ...: kept equal too
  if (by_layouts())
    strategy_->set_layouts({site_layouts(), task_->trainable_shapes(), data_group_.get(), tensor_group_.get()});
  // InnerOptimizer::sharded(): over the site's workers, or a pipeline stage's (a slice's) replicas.
  if (c_.parallel.shard != "none" && (data_group_ ? data_group_->size() : workers_) > 1) strategy_->expect_sharding();
  // ZeRO-3's units, on every site (one of one worker too: the others cut their exchanges by them).
  if (c_.parallel.shard == "full") strategy_->set_unit_bounds(parallel::FullShard::unit_bounds(params_, task_->layers()));
  // ZeRO-3: from here on this worker holds its shard of the parameters only; the model gathers
  // each layer where it runs, and whole() gathers all of them for evaluation and checkpoints.
  // The strategy's state is made from the shard (every site of the job alike, one of one worker
  // from its whole flat vector), never from a whole model.
  if (zero3) {
    const std::vector<torch::nn::Module*> layers = task_->layers();
    if (layers.empty())
      throw ConfigError(str_cat(c_.source_path, ": parallel.shard = \"full\" needs a built-in model that runs layer by "
                                "layer (model.kind = \"", c_.model.kind, "\" does not): use shard = \"gradients\""));
    full_ = std::make_unique<parallel::FullShard>(
        params_, layers, *comm_.group, parallel::FullShardOptions{c_.parallel.recompute, c_.parallel.prefetch},
        c_.parallel.prefetch ? comm_.group->fork("prefetch") : nullptr, keeper.get());
    keeper.reset();  // its pieces are in the shard now
    task_->set_layer_gather(full_.get());
    strategy_->init_from_shard(params_, full_->shapes(), full_->shard().detach());
  } else if (c_.parallel.shard == "full") {
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& p : params_) shapes.push_back(p.sizes().vec());
    strategy_->init_from_shard(params_, shapes, strategy::flatten(params_));
  } else {
    strategy_->init(params_);
  }
  optimizer_ = std::make_unique<parallel::InnerOptimizer>(params_, c_.model.lr, c_.model.weight_decay,
                                                          c_.parallel.shard, data_group_ ? *data_group_ : *comm_.group,
                                                          full_.get(),
                                                          c_.parallel.bucket_bytes);
  parallel::InnerOptimizer& o = *optimizer_;
  if (pipeline_ || tensor_) {  // clipping: the whole model's norm, a whole parameter of the slices counted once
    std::vector<double> weights;
    if (tensor_)
      for (const at::Tensor& p : params_) weights.push_back(tensor_->sliced(p) ? 1.0 : 1.0 / tensor_comm_->size());
    o.set_norm_group(comm_.group.get(), site_grid(c_, site_).data, std::move(weights));
  }
  if (o.sharded())  // the strategy keeps its shard of the outer state (and ZeRO-2/3's gradients)
    strategy_->set_sharding({o.flat_params(), o.gradients_sharded() ? o.flat_grad() : at::Tensor(), o.params_gathered()});
  if (o.sharded() && (data_group_ ? data_group_->rank() : who_.local_rank) == 0)
    spdlog::info("inner optimizer: ZeRO-{} over {} {}, AdamW moments for {} of {} parameters per worker{}",
                 full_ ? 3 : o.gradients_sharded() ? 2 : 1, data_group_ ? data_group_->size() : workers_,
                 pipeline_  ? str_cat("replicas of pipeline stage ", pipeline_->stage())
                 : tensor_ ? str_cat("replicas of tensor slice ", tensor_comm_->rank())
                           : std::string("workers of the site"),
                 o.state_numel(), o.total_numel(), full_ ? "; the parameters sharded too, gathered layer by layer" : "");
  // A one-site job's stages or slices keep their outer state per stage (data_comm_): a resume
  // onto another layout cannot cut it anew.
  checkpoints_ = std::make_unique<WorkerCheckpoints>(c_, who_, *comm_.comm, *task_, o, *strategy_, full_.get(),
                                                     site_layout(site_), data_comm_ && c_.strategy.kind != "sync");
  eval_start_.assign(task_->eval_size(), 0.0);
  // The set-up's freed memory (each layer built whole before ZeRO-3 cut it, the tokenizer's
  // and the data's buffers) back to the system: the allocator keeps it (util/allocator.h) and
  // the steps would not reuse all of it.
  release_free_memory();
  phases_.end();
}

void Trainer::connect_stage(Millis timeout, at::Device device) {
  const parallel::SiteGrid grid = site_grid(c_, site_);
  pipeline_ = std::make_unique<parallel::Pipeline>(*comm_.group, grid, static_cast<int>(c_.parallel.micro_batches),
                                                   c_.parallel.recompute, device);
  stage_ = task_->make_stage(*pipeline_);
  NEBULA_CHECK(stage_, "model.kind = \"", c_.model.kind, "\" cannot be cut into pipeline stages");
  const int stage = pipeline_->stage();
  connect_replicas(str_cat("stage", stage), grid.data_ranks(stage), timeout);
}

void Trainer::connect_tensor(Millis timeout) {
  const parallel::SiteGrid grid = site_grid(c_, site_);
  const int rank = comm_.group->rank(), replica = grid.replica(rank), slice = grid.tensor_rank(rank);
  tensor_group_ = comm_.group->subgroup(str_cat("tensor", replica), grid.tensor_ranks(0, replica));
  tensor_comm_ = std::make_unique<parallel::SiteTensorGroup>(*tensor_group_);
  tensor_ = task_->split_for_tensor(*tensor_comm_);
  NEBULA_CHECK(tensor_, "model.kind = \"", c_.model.kind, "\" cannot be split into tensor slices");
  connect_replicas(str_cat("slice", slice), grid.data_ranks(0, slice), timeout);
}

void Trainer::connect_replicas(const std::string& name, const std::vector<int>& ranks, Millis timeout) {
  data_group_ = comm_.group->subgroup(name, ranks);
  if (by_layouts()) return;  // the strategy runs over the site (set_layouts)
  if (data_group_->rank() == 0) {  // the replicas' own one-site mesh: nothing crosses the WAN here
    collective::MeshOptions mesh;
    mesh.site_names = {site_.name};
    mesh.timeout = timeout;
    std::vector<std::unique_ptr<transport::Link>> none(1);
    data_mesh_ = std::make_unique<collective::GatewayMesh>(std::move(mesh), std::move(none));
  }
  data_comm_ = std::make_unique<collective::Hierarchy>(*data_group_, data_mesh_.get());
}

bool Trainer::by_layouts() const {
  if (c_.strategy.kind == "sync" || comm_.training_names.size() < 2) return false;
  for (const std::string& name : comm_.training_names) {
    const parallel::SiteGrid grid = site_grid(c_, c_.sites.at(c_.site_index(name)));
    if (grid.pipeline > 1 || grid.tensor > 1) return true;
  }
  return false;
}

std::vector<strategy::SiteLayout> Trainer::site_layouts() {
  std::vector<strategy::SiteLayout> layouts;
  for (const std::string& name : comm_.training_names) layouts.push_back(site_layout(c_.sites.at(c_.site_index(name))));
  return layouts;
}

strategy::SiteLayout Trainer::site_layout(const SiteConfig& site) {
  const int64_t total = trainable_values_;  // the whole model's, every stage's
  const parallel::SiteGrid grid = site_grid(c_, site);
  if (grid.tensor > 1) {
    if (tensor_dims_.empty()) tensor_dims_ = task_->tensor_dims();
    NEBULA_CHECK(!tensor_dims_.empty(), "site '", site.name, "': model.kind = \"", c_.model.kind,
                 "\" cannot be cut into tensor slices here");
    return parallel::SliceLayout(task_->trainable_shapes(), tensor_dims_, grid.tensor, grid.data);
  }
  if (grid.pipeline == 1) return parallel::ShardLayout::contiguous(total, site.workers);
  std::vector<int64_t> bounds = task_->stage_bounds(grid.pipeline);
  NEBULA_CHECK(!bounds.empty() && bounds.back() == total, "site '", site.name, "': model.kind = \"", c_.model.kind,
               "\" cannot be cut into ", grid.pipeline, " pipeline stages here");
  return parallel::StageLayout(std::move(bounds), grid.data);
}

void Trainer::resume(bool rejoin) {
  phases_.begin(PhasePeaks::kResume);
  if (std::optional<WorkerProgress> p = checkpoints_->restore_newest()) {
    step_ = p->step;
    tokens_ = p->tokens;
    if (!p->eval_start.empty()) eval_start_ = p->eval_start;
    resumed_ = true;
  }
  if (rejoin)
    strategy_->join();  // the others admit this site at their next round and hand it their state
  else
    strategy_->reconcile();
  release_free_memory();  // the checkpoints read (and with ZeRO-3 the model gathered to write them back)
  phases_.end();
}

void Trainer::evaluate_at_start() {
  if (!resumed_ && task_->eval_at_start()) eval_start_ = evaluate(0);
  release_free_memory();  // the evaluation's activations
}

int Trainer::train() {
  strategy::Strategy& strategy = *strategy_;
  parallel::InnerOptimizer& optimizer = *optimizer_;
  parallel::FullShard* full = full_.get();  // ZeRO-3's layer gathering, or null
  StopRequest stop_request(*comm_.group);
  CheckpointSchedule checkpoint(c_, strategy);

  for (; strategy.keep_training(step_, c_.job.steps); ++step_) {
    const auto step_start = Clock::now();
    phases_.begin(PhasePeaks::kStep);
    if (full) full->begin_step();
    optimizer.zero_grad();
    Task::Step batch;
    if (stage_) {  // pipeline stages: every micro-batch's forward and backward, in 1F1B order
      batch = stage_->prepare(step_);
      batch.loss = at::scalar_tensor(pipeline_->run(*stage_), at::kDouble);
      optimizer.reduce_accumulated(batch.weight);  // ZeRO-2: reduce-scattered now, after the micro-batches
      if (!pipeline_->first()) batch.tokens = 0;  // the first stage (the gateway's) counts the pipeline's tokens
      pipeline_compute_s_ += pipeline_->last_timing().compute_s;
      pipeline_wall_s_ += pipeline_->last_timing().wall_s;
    } else {
      batch = task_->forward(step_);
      strategy.before_backward(batch.weight);
      optimizer.before_backward(batch.weight);  // ZeRO-2/3: reduce-scattered as backward makes them
      batch.loss.backward();  // gradient buckets start crossing the WAN (sync) or the site (ZeRO-2/3) while this runs
      optimizer.end_backward();
      if (tensor_ && tensor_comm_->rank() != 0) batch.tokens = 0;  // the first slice counts the replica's tokens
    }
    strategy.sync_gradients(params_, batch.weight);
    if (c_.model.clip_norm > 0) optimizer.clip_grad_norm(c_.model.clip_norm);
    optimizer.set_lr(parallel::scheduled_lr(c_.model, step_, c_.job.steps));
    optimizer.step();
    const double loss = batch.loss.item<double>();  // read once: the strategy and the metrics window
    strategy.observe_loss(loss);
    phases_.begin(PhasePeaks::kOuterSync);  // the strategy's outer step, when one is due
    strategy.after_step(step_);
    phases_.end();
    if (site_.slowdown > 1)  // emulated slower hardware: this step takes `slowdown` times as long
      std::this_thread::sleep_for((Clock::now() - step_start) * (site_.slowdown - 1));

    const int64_t done = step_ + 1;
    tokens_ += batch.tokens;
    window_.add(batch, loss);
    if (done % c_.job.log_every == 0) write_metrics(done);
    if (c_.eval.every > 0 && done % c_.eval.every == 0) {  // on the merged model, not the replica mid-round
      strategy.with_global_weights([&] { evaluate(done); });
      release_free_memory();
    }
    const int signal = stop_request.poll(done);
    if (checkpoint.due(done, signal != 0)) {
      phases_.begin(PhasePeaks::kCheckpoint);
      checkpoints_->save({done, tokens_, eval_start_});
      phases_.end();
      if (signal) return stop(signal);
    }
  }
  return 0;
}

int Trainer::stop(int signal) {
  const int64_t done = step_ + 1;
  if (window_.predicted > 0) write_metrics(done);
  comm_.group->barrier();
  spdlog::warn("stopped after step {}: continue with --resume", done);
  return 128 + signal;
}

namespace {
// A WAN link's estimates as the metrics lines and the summary report them.
nlohmann::json link_json(const transport::LinkEstimates& e) {
  return {{"rtt_ms", e.rtt_s * 1e3},
          {"bandwidth_bits_per_s", e.bandwidth_bits_per_s},
          {"bandwidth_at_least", e.bandwidth_at_least}};
}
}  // namespace

void Trainer::write_metrics(int64_t steps_done) {
  const double seconds = std::chrono::duration<double>(Clock::now() - window_.start).count();
  const auto stats = comm_.comm->stats();
  nlohmann::json links = nlohmann::json::object();
  for (size_t j = 0; j < stats.links.size(); ++j) {
    const auto& e = stats.links[j];
    if (j == comm_.training_index || (e.rtt_samples == 0 && e.bandwidth_samples == 0)) continue;
    nlohmann::json& l = links[comm_.training_names[j]] = link_json(e);
    l["rtt_smoothed_ms"] = e.rtt_smoothed_s * 1e3;
  }
  metrics_.write({{"time", unix_time()},
                  {"elapsed", std::chrono::duration<double>(Clock::now() - start_).count()},
                  {"site", site_.name},
                  {"rank", who_.local_rank},
                  {"step", steps_done},
                  {"steps", c_.job.steps},
                  {"loss", window_.loss / window_.predicted},
                  {"tokens", tokens_},
                  {"tokens_per_s", seconds > 0 ? static_cast<double>(window_.tokens) / seconds : 0.0},
                  {"wan_bytes_sent", stats.wan_bytes_sent},
                  {"wan_bytes_received", stats.wan_bytes_received},
                  {"wan_wire_bytes_sent", stats.wan_wire_bytes_sent},
                  {"wan_wire_bytes_received", stats.wan_wire_bytes_received},
                  {"wan_links", links},
                  {"codec_bytes_in", stats.codec_bytes_in},
                  {"codec_bytes_out", stats.codec_bytes_out},
                  {"compression_ratio",
                   stats.codec_bytes_out ? double(stats.codec_bytes_in) / double(stats.codec_bytes_out) : 1.0},
                  {"encode_seconds", stats.encode_seconds},
                  {"decode_seconds", stats.decode_seconds},
                  {"adamw_state_values", 2 * optimizer_->state_numel()},  // this worker's moments ([parallel] shard)
                  {"peak_rss_bytes", phases_.overall()},
                  {"site_bytes_sent", site_bytes_sent()},
                  {"strategy", strategy_->metrics()}});
  last_loss_ = window_.loss;
  last_predicted_ = window_.predicted;
  window_ = MetricsWindow{};
}

std::vector<double> Trainer::evaluate(int64_t steps_done) {
  if (steps_done == last_eval_step_) return last_eval_;  // the end of the run fell on an eval.every step
  phases_.begin(PhasePeaks::kEval);
  std::vector<double> counts(task_->eval_size(), 0.0);
  const bool gateway = who_.local_rank == 0;
  auto run = [&] { counts = task_->evaluate(); };
  if (full_)
    full_->with_rest_to_root(run);  // run() on the gateway only
  else if (pipeline_)
    task_->with_whole(*comm_.group, 1, run);  // the other stages' layers lent to the gateway
  else if (tensor_ && site_grid(c_, site_).replica(who_.local_rank) == 0)
    tensor_->with_whole([&] { if (gateway) run(); });  // the first replica's slices gathered, the gateway evaluates
  else if (gateway)
    run();
  last_eval_step_ = steps_done;
  last_eval_ = counts;
  phases_.end();
  if (gateway)
    metrics_.write({{"time", unix_time()}, {"site", site_.name}, {"rank", 0}, {"step", steps_done},
                    {"eval", task_->eval_json(counts)}});
  return counts;
}

std::pair<double, double> Trainer::validate() {
  std::pair<double, double> out;
  auto run = [&] { out = task_->validate(c_.job.eval_batches); };
  if (pipeline_) {  // each replica's share, on the whole model lent to its first stage
    task_->with_whole(*comm_.group, site_grid(c_, site_).data, run);
    return out;
  }
  if (tensor_) {  // every slice runs the forward; the first counts the replica's loss
    run();
    if (tensor_comm_->rank() != 0) out = {0.0, 0.0};
    return out;
  }
  if (!full_) {
    run();
    return out;
  }
  at::Tensor all = at::full({1}, task_->has_validation() ? 1.0f : 0.0f);
  comm_.group->allreduce_sum(all);
  if (all.item<float>() == static_cast<float>(workers_))
    full_->with_rest(run);
  else
    full_->with_full_model(run);
  return out;
}

// The job-wide totals summary.json is made of, in the order sum_counters carries them.
enum Total : size_t {
  kTokens, kWanSent, kWanReceived, kLastLoss, kLastPredicted, kValLoss, kValPredicted, kWireSent, kWireReceived,
  kFixedTotals
};

void Trainer::finish() {
  strategy_->finish();  // exchanges still in flight
  task_->finish();
  if (window_.predicted > 0) write_metrics(step_);

  // Validation loss, evaluation, and job-wide totals for the summary, in one collective
  // (ZeRO-3: the gateway gathers the whole model for the model file).
  const std::pair<double, double> validation = validate();
  const std::vector<double> eval_end = evaluate(step_);
  whole([&] {
    const auto wan = comm_.comm->stats();  // before the totals exchange itself
    std::vector<double> counters = {static_cast<double>(tokens_), static_cast<double>(wan.wan_bytes_sent),
                                    static_cast<double>(wan.wan_bytes_received), last_loss_,
                                    last_predicted_, validation.first, validation.second,
                                    static_cast<double>(wan.wan_wire_bytes_sent),
                                    static_cast<double>(wan.wan_wire_bytes_received)};
    counters.insert(counters.end(), eval_start_.begin(), eval_start_.end());
    counters.insert(counters.end(), eval_end.begin(), eval_end.end());
    // Each worker's own WAN bytes at its place in the job (sites in order, ranks in order).
    const size_t by_worker_at = counters.size();
    counters.resize(by_worker_at + static_cast<size_t>(c_.total_workers()), 0.0);
    const size_t me = site::job_index(c_, who_), workers = static_cast<size_t>(c_.total_workers());
    counters[by_worker_at + me] = static_cast<double>(wan.wan_bytes_sent);
    // And its site bytes and peak memory in each phase (PhasePeaks), a slot per worker each.
    counters.resize(by_worker_at + (2 + PhasePeaks::kPhases) * workers, 0.0);
    counters[by_worker_at + workers + me] = static_cast<double>(site_bytes_sent());
    for (int p = 0; p < PhasePeaks::kPhases; ++p)
      counters[by_worker_at + (2 + static_cast<size_t>(p)) * workers + me] =
          static_cast<double>(phases_.peak(static_cast<PhasePeaks::Phase>(p)));
    // And its pipeline stage's seconds computing and in all (Pipeline::Timing).
    counters.resize(by_worker_at + (5 + PhasePeaks::kPhases) * workers, 0.0);
    counters[by_worker_at + (2 + PhasePeaks::kPhases) * workers + me] = pipeline_compute_s_;
    counters[by_worker_at + (3 + PhasePeaks::kPhases) * workers + me] = pipeline_wall_s_;
    counters[by_worker_at + (4 + PhasePeaks::kPhases) * workers + me] = static_cast<double>(phases_.start());
    const std::vector<double> totals = collective::sum_counters(*comm_.comm, counters);
    // The first site still in the job (elastic: site 0 may be lost) writes the summary and model.
    const collective::GatewayMesh* mesh = comm_.mesh.get();
    if (mesh && mesh->site_index() == mesh->first_live()) {
      write_json_atomically(c_.job.run_dir + "/summary.json", summary(step_, totals, by_worker_at, wan));
      auto meta = task_->model_metadata();
      meta["steps"] = std::to_string(step_);
      task_->save_model(c_.job.run_dir, meta);
    }
  }, true);
  comm_.group->barrier();  // nobody closes its links while another still needs them
  spdlog::info("done: {} steps, {} tokens", step_, tokens_);
}

nlohmann::json Trainer::summary(int64_t steps, const std::vector<double>& totals, size_t by_worker_at,
                                const collective::CommStats& wan) const {
  auto total = [&](Total i) { return totals[i]; };
  auto eval_part = [&](size_t k) {
    const auto begin = totals.begin() + static_cast<std::ptrdiff_t>(kFixedTotals + k * task_->eval_size());
    return std::vector<double>(begin, begin + static_cast<std::ptrdiff_t>(task_->eval_size()));
  };
  // Slot block k of the per-worker counters (finish()): one value per worker, in job order.
  auto by_worker = [&](size_t k) {
    const auto n = static_cast<size_t>(c_.total_workers());
    const auto begin = totals.begin() + static_cast<std::ptrdiff_t>(by_worker_at + k * n);
    return std::vector<double>(begin, begin + static_cast<std::ptrdiff_t>(n));
  };
  const auto& names = comm_.training_names;
  nlohmann::json links = nlohmann::json::object();
  for (size_t j = 0; j < wan.links.size(); ++j)
    if (j != comm_.training_index)
      links[names[j]] = link_json(wan.links[j]);
  nlohmann::json summary = {
      {"job", c_.job.name},
      {"strategy", strategy_->name()},
      {"decisions", strategy_->decisions()},
      {"codec", c_.strategy.codec},
      {"compression_ratio", wan.codec_bytes_out ? double(wan.codec_bytes_in) / double(wan.codec_bytes_out) : 1.0},
      {"sites", c_.sites.size()},
      {"workers", c_.total_workers()},
      {"steps", c_.job.steps},
      {"local_steps_site0", steps},
      {"tokens", total(kTokens)},
      {"wall_seconds", std::chrono::duration<double>(Clock::now() - start_).count()},
      {"final_train_loss", total(kLastPredicted) > 0 ? total(kLastLoss) / total(kLastPredicted) : 0.0},
      {"final_val_loss", total(kValPredicted) > 0 ? nlohmann::json(total(kValLoss) / total(kValPredicted))
                                                  : nlohmann::json(nullptr)},
      {"model_kind", c_.model.kind},
      {"parameters", model_values_},
      {"trainable_parameters", trainable_values_},  // what the strategy keeps equal: all of them, or [peft]'s
      {"model", c_.job.run_dir + "/model.safetensors"},
      {"wan_bytes", total(kWanSent)},
      {"wan_bytes_sent", total(kWanSent)},
      {"wan_bytes_received", total(kWanReceived)},
      // On the network: TLS records, acks, probes, heartbeats, re-sends, handshakes.
      {"wan_wire_bytes", total(kWireSent)},
      {"wan_wire_bytes_sent", total(kWireSent)},
      {"wan_wire_bytes_received", total(kWireReceived)},
      {"wan_bytes_sent_by_worker", by_worker(0)},
      {"site_bytes_sent_by_worker", by_worker(1)},
      {"security", c_.security.insecure ? "plaintext" : "mutual TLS 1.3"},
      {"wan_streams", c_.wan.streams},
      {"wan_links_seen_from_" + site_.name, links},
      {"wan_emulation", {{"bandwidth_bits_per_s", c_.wan.path.bandwidth_bits},
                         {"rtt_ms", std::chrono::duration<double, std::milli>(c_.wan.path.rtt).count()}}}};
  if (task_->eval_at_start()) summary["eval_start"] = task_->eval_json(eval_part(0));
  summary["eval"] = task_->eval_json(eval_part(1));
  summary["strategy_metrics"] = strategy_->metrics();  // rejected updates; privacy spent
  nlohmann::json peaks = {{"exact", phases_.exact()}};  // exact: each phase's own peak (PhasePeaks)
  for (int p = 0; p < PhasePeaks::kPhases; ++p) peaks[PhasePeaks::name(static_cast<PhasePeaks::Phase>(p))] = by_worker(2 + p);
  peaks["start"] = by_worker(4 + PhasePeaks::kPhases);  // before the set-up: LibTorch loaded, nothing built
  summary["peak_rss_bytes_by_phase"] = peaks;
  summary["allocator"] = allocator_name();  // which malloc the peaks were measured under
  if (pipeline_) {  // the measured bubble: the stages' time not computing, against 1F1B's formula
    const std::vector<double> compute = by_worker(2 + PhasePeaks::kPhases), wall = by_worker(3 + PhasePeaks::kPhases);
    double c = 0, w = 0;
    for (size_t i = 0; i < compute.size(); ++i) c += compute[i], w += wall[i];
    const int P = pipeline_->stages(), M = pipeline_->micro_batches();
    summary["pipeline"] = {{"stages", P},
                           {"micro_batches", M},
                           {"bubble_formula", parallel::bubble_fraction(P, M)},
                           {"bubble_measured", w > 0 ? 1.0 - c / w : 0.0},
                           {"compute_seconds_by_worker", compute},
                           {"wall_seconds_by_worker", wall}};
  }
  if (tensor_) summary["tensor"] = {{"slices", tensor_comm_->size()}, {"data", site_grid(c_, site_).data}};
  nlohmann::json lost = nlohmann::json::array();
  for (const auto& [j, why] : comm_.mesh->lost()) lost.push_back({{"site", names[j]}, {"reason", why}});
  summary["sites_lost"] = lost;
  nlohmann::json rejoined = nlohmann::json::array();
  for (size_t j : comm_.mesh->rejoined()) rejoined.push_back(names[j]);
  summary["sites_rejoined"] = rejoined;
  summary.update(task_->summary());
  return summary;
}

}  // namespace

std::string default_tokenizer_path(const Config& c) { return c.job.run_dir + "/tokenizer.model"; }

int run_worker(const Config& c, const WorkerIdentity& who, bool resume, bool rejoin) {
  const auto start = Clock::now();
  const SiteConfig& site = c.sites.at(who.site);
  NEBULA_CHECK(who.local_rank >= 0 && who.local_rank < site.workers, "site '", site.name, "' has ", site.workers,
               " workers; rank ", who.local_rank, " does not exist");
  init_logging(str_cat(site.name, "/", who.local_rank));
  set_cpu_threads(1);  // several workers share the machine's cores: one thread each
  const TaskContext ctx = task_context(c, who);
  if (rejoin && (!c.job.elastic || c.strategy.kind == "sync" || c.distill.enabled()))
    throw ConfigError(str_cat("--rejoin: site '", site.name, "' can rejoin only an elastic diloco or streaming job "
                              "without [distill] (job.elastic = true); restart the whole job with --resume instead"));
  if (c.distill.enabled() && site.name == c.distill.teacher_site) {
    run_teacher(ctx);  // stateless: a resumed job's teacher simply starts again
    return 0;
  }

  Trainer trainer(ctx, rejoin, start);  // the site, the task, the strategy, ZeRO
  if (resume || rejoin) trainer.resume(rejoin);
  if (!rejoin) trainer.evaluate_at_start();
  if (const int stopped = trainer.train()) return stopped;  // 128 + signal, checkpointed
  trainer.finish();
  return 0;
}

}  // namespace nebula::train
