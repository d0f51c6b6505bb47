#include "train/worker.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <spdlog/spdlog.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <set>
#include <thread>

#include "collective/gateway_mesh.h"
#include "collective/hierarchical.h"
#include "collective/site_group.h"
#include "data/tokenizer.h"
#include "model/safetensors.h"
#include "nebula/error.h"
#include "nebula/log.h"
#include "nebula/session.h"
#include "strategy/strategy.h"
#include "train/site_comm.h"
#include "train/checkpoint.h"
#include "train/metrics.h"
#include "train/full_shard.h"
#include "train/inner_optimizer.h"
#include "train/optimizer_state.h"
#include "train/site_data.h"
#include "train/task.h"
#include "transport/tcp_link.h"
#include "wire/frame.h"

namespace nebula::train {
namespace {


// Sums counters over every worker of the job. The hierarchy reduces float32, exact only up to
// 2^24, so each value travels as a high and a low part (exact for integers up to 2^44).
std::vector<double> sum_over_job(collective::Hierarchy& comm, const std::vector<double>& values) {
  constexpr double kSplit = 1 << 20;
  at::Tensor t = at::empty({static_cast<int64_t>(2 * values.size())}, at::kFloat);
  for (size_t i = 0; i < values.size(); ++i) {
    const double hi = std::floor(values[i] / kSplit);
    t[static_cast<int64_t>(2 * i)] = static_cast<float>(hi);
    t[static_cast<int64_t>(2 * i + 1)] = static_cast<float>(values[i] - hi * kSplit);
  }
  comm.allreduce(t, {collective::ReduceOp::kSum, 1.0});
  std::vector<double> out(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    out[i] = static_cast<double>(t[static_cast<int64_t>(2 * i)].item<float>()) * kSplit +
             static_cast<double>(t[static_cast<int64_t>(2 * i + 1)].item<float>());
  return out;
}

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

// SIGINT/SIGTERM: the training loop checkpoints and stops at the end of the step.
std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

// Tests: NEBULA_TEST_STOP_AT_STEP=N stops after step N as if SIGTERM had come then (a
// deterministic moment for resume tests).
int64_t test_stop_step() {
  const char* v = std::getenv("NEBULA_TEST_STOP_AT_STEP");
  return v ? std::atoll(v) : -1;
}

// Everything a worker needs to continue: the model (all of it: PEFT's frozen part too), the
// optimizer, LibTorch's generator, the task's data position, the strategy and its codecs.
// Sharded, the trainable parameters go as this worker's shard (InnerOptimizer::save), the
// rest of the model whole.
Checkpoint capture(int64_t step, Task& task, const InnerOptimizer& optimizer, const strategy::Strategy& strategy) {
  Checkpoint k;
  k.step = step;
  std::set<const void*> sharded;  // the trainable parameters, when the optimizer saves them as shards
  if (optimizer.sharded())
    for (const auto& p : task.trainable()) sharded.insert(p.unsafeGetTensorImpl());
  for (const auto& item : task.module().named_parameters())
    if (!sharded.count(item.value().unsafeGetTensorImpl())) k.tensors["model/" + item.key()] = item.value().detach();
  for (const auto& item : task.module().named_buffers()) k.tensors["model/" + item.key()] = item.value();
  optimizer.save(k);
  save_torch_rng(k);
  task.save_state(k);
  strategy::StrategyState st;
  strategy.save_state(st);
  for (const auto& [name, t] : st.tensors) k.tensors["strategy/" + name] = t;
  k.state["strategy"] = {{"numbers", st.numbers}, {"strings", st.strings}, {"decisions", st.decisions}};
  return k;
}

// A checkpoint with the trainable parameters as shards holds only the rest here: the
// optimizer writes them (InnerOptimizer::load / load_resharded).
void load_model(const Checkpoint& k, Task& task) {
  at::NoGradGuard no_grad;
  std::set<const void*> sharded;
  if (InnerOptimizer::holds_parameter_shards(k))
    for (const auto& p : task.trainable()) sharded.insert(p.unsafeGetTensorImpl());
  auto load = [&](const std::string& name, at::Tensor t) {
    if (sharded.count(t.unsafeGetTensorImpl())) return;
    auto it = k.tensors.find("model/" + name);
    if (it == k.tensors.end() || !it->second.sizes().equals(t.sizes()))
      throw DataError(str_cat("checkpoint of step ", k.step, ": model tensor '", name, "' is ",
                              it == k.tensors.end() ? "missing" : "of another shape",
                              ": the model changed since the checkpoint"));
    t.copy_(it->second);
  };
  for (const auto& item : task.module().named_parameters()) load(item.key(), item.value());
  for (const auto& item : task.module().named_buffers()) load(item.key(), item.value());
}

strategy::StrategyState strategy_state(const Checkpoint& k) {
  strategy::StrategyState st;
  for (const auto& [name, t] : k.tensors)
    if (name.rfind("strategy/", 0) == 0) st.tensors[name.substr(9)] = t;
  const nlohmann::json& js = k.state.contains("strategy") ? k.state["strategy"] : nlohmann::json::object();
  if (js.contains("numbers")) st.numbers = js["numbers"].get<std::map<std::string, double>>();
  if (js.contains("strings")) st.strings = js["strings"].get<std::map<std::string, std::string>>();
  if (js.contains("decisions")) st.decisions = js["decisions"].get<std::vector<std::string>>();
  return st;
}

void restore(const Checkpoint& k, Task& task, InnerOptimizer& optimizer, strategy::Strategy& strategy) {
  load_model(k, task);
  optimizer.load(k);
  load_torch_rng(k);
  task.load_state(k);
  strategy.load_state(strategy_state(k));
}

// Resharding: `ranks` are the checkpoints of every worker of the site that wrote them (another
// number of workers, or another [parallel] shard, than now), all of one step. The model (the
// same on every worker) comes from rank 0's; the optimizer's and strategy's sharded state is
// joined and this worker takes its part. With the same number of workers this worker also
// continues its own data position and generator (so changing only the shard mode resumes
// exactly); with another number the site's data is partitioned anew, and each worker's
// position starts over (its generator: that of the old rank of its index, if there was one).
void restore_resharded(const std::vector<Checkpoint>& ranks, int rank, bool same_workers, Task& task,
                       InnerOptimizer& optimizer, strategy::Strategy& strategy) {
  load_model(ranks.at(0), task);
  std::vector<const Checkpoint*> pointers;
  std::vector<strategy::StrategyState> states;
  for (const auto& k : ranks) {
    pointers.push_back(&k);
    states.push_back(strategy_state(k));
  }
  optimizer.load_resharded(pointers);
  const auto own = static_cast<size_t>(rank);
  if (own < ranks.size()) load_torch_rng(ranks[own]);
  if (same_workers) task.load_state(ranks.at(own));
  strategy.load_resharded(states);
}

}  // namespace

void Task::save_model(const std::string& run_dir, const std::map<std::string, std::string>& metadata) {
  model::save_module(module(), run_dir + "/model.safetensors", metadata);
}

std::string load_pretrained(const TaskContext& ctx, torch::nn::Module& whole, model::MlmEncoderImpl& encoder) {
  const std::string& path = ctx.config.model.init;
  const model::TensorFile init = model::load_safetensors(path);
  const auto kind_of = init.metadata.find("kind");
  const std::string kind = kind_of == init.metadata.end() ? "mlm_encoder" : kind_of->second;
  if (kind != "mlm_encoder" && kind != ctx.config.model.kind)
    throw DataError(str_cat(path, " (model.init): a ", kind, " model; a ", ctx.config.model.kind,
                            " starts from a pre-trained mlm_encoder or from a ", ctx.config.model.kind, " model"));
  if (auto vocab = init.metadata.find("vocab");
      ctx.tokenizer && vocab != init.metadata.end() && vocab->second != std::to_string(ctx.tokenizer->vocab_size()))
    throw DataError(str_cat(path, " (model.init): trained with a vocabulary of ", vocab->second, " pieces, but ",
                            ctx.tokenizer_path, " has ", ctx.tokenizer->vocab_size(),
                            "; set data.tokenizer to that run's tokenizer.model"));
  if (kind == ctx.config.model.kind)
    model::load_module(whole, init, path);
  else
    model::load_module(encoder, init, path);
  spdlog::info("{} initialised from {} (a {} model)", kind == ctx.config.model.kind ? "model" : "encoder", path, kind);
  return kind;
}

std::map<std::string, std::string> text_model_metadata(const TaskContext& ctx, const std::string& kind) {
  const ModelConfig& m = ctx.config.model;
  return {{"format", "nebula"},
          {"kind", kind},
          {"dim", std::to_string(m.dim)},
          {"layers", std::to_string(m.layers)},
          {"heads", std::to_string(m.heads)},
          {"ffn", std::to_string(m.ffn)},
          {"max_len", std::to_string(m.max_len)},
          {"vocab", std::to_string(ctx.tokenizer->vocab_size())},
          {"tokenizer", std::filesystem::absolute(ctx.tokenizer_path).string()}};
}

uint64_t batch_seed(const Config& c, const WorkerIdentity& who) {
  const std::string& name = c.sites.at(who.site).name;
  const uint32_t site = wire::crc32(0, {reinterpret_cast<const uint8_t*>(name.data()), name.size()});
  return c.job.seed * 1000003 + uint64_t{site} * 1009 + static_cast<uint64_t>(who.local_rank);
}

std::string default_tokenizer_path(const Config& c) { return c.job.run_dir + "/tokenizer.model"; }

int run_worker(const Config& c, const WorkerIdentity& who, bool resume, bool rejoin) {
  const SiteConfig& site = c.sites.at(who.site);
  const int workers = static_cast<int>(site.workers);
  size_t site_first = 0;  // the job-wide index of this site's rank 0 (sites in order, ranks in order)
  for (size_t s = 0; s < who.site; ++s) site_first += static_cast<size_t>(c.sites[s].workers);
  NEBULA_CHECK(who.local_rank >= 0 && who.local_rank < workers, "site '", site.name, "' has ", workers,
               " workers; rank ", who.local_rank, " does not exist");
  init_logging(str_cat(site.name, "/", who.local_rank));
  set_cpu_threads(1);  // several workers share the machine's cores: one thread each
  const auto start = Clock::now();
  const Millis timeout = std::chrono::duration_cast<Millis>(c.job.timeout);

  TaskContext ctx{c, who, std::nullopt, "", {}, worker_device(c, site, who.local_rank)};
  if (ctx.device.is_cuda()) spdlog::info("training on {}", ctx.device.str());
  if (c.model.kind != "torchscript") {  // text tasks: the job's SentencePiece vocabulary
    ctx.tokenizer_path = c.data.tokenizer.empty() ? default_tokenizer_path(c) : c.data.tokenizer;
    // A worker never trains the vocabulary itself: every site must use the same one, and only
    // the tokenizer site may train it on its own data.
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
  }
  if (rejoin && (!c.job.elastic || c.strategy.kind == "sync" || c.distill.enabled()))
    throw ConfigError(str_cat("--rejoin: site '", site.name, "' can rejoin only an elastic diloco or streaming job "
                              "without [distill] (job.elastic = true); restart the whole job with --resume instead"));
  if (c.distill.enabled() && site.name == c.distill.teacher_site) {
    run_teacher(ctx);  // stateless: a resumed job's teacher simply starts again
    return 0;
  }

  // Communication: the site's c10d group, and on the gateway the WAN mesh to the other
  // training sites (with [distill] the one other site is the teacher: its link goes to the task).
  SiteComm site_comm = connect_site(c, who, rejoin);
  collective::SiteGroup& group = *site_comm.group;
  collective::GatewayMesh* mesh = site_comm.mesh.get();
  collective::Hierarchy& comm = *site_comm.comm;
  const std::vector<std::string>& training_names = site_comm.training_names;
  const size_t training_index = site_comm.training_index;

  std::unique_ptr<Task> task = c.model.kind == "seq2seq"       ? make_translation_task(ctx, site_comm.teacher.get())
                               : c.model.kind == "torchscript" ? make_script_task(ctx)
                               : c.model.kind == "classifier"  ? make_classifier_task(ctx)
                                                               : make_mlm_task(ctx);
  std::vector<at::Tensor> params = task->trainable();
  int64_t trainable_values = 0, model_values = 0;  // before any sharding
  for (const auto& p : params) trainable_values += p.numel();
  for (const auto& p : task->module().parameters()) model_values += p.numel();
  auto strategy =
      strategy::make_strategy(c.strategy, comm, timeout, training_names.size(), training_index, c.privacy);
  strategy->set_buffers(task->module().buffers());  // BatchNorm statistics ...: kept equal too
  if (c.parallel.shard != "none" && workers > 1) strategy->expect_sharding();  // InnerOptimizer::sharded()
  strategy->init(params);
  // ZeRO-3: from here on this worker holds its shard of the parameters only; the model gathers
  // each layer where it runs, and whole() gathers all of them for evaluation and checkpoints.
  std::unique_ptr<FullShard> full;
  if (c.parallel.shard == "full" && workers > 1) {
    const std::vector<torch::nn::Module*> layers = task->layers();
    if (layers.empty())
      throw ConfigError(str_cat(c.source_path, ": parallel.shard = \"full\" needs a built-in model that runs layer by "
                                "layer (model.kind = \"", c.model.kind, "\" does not): use shard = \"gradients\""));
    full = std::make_unique<FullShard>(params, layers, group);
    task->set_layer_gather(full.get());
  }
  // `gateway`: only the gateway needs the model (its evaluation, the model file).
  auto whole = [&](const std::function<void()>& fn, bool gateway = false) {
    if (full)
      full->with_full_model(fn, gateway);
    else
      fn();
  };
  // Validation runs on every worker: ZeRO-3 gathers layer by layer, as in training, when every
  // worker of the site has validation data (the same forwards everywhere), else the whole model.
  auto validate_now = [&] {
    std::pair<double, double> out;
    auto run = [&] { out = task->validate(c.job.eval_batches); };
    if (!full) {
      run();
      return out;
    }
    at::Tensor all = at::full({1}, task->has_validation() ? 1.0f : 0.0f);
    group.allreduce_sum(all);
    if (all.item<float>() == static_cast<float>(workers))
      full->with_rest(run);
    else
      full->with_full_model(run);
    return out;
  };
  InnerOptimizer optimizer(params, c.model.lr, c.model.weight_decay, c.parallel.shard, group, full.get());
  if (optimizer.sharded())  // the strategy keeps its shard of the outer state (and ZeRO-2/3's gradients)
    strategy->set_sharding({optimizer.flat_params(), optimizer.gradients_sharded() ? optimizer.flat_grad() : at::Tensor(),
                            optimizer.params_gathered()});
  if (optimizer.sharded() && who.local_rank == 0)
    spdlog::info("inner optimizer: ZeRO-{} over the site's {} workers, AdamW moments for {} of {} parameters per worker{}",
                 full ? 3 : optimizer.gradients_sharded() ? 2 : 1, workers, optimizer.state_numel(),
                 optimizer.total_numel(), full ? "; the parameters sharded too, gathered layer by layer" : "");
  MetricsWriter metrics(c.job.run_dir + "/metrics.jsonl");
  int64_t tokens = 0;
  double window_loss = 0, window_predicted = 0, last_loss = 0, last_predicted = 0;
  auto window_start = Clock::now();
  int64_t window_tokens = 0;

  // One metrics line per `log_every` steps (and one for the last, partial window).
  auto write_metrics = [&](int64_t steps_done) {
    const double seconds = std::chrono::duration<double>(Clock::now() - window_start).count();
    const auto stats = comm.stats();
    nlohmann::json links = nlohmann::json::object();
    for (size_t j = 0; j < stats.links.size(); ++j) {
      const auto& e = stats.links[j];
      if (j == training_index || (e.rtt_samples == 0 && e.bandwidth_samples == 0)) continue;
      links[training_names[j]] = {{"rtt_ms", e.rtt_s * 1e3},
                                {"rtt_smoothed_ms", e.rtt_smoothed_s * 1e3},
                                {"bandwidth_bits_per_s", e.bandwidth_bits_per_s}};
    }
    metrics.write({{"time", unix_time()},
                   {"elapsed", std::chrono::duration<double>(Clock::now() - start).count()},
                   {"site", site.name},
                   {"rank", who.local_rank},
                   {"step", steps_done},
                   {"steps", c.job.steps},
                   {"loss", window_loss / window_predicted},
                   {"tokens", tokens},
                   {"tokens_per_s", seconds > 0 ? static_cast<double>(window_tokens) / seconds : 0.0},
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
                   {"adamw_state_values", 2 * optimizer.state_numel()},  // this worker's moments ([parallel] shard)
                   {"peak_rss_bytes", peak_rss_bytes()},
                   {"strategy", strategy->metrics()}});
    last_loss = window_loss;
    last_predicted = window_predicted;
    window_loss = window_predicted = 0;
    window_tokens = 0;
    window_start = Clock::now();
  };

  // Evaluation on the gateway: a metrics line {"site", "step", "eval"} with this site's values.
  int64_t last_eval_step = -1;
  std::vector<double> last_eval;
  auto evaluate_now = [&](int64_t steps_done) {
    if (who.local_rank != 0) return std::vector<double>(task->eval_size(), 0.0);
    if (steps_done == last_eval_step) return last_eval;  // the end of the run fell on an eval.every step
    std::vector<double> counts = task->evaluate();
    last_eval_step = steps_done;
    last_eval = counts;
    metrics.write({{"time", unix_time()}, {"site", site.name}, {"rank", 0}, {"step", steps_done},
                   {"eval", task->eval_json(counts)}});
    return counts;
  };
  // Checkpoints: this worker's own directory. With --resume, every worker of the site (diloco,
  // streaming: sites then reconcile) or of the job (sync: one step for all) takes the newest
  // step all of them hold.
  const std::string checkpoint_dir = str_cat(c.checkpoint.dir, "/", site.name, "/rank-", who.local_rank);
  const std::string fingerprint = training_fingerprint(c);
  std::vector<double> eval_start(task->eval_size(), 0.0);
  int64_t step = 0;
  bool resumed = false;
  if (resume || rejoin) {
    std::optional<Checkpoint> newest = load_latest_checkpoint(checkpoint_dir, fingerprint);
    // The layout the site's checkpoints were written in, as rank 0's newest one says: another
    // number of workers or [parallel] shard than now means resharding, from every old rank's.
    at::Tensor layout = at::full({2}, static_cast<float>(workers));  // [old workers, 1 if the shard mode changed]
    layout[1] = 0.0f;
    if (who.local_rank == 0 && newest) {
      const auto& w = newest->state.value("worker", nlohmann::json::object());
      layout[0] = static_cast<float>(w.value("workers", workers));
      layout[1] = w.value("shard", c.parallel.shard) != c.parallel.shard ? 1.0f : 0.0f;
    }
    if (workers > 1) group.broadcast_from_root(layout);
    const int old_workers = static_cast<int>(layout[0].item<float>());
    const bool reshard = old_workers != workers || layout[1].item<float>() > 0;
    auto rank_dir = [&](int q) { return str_cat(c.checkpoint.dir, "/", site.name, "/rank-", q); };
    std::vector<std::optional<Checkpoint>> olds;  // resharding: each old rank's newest
    int64_t have = newest ? newest->step : -1;    // the newest step this worker can restore
    if (reshard) {
      for (int q = 0; q < old_workers; ++q) {
        olds.push_back(q == who.local_rank ? newest : load_latest_checkpoint(rank_dir(q), fingerprint));
        have = olds.back() ? (q == 0 ? olds.back()->step : std::min(have, olds.back()->step)) : -1;
        if (have < 0) break;
      }
      spdlog::info("--resume: the site's checkpoints were written by {} workers with parallel.shard {}, this run has {} "
                   "with \"{}\": resharding", old_workers, layout[1].item<float>() > 0 ? "changed" : "unchanged",
                   workers, c.parallel.shard);
    }
    std::vector<double> mine(static_cast<size_t>(c.total_workers()), 0.0);
    mine[site_first + static_cast<size_t>(who.local_rank)] = static_cast<double>(have + 1);
    const std::vector<double> all = sum_over_job(comm, mine);  // step + 1 per worker, 0 = none
    const bool per_site = c.strategy.kind != "sync";
    const size_t begin = per_site ? site_first : 0, end = per_site ? site_first + static_cast<size_t>(workers) : all.size();
    const double common = *std::min_element(all.begin() + static_cast<std::ptrdiff_t>(begin),
                                            all.begin() + static_cast<std::ptrdiff_t>(end)) - 1;
    if (common < 0) {
      spdlog::warn("--resume: {} has no checkpoint every worker of the {} holds: starting from step 0",
                   reshard ? str_cat(c.checkpoint.dir, "/", site.name) : checkpoint_dir, per_site ? "site" : "job");
    } else {
      const auto target = static_cast<int64_t>(common);
      const Checkpoint* own = nullptr;
      if (!reshard) {
        if (newest && newest->step != target) newest = load_latest_checkpoint(checkpoint_dir, fingerprint, target);
        if (!newest || newest->step != target)
          throw DataError(str_cat(checkpoint_dir, ": no intact checkpoint of step ", target,
                                  ", the newest every other worker holds: resume is impossible from these "
                                  "checkpoints; start without --resume"));
        whole([&] { restore(*newest, *task, optimizer, *strategy); });
        own = &*newest;
      } else {
        std::vector<Checkpoint> ranks;
        for (int q = 0; q < old_workers; ++q) {
          auto& k = olds[static_cast<size_t>(q)];
          if (!k || k->step != target) k = load_latest_checkpoint(rank_dir(q), fingerprint, target);
          if (!k || k->step != target)
            throw DataError(str_cat(rank_dir(q), ": no intact checkpoint of step ", target, ", which resharding the "
                                    "site's ", old_workers, " workers' checkpoints needs (every worker must be able "
                                    "to read every old rank's directory: a checkpoint.dir they share)"));
          ranks.push_back(std::move(*k));
        }
        whole([&] { restore_resharded(ranks, who.local_rank, old_workers == workers, *task, optimizer, *strategy); });
        // The tokens so far: each worker's own with the same workers, else all of them on rank 0.
        int64_t so_far = 0;
        for (int q = 0; q < old_workers; ++q)
          if (old_workers == workers ? q == who.local_rank : who.local_rank == 0)
            so_far += ranks[static_cast<size_t>(q)].state.value("worker", nlohmann::json::object()).value("tokens", int64_t{0});
        olds.clear();
        newest = std::move(ranks[0]);
        newest->state["worker"]["tokens"] = so_far;
        own = &*newest;
        spdlog::info("resharded the checkpoint of step {} from {} workers onto {}{}", target, old_workers, workers,
                     old_workers == workers ? "" : " (the site's data is partitioned anew: each worker's position starts over)");
      }
      step = own->step;
      const auto& w = own->state.value("worker", nlohmann::json::object());
      tokens = w.value("tokens", int64_t{0});
      if (w.contains("eval_start")) eval_start = w["eval_start"].get<std::vector<double>>();
      resumed = true;
      spdlog::info("resumed from {}/step-{} ({} tokens so far)",
                   reshard ? str_cat(c.checkpoint.dir, "/", site.name, "/rank-*") : checkpoint_dir, step, tokens);
    }
    if (rejoin)
      strategy->join();  // the others admit this site at their next round and hand it their state
    else
      strategy->reconcile();
  }
  if (!resumed && !rejoin && task->eval_at_start()) whole([&] { eval_start = evaluate_now(0); }, true);
  auto checkpoint_now = [&](int64_t steps_done) {
    auto save = [&] {
      Checkpoint k = capture(steps_done, *task, optimizer, *strategy);
      k.state["worker"] = {{"tokens", tokens},          {"eval_start", eval_start}, {"site", site.name},
                           {"rank", who.local_rank}, {"workers", workers},       {"shard", c.parallel.shard}};
      save_checkpoint(checkpoint_dir, k, fingerprint, static_cast<int>(c.checkpoint.keep));
    };
    // Sharded, each rank saves its shard of the trainable parameters: ZeRO-3 gathers nothing.
    if (optimizer.sharded())
      save();
    else
      whole(save);
    spdlog::info("checkpoint of step {} written to {}", steps_done, checkpoint_dir);
  };

  // SIGINT/SIGTERM end the step, then checkpoint and stop (every worker of the site agrees
  // on the step through a one-value all-reduce per step).
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  const int64_t stop_at = test_stop_step();
  bool checkpoint_due = false;  // since step due_since: at the first step with nothing on the WAN
  int64_t due_since = 0;
  int stop_signal = 0;

  for (; strategy->keep_training(step, c.job.steps); ++step) {
    const auto step_start = Clock::now();
    if (full) full->begin_step();
    Task::Step batch = task->forward(step);
    optimizer.zero_grad();
    strategy->before_backward(batch.weight);
    if (full) full->set_grad_weight(batch.weight);
    batch.loss.backward();  // gradient buckets start crossing the WAN while this runs
    if (full) full->end_backward();
    strategy->sync_gradients(params, batch.weight);
    if (c.model.clip_norm > 0) optimizer.clip_grad_norm(c.model.clip_norm);
    optimizer.set_lr(scheduled_lr(c.model, step, c.job.steps));
    optimizer.step();
    strategy->after_step(step);
    if (site.slowdown > 1)  // emulated slower hardware: this step takes `slowdown` times as long
      std::this_thread::sleep_for((Clock::now() - step_start) * (site.slowdown - 1));

    tokens += batch.tokens;
    window_tokens += batch.tokens;
    window_loss += batch.loss.item<double>() * batch.weight;
    window_predicted += batch.weight;
    if ((step + 1) % c.job.log_every == 0) write_metrics(step + 1);
    if (c.eval.every > 0 && (step + 1) % c.eval.every == 0)  // on the merged model, not the replica mid-round
      strategy->with_global_weights([&] { whole([&] { evaluate_now(step + 1); }, true); });

    float stop = g_stop_signal.load() != 0 ? static_cast<float>(g_stop_signal.load()) : 0.0f;
    if (step + 1 == stop_at) stop = SIGTERM;
    if (workers > 1) {  // the site stops together (the largest signal number wins)
      at::Tensor flag = at::full({1}, stop, at::kFloat);
      group.allreduce_sum(flag);
      if (flag.item<float>() > 0 && stop == 0) stop = SIGTERM;  // another worker of the site was told
    }
    if (stop > 0 && !stop_signal) {
      stop_signal = static_cast<int>(stop);
      spdlog::warn("stopping (signal {}): checkpoint at the first step with nothing on the WAN", stop_signal);
    }
    if (c.checkpoint.every > 0 && (step + 1) % c.checkpoint.every == 0 && !checkpoint_due) {
      checkpoint_due = true;
      due_since = step + 1;
    }
    if (stop_signal && !checkpoint_due) {
      checkpoint_due = true;
      due_since = step + 1;
    }
    if (checkpoint_due && !strategy->can_save() && step + 1 - due_since >= c.strategy.delay) strategy->drain();
    if (checkpoint_due && strategy->can_save()) {
      checkpoint_now(step + 1);
      checkpoint_due = false;
      if (stop_signal) {
        if (window_predicted > 0) write_metrics(step + 1);
        group.barrier();
        spdlog::warn("stopped after step {}: continue with --resume", step + 1);
        return 128 + stop_signal;
      }
    }
  }
  strategy->finish();  // exchanges still in flight
  task->finish();
  if (window_predicted > 0) write_metrics(step);

  // End of run: validation loss, evaluation, and job-wide totals for the summary, in one collective
  // (ZeRO-3: the gateway gathers the whole model for its evaluation and the model file).
  const std::pair<double, double> validation = validate_now();
  whole([&] {
    const auto wan = comm.stats();  // before the totals exchange itself
    std::vector<double> eval_end = evaluate_now(step);
    std::vector<double> counters = {static_cast<double>(tokens), static_cast<double>(wan.wan_bytes_sent),
                                    static_cast<double>(wan.wan_bytes_received), last_loss,
                                    last_predicted, validation.first, validation.second,
                                    static_cast<double>(wan.wan_wire_bytes_sent),
                                    static_cast<double>(wan.wan_wire_bytes_received)};
    constexpr size_t kFixed = 9;
    counters.insert(counters.end(), eval_start.begin(), eval_start.end());
    counters.insert(counters.end(), eval_end.begin(), eval_end.end());
    // Each worker's own WAN bytes at its place in the job (sites in order, ranks in order).
    const size_t by_worker_at = counters.size();
    counters.resize(by_worker_at + static_cast<size_t>(c.total_workers()), 0.0);
    counters[by_worker_at + site_first + static_cast<size_t>(who.local_rank)] = static_cast<double>(wan.wan_bytes_sent);
    std::vector<double> totals = sum_over_job(comm, counters);
    auto total = [&](int i) { return totals[static_cast<size_t>(i)]; };
    auto eval_part = [&](size_t k) {
      const auto begin = totals.begin() + static_cast<std::ptrdiff_t>(kFixed + k * task->eval_size());
      return std::vector<double>(begin, begin + static_cast<std::ptrdiff_t>(task->eval_size()));
    };
    // The first site still in the job (elastic: site 0 may be lost) writes the summary and model.
    const bool writer = mesh && mesh->site_index() == mesh->first_live();
    if (writer) {
      nlohmann::json summary = {
          {"job", c.job.name},
          {"strategy", strategy->name()},
          {"decisions", strategy->decisions()},
          {"codec", c.strategy.codec},
          {"compression_ratio", wan.codec_bytes_out ? double(wan.codec_bytes_in) / double(wan.codec_bytes_out) : 1.0},
          {"sites", c.sites.size()},
          {"workers", c.total_workers()},
          {"steps", c.job.steps},
          {"local_steps_site0", step},
          {"tokens", total(0)},
          {"wall_seconds", std::chrono::duration<double>(Clock::now() - start).count()},
          {"final_train_loss", total(4) > 0 ? total(3) / total(4) : 0.0},
          {"final_val_loss", total(6) > 0 ? nlohmann::json(total(5) / total(6)) : nlohmann::json(nullptr)},
          {"model_kind", c.model.kind},
          {"parameters", model_values},
          {"trainable_parameters", trainable_values},  // what the strategy keeps equal: all of them, or [peft]'s
          {"model", c.job.run_dir + "/model.safetensors"},
          {"wan_bytes", total(1)},
          {"wan_bytes_sent", total(1)},
          {"wan_bytes_received", total(2)},
          // On the network: TLS records, acks, probes, heartbeats, re-sends, handshakes.
          {"wan_wire_bytes", total(7)},
          {"wan_wire_bytes_sent", total(7)},
          {"wan_wire_bytes_received", total(8)},
          {"wan_bytes_sent_by_worker", std::vector<double>(totals.begin() + static_cast<std::ptrdiff_t>(by_worker_at), totals.end())},
          {"security", c.security.insecure ? "plaintext" : "mutual TLS 1.3"},
          {"wan_streams", c.wan.streams},
          {"wan_links_seen_from_" + site.name, [&] {
             nlohmann::json links = nlohmann::json::object();
             for (size_t j = 0; j < wan.links.size(); ++j)
               if (j != training_index)
                 links[training_names[j]] = {{"rtt_ms", wan.links[j].rtt_s * 1e3},
                                           {"bandwidth_bits_per_s", wan.links[j].bandwidth_bits_per_s}};
             return links;
           }()},
          {"wan_emulation", {{"bandwidth_bits_per_s", c.wan.path.bandwidth_bits},
                             {"rtt_ms", std::chrono::duration<double, std::milli>(c.wan.path.rtt).count()}}}};
      if (task->eval_at_start()) summary["eval_start"] = task->eval_json(eval_part(0));
      summary["eval"] = task->eval_json(eval_part(1));
      summary["strategy_metrics"] = strategy->metrics();  // rejected updates; privacy spent
      nlohmann::json lost = nlohmann::json::array();
      for (const auto& [j, why] : mesh->lost()) lost.push_back({{"site", training_names[j]}, {"reason", why}});
      summary["sites_lost"] = lost;
      nlohmann::json rejoined = nlohmann::json::array();
      for (size_t j : mesh->rejoined()) rejoined.push_back(training_names[j]);
      summary["sites_rejoined"] = rejoined;
      summary.update(task->summary());
      write_json_atomically(c.job.run_dir + "/summary.json", summary);
      auto meta = task->model_metadata();
      meta["steps"] = std::to_string(step);
      task->save_model(c.job.run_dir, meta);
    }
  }, true);
  group.barrier();  // nobody closes its links while another still needs them
  spdlog::info("done: {} steps, {} tokens", step, tokens);
  return 0;
}

}  // namespace nebula::train
