#include "train/worker_checkpoint.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <set>

#include "nebula/error.h"
#include "parallel/optimizer_state.h"

namespace nebula::train {
namespace {

// Sharded, the trainable parameters go as this worker's shard (InnerOptimizer::save), the
// rest of the model whole.
parallel::Checkpoint capture(int64_t step, Task& task, const parallel::InnerOptimizer& optimizer, const strategy::Strategy& strategy) {
  parallel::Checkpoint k;
  k.step = step;
  std::set<const void*> sharded;  // the trainable parameters, when the optimizer saves them as shards
  if (optimizer.sharded())
    for (const auto& p : task.trainable()) sharded.insert(p.unsafeGetTensorImpl());
  for (const auto& item : task.module().named_parameters())
    if (!sharded.count(item.value().unsafeGetTensorImpl())) k.tensors["model/" + item.key()] = item.value().detach();
  for (const auto& item : task.module().named_buffers()) k.tensors["model/" + item.key()] = item.value();
  optimizer.save(k);
  parallel::save_torch_rng(k);
  task.save_state(k);
  strategy::StrategyState st;
  strategy.save_state(st);
  for (const auto& [name, t] : st.tensors) k.tensors["strategy/" + name] = t;
  k.state["strategy"] = {{"numbers", st.numbers}, {"strings", st.strings}, {"decisions", st.decisions}};
  return k;
}

// A checkpoint with the trainable parameters as shards holds only the rest here: the
// optimizer writes them (InnerOptimizer::load / load_resharded). `pieces`: ZeRO-3 takes this
// worker's pieces of them from the file by range (load_parameter_pieces), so they are skipped here.
void load_model(const parallel::Checkpoint& k, Task& task, bool pieces = false) {
  at::NoGradGuard no_grad;
  std::set<const void*> sharded;
  if (pieces || parallel::InnerOptimizer::holds_parameter_shards(k))
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

// The checkpoint names of the trainable parameters, in the optimizer's order.
std::vector<std::string> trainable_names(Task& task) {
  std::map<const void*, std::string> names;
  for (const auto& item : task.module().named_parameters()) names[item.value().unsafeGetTensorImpl()] = "model/" + item.key();
  std::vector<std::string> out;
  for (const auto& p : task.trainable()) out.push_back(names.at(p.unsafeGetTensorImpl()));
  return out;
}

// ZeRO-3 from a checkpoint that holds the trainable parameters whole (written with shard =
// "none", or by ZeRO-1/2 before they saved parameter shards): this worker's pieces of them,
// read by range from the tensors `k` left in its file, straight into the shard. Nothing is whole
// here, and the site gathers nothing.
void load_parameter_pieces(const parallel::Checkpoint& k, Task& task, parallel::FullShard& full, int rank) {
  const std::vector<std::string> names = trainable_names(task);
  at::NoGradGuard no_grad;
  at::Tensor shard = full.shard().detach();
  for (size_t i = 0; i < names.size(); ++i) {
    const int64_t at = full.param_begin(i), n = full.param_numel(i);
    if (parallel::tensor_numel(k, names[i]) != n)
      throw DataError(str_cat("checkpoint of step ", k.step, ": model tensor '", names[i].substr(6), "' is ",
                              parallel::tensor_numel(k, names[i]) < 0 ? "missing" : "of another size",
                              ": the model changed since the checkpoint"));
    for (const parallel::ShardRun& r : full.layout().runs(rank, at, n))
      shard.narrow(0, r.local, r.len).copy_(parallel::read_range(k, names[i], r.flat - at, r.len).to(shard.device()));
  }
}

// What a worker holds a part of, not the whole (AdamW's moments and the parameter shards under
// optim/, diloco's outer state per fragment): resharding leaves these in the old workers' files
// and reads only this worker's part of them.
bool sharded_state(const std::string& name) {
  auto ends_with = [&](const std::string& tail) {
    return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  return name.rfind("optim/", 0) == 0 || (name.rfind("strategy/", 0) == 0 && (ends_with("/global") || ends_with("/momentum")));
}

// The strategy's state in `k` (which must outlive it: tensors left unread are read from k's file).
strategy::StrategyState strategy_state(const parallel::Checkpoint& k) {
  strategy::StrategyState st;
  for (const auto& [name, t] : k.tensors)
    if (name.rfind("strategy/", 0) == 0) st.tensors[name.substr(9)] = t;
  if (k.unread) {
    for (const auto& [name, e] : k.unread->tensors)
      if (name.rfind("strategy/", 0) == 0) st.unread[name.substr(9)] = e.numel;
    st.read = [&k](const std::string& name, int64_t begin, int64_t len) {
      return parallel::read_range(k, "strategy/" + name, begin, len);
    };
  }
  const nlohmann::json& js = k.state.contains("strategy") ? k.state["strategy"] : nlohmann::json::object();
  if (js.contains("numbers")) st.numbers = js["numbers"].get<std::map<std::string, double>>();
  if (js.contains("strings")) st.strings = js["strings"].get<std::map<std::string, std::string>>();
  if (js.contains("decisions")) st.decisions = js["decisions"].get<std::vector<std::string>>();
  return st;
}

void restore(const parallel::Checkpoint& k, Task& task, parallel::InnerOptimizer& optimizer, strategy::Strategy& strategy) {
  load_model(k, task);
  optimizer.load(k);
  parallel::load_torch_rng(k);
  task.load_state(k);
  strategy.load_state(strategy_state(k));
}

// Resharding: `ranks` are the checkpoints of every worker of the site that wrote them (another
// number of workers, or another [parallel] shard, than now), all of one step, their sharded
// state left in the files. The model's other tensors (the same on every worker) come from rank
// 0's; of the optimizer's and strategy's sharded state this worker reads only its part. With the same number of workers this worker also
// continues its own data position and generator (so changing only the shard mode resumes
// exactly); with another number the site's data is partitioned anew, and each worker's
// position starts over (its generator: that of the old rank of its index, if there was one).
void restore_resharded(const std::vector<parallel::Checkpoint>& ranks, int rank, bool same_workers, Task& task,
                       parallel::InnerOptimizer& optimizer, strategy::Strategy& strategy,
                       parallel::FullShard* pieces = nullptr) {
  load_model(ranks.at(0), task, pieces != nullptr);
  if (pieces) load_parameter_pieces(ranks.at(0), task, *pieces, rank);
  std::vector<const parallel::Checkpoint*> pointers;
  std::vector<strategy::StrategyState> states;
  for (const auto& k : ranks) {
    pointers.push_back(&k);
    states.push_back(strategy_state(k));
  }
  optimizer.load_resharded(pointers);
  const auto own = static_cast<size_t>(rank);
  if (own < ranks.size()) parallel::load_torch_rng(ranks[own]);
  if (same_workers) task.load_state(ranks.at(own));
  strategy.load_resharded(states);
}


// Where the site's newest checkpoints came from, as rank 0's says: another number of workers
// or [parallel] shard than now means resharding, from every old rank's checkpoint.
struct WrittenLayout {
  int workers = 0;
  bool shard_changed = false;
  bool reshard(int workers_now) const { return workers != workers_now || shard_changed; }
};

WrittenLayout written_layout(const Config& c, const WorkerIdentity& who, collective::SiteGroup& group,
                             const std::optional<parallel::Checkpoint>& newest, const parallel::InnerOptimizer& optimizer) {
  const int workers = static_cast<int>(c.sites.at(who.site).workers);
  at::Tensor layout = at::full({2}, static_cast<float>(workers));  // [old workers, 1 if the shard mode changed]
  layout[1] = 0.0f;
  if (who.local_rank == 0 && newest) {
    const auto& w = newest->state.value("worker", nlohmann::json::object());
    layout[0] = static_cast<float>(w.value("workers", workers));
    // The shard mode, or the units its shards were cut into (parallel/shard_layout.h: ZeRO-3's
    // layout changed with the model's layers, or a checkpoint from before ZeRO-3 cut by layer).
    const auto& shard = newest->state.value("optim", nlohmann::json::object()).value("shard", nlohmann::json::object());
    const std::vector<int64_t> whole{0, optimizer.total_numel()};
    const bool units_changed = optimizer.sharded() && shard.value("of", 1) > 1 &&
                               shard.value("units", whole) != optimizer.layout().bounds();
    layout[1] = w.value("shard", c.parallel.shard) != c.parallel.shard || units_changed ? 1.0f : 0.0f;
  }
  if (workers > 1) group.broadcast_from_root(layout);
  return {static_cast<int>(layout[0].item<float>()), layout[1].item<float>() > 0};
}

}  // namespace

WorkerCheckpoints::WorkerCheckpoints(const Config& config, const WorkerIdentity& who, collective::Hierarchy& comm,
                                     Task& task, parallel::InnerOptimizer& optimizer, strategy::Strategy& strategy,
                                     parallel::FullShard* full)
    : c_(config), who_(who), comm_(comm), task_(task), optimizer_(optimizer), strategy_(strategy), full_(full),
      dir_(rank_dir(who.local_rank)), fingerprint_(training_fingerprint(config)) {}

std::string WorkerCheckpoints::rank_dir(int rank) const {
  return str_cat(c_.checkpoint.dir, "/", c_.sites.at(who_.site).name, "/rank-", rank);
}

void WorkerCheckpoints::save(const WorkerProgress& progress) {
  const SiteConfig& site = c_.sites.at(who_.site);
  auto save = [&] {
    parallel::Checkpoint k = capture(progress.step, task_, optimizer_, strategy_);
    k.state["worker"] = {{"tokens", progress.tokens}, {"eval_start", progress.eval_start}, {"site", site.name},
                         {"rank", who_.local_rank},   {"workers", site.workers},           {"shard", c_.parallel.shard},
                         {"pipeline", site_grid(c_, site).pipeline}, {"tensor", site_grid(c_, site).tensor}};
    parallel::save_checkpoint(dir_, k, fingerprint_, static_cast<int>(c_.checkpoint.keep));
  };
  // Sharded, each rank saves its shard of the trainable parameters: ZeRO-3 gathers nothing.
  if (optimizer_.sharded())
    save();
  else
    parallel::with_whole_model(full_, save);
  spdlog::info("checkpoint of step {} written to {}", progress.step, dir_);
}

std::optional<WorkerProgress> WorkerCheckpoints::restore_newest() {
  const SiteConfig& site = c_.sites.at(who_.site);
  const int workers = static_cast<int>(site.workers);
  // Its manifest only, for now: which layout wrote it (the tensors stay in the file).
  std::optional<parallel::Checkpoint> newest =
      parallel::load_latest_checkpoint(dir_, fingerprint_, INT64_MAX, [](const std::string&) { return true; });
  const WrittenLayout layout = written_layout(c_, who_, comm_.site(), newest, optimizer_);
  const int old_workers = layout.workers;
  const bool reshard = layout.reshard(workers);
  // Pipeline stages and tensor slices: each worker's checkpoint holds its own part; resuming onto
  // another cut (or onto a cut from a checkpoint without one) would need the layers cut again:
  // not built.
  auto same_cut = [&](const char* name, const char* parts, int64_t now, const std::string& key) {
    const int64_t old = newest ? newest->state.value("worker", nlohmann::json::object()).value(name, int64_t{1}) : now;
    if (old != now || (reshard && now > 1))
      throw ConfigError(str_cat(dir_, ": the checkpoint was written by ", old_workers, " workers in ", old, " ", parts,
                                "; this run has ", workers, " in ", now, ": resuming onto another ", name,
                                " layout is not built yet; resume with ", key, " = ", old, " and the site's ",
                                old_workers, " workers"));
  };
  same_cut("pipeline", "pipeline stage(s)", site_grid(c_, site).pipeline,
           str_cat(site.pipeline > 0 ? str_cat("sites[", who_.site, "].") : std::string(), "parallel.pipeline"));
  same_cut("tensor", "tensor slice(s) per replica", site_grid(c_, site).tensor,
           str_cat(site.tensor > 0 ? str_cat("sites[", who_.site, "].") : std::string(), "parallel.tensor"));
  // Resharding leaves the sharded state in the old files, to read by range; so does ZeRO-3 the
  // trainable parameters of a checkpoint that holds them whole (load_parameter_pieces).
  std::set<std::string> pieces_of;
  if (full_)
    for (const std::string& name : trainable_names(task_)) pieces_of.insert(name);
  auto unread = [&](const std::string& name) { return sharded_state(name) || pieces_of.count(name) > 0; };
  std::vector<std::optional<parallel::Checkpoint>> olds;  // resharding: each old rank's newest
  int64_t have = newest ? newest->step : -1;              // the newest step this worker can restore
  if (reshard) {
    for (int q = 0; q < old_workers; ++q) {
      olds.push_back(parallel::load_latest_checkpoint(rank_dir(q), fingerprint_, INT64_MAX, unread));
      have = olds.back() ? (q == 0 ? olds.back()->step : std::min(have, olds.back()->step)) : -1;
      if (have < 0) break;
    }
    spdlog::info("--resume: the site's checkpoints were written by {} workers with parallel.shard {}, this run has {} "
                 "with \"{}\": resharding", old_workers, layout.shard_changed ? "changed" : "unchanged", workers,
                 c_.parallel.shard);
  }
  // The newest step every worker that must agree holds: the site's (diloco, streaming) or the job's (sync).
  const size_t site_first = site::job_index(c_, {who_.site, 0});  // the site's rank 0
  std::vector<double> mine(static_cast<size_t>(c_.total_workers()), 0.0);
  mine[site::job_index(c_, who_)] = static_cast<double>(have + 1);
  const std::vector<double> all = collective::sum_counters(comm_, mine);  // step + 1 per worker, 0 = none
  const bool per_site = c_.strategy.kind != "sync";
  const size_t begin = per_site ? site_first : 0, end = per_site ? site_first + static_cast<size_t>(workers) : all.size();
  const double common = *std::min_element(all.begin() + static_cast<std::ptrdiff_t>(begin),
                                          all.begin() + static_cast<std::ptrdiff_t>(end)) - 1;
  if (common < 0) {
    spdlog::warn("--resume: {} has no checkpoint every worker of the {} holds: starting from step 0",
                 reshard ? str_cat(c_.checkpoint.dir, "/", site.name) : dir_, per_site ? "site" : "job");
    return std::nullopt;
  }
  const auto target = static_cast<int64_t>(common);
  if (!reshard) {
    newest = parallel::load_latest_checkpoint(dir_, fingerprint_, target);  // every tensor, now
    if (!newest || newest->step != target)
      throw DataError(str_cat(dir_, ": no intact checkpoint of step ", target,
                              ", the newest every other worker holds: resume is impossible from these "
                              "checkpoints; start without --resume"));
    // ZeRO-3 with the same layout: each worker's shard goes straight back, nothing gathered.
    if (full_ && parallel::InnerOptimizer::holds_parameter_shards(*newest))
      restore(*newest, task_, optimizer_, strategy_);
    else
      parallel::with_whole_model(full_, [&] { restore(*newest, task_, optimizer_, strategy_); });
  } else {
    std::vector<parallel::Checkpoint> ranks;
    for (int q = 0; q < old_workers; ++q) {
      auto& k = olds[static_cast<size_t>(q)];
      if (!k || k->step != target) k = parallel::load_latest_checkpoint(rank_dir(q), fingerprint_, target, unread);
      if (!k || k->step != target)
        throw DataError(str_cat(rank_dir(q), ": no intact checkpoint of step ", target, ", which resharding the "
                                "site's ", old_workers, " workers' checkpoints needs (every worker must be able "
                                "to read every old rank's directory: a checkpoint.dir they share)"));
      ranks.push_back(std::move(*k));
    }
    // ZeRO-3: straight into this worker's shard, from the old parameter shards or, when the
    // checkpoint holds the parameters whole, from this worker's pieces of them: nothing gathered.
    int64_t sharded_bytes = 0;
    for (const auto& k : ranks)
      if (k.unread)
        for (const auto& [name, e] : k.unread->tensors) sharded_bytes += e.numel * static_cast<int64_t>(at::elementSize(e.dtype));
    const int64_t read_before = parallel::range_bytes_read();
    const bool pieces = full_ && !parallel::InnerOptimizer::holds_parameter_shards(ranks.at(0));
    restore_resharded(ranks, who_.local_rank, old_workers == workers, task_, optimizer_, strategy_,
                      pieces ? full_ : nullptr);
    spdlog::info("resharding read {} of the old workers' {} bytes of sharded state (AdamW's moments, parameter "
                 "shards, outer state{})", parallel::range_bytes_read() - read_before, sharded_bytes,
                 pieces ? "; ZeRO-3: the trainable parameters, saved whole" : "");
    // The tokens so far: each worker's own with the same workers, else all of them on rank 0.
    int64_t so_far = 0;
    for (int q = 0; q < old_workers; ++q)
      if (old_workers == workers ? q == who_.local_rank : who_.local_rank == 0)
        so_far += ranks[static_cast<size_t>(q)].state.value("worker", nlohmann::json::object()).value("tokens", int64_t{0});
    olds.clear();
    newest = std::move(ranks[0]);
    newest->state["worker"]["tokens"] = so_far;
    spdlog::info("resharded the checkpoint of step {} from {} workers onto {}{}", target, old_workers, workers,
                 old_workers == workers ? "" : " (the site's data is partitioned anew: each worker's position starts over)");
  }
  WorkerProgress p;
  p.step = newest->step;
  const auto& w = newest->state.value("worker", nlohmann::json::object());
  p.tokens = w.value("tokens", int64_t{0});
  if (w.contains("eval_start")) p.eval_start = w["eval_start"].get<std::vector<double>>();
  spdlog::info("resumed from {}/step-{} ({} tokens so far)",
               reshard ? str_cat(c_.checkpoint.dir, "/", site.name, "/rank-*") : dir_, p.step, p.tokens);
  return p;
}

}  // namespace nebula::train
