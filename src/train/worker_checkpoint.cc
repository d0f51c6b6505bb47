#include "train/worker_checkpoint.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
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


// How a worker holds the model, recorded in its checkpoints (worker state "layout") so that a
// resume onto another layout can rebuild it: its stages' bounds or its slices' cut dimensions,
// and its trainable parameters' names in the optimizer's order.
nlohmann::json layout_record(const strategy::SiteLayout& layout, Task& task) {
  std::vector<std::string> names;
  for (const std::string& name : trainable_names(task)) names.push_back(name.substr(6));
  nlohmann::json record = {{"trainable", names}};
  if (const auto* stages = std::get_if<parallel::StageLayout>(&layout)) record["bounds"] = stages->bounds();
  if (const auto* slices = std::get_if<parallel::SliceLayout>(&layout)) record["dims"] = slices->dims();
  return record;
}

// The layout that wrote checkpoint `k` (its worker state), over the whole model's trainable
// parameters `shapes` (`total` values).
strategy::SiteLayout written_site_layout(const parallel::Checkpoint& k, const std::vector<std::vector<int64_t>>& shapes,
                                         int64_t total) {
  const nlohmann::json& w = k.state.at("worker");
  const int64_t pipeline = w.value("pipeline", int64_t{1}), tensor = w.value("tensor", int64_t{1});
  const int64_t workers = w.value("workers", int64_t{1}), data = workers / (pipeline * tensor);
  const nlohmann::json record = w.value("layout", nlohmann::json::object());
  if (tensor > 1) return parallel::SliceLayout(shapes, record.at("dims").get<std::vector<int>>(), tensor, data);
  if (pipeline > 1) return parallel::StageLayout(record.at("bounds").get<std::vector<int64_t>>(), data);
  return parallel::ShardLayout::contiguous(total, workers);
}

int64_t runs_numel(const std::vector<parallel::ShardRun>& runs) {
  int64_t n = 0;
  for (const auto& r : runs) n += r.len;
  return n;
}

int64_t shape_numel(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

// The whole flat vector of `kind` ("param", "exp_avg", "exp_avg_sq") as the old workers held it
// (`ranks`, all of one step, cut by `old`): each worker's part of its local vector, from its
// optimizer shard (ZeRO over its part's replicas) or, unsharded, every value from its part's
// first replica, put in place by the runs it held (strategy::held_of).
at::Tensor assemble(const std::vector<parallel::Checkpoint>& ranks, const strategy::SiteLayout& old,
                    const std::string& kind) {
  at::Tensor whole = at::zeros({strategy::total_of(old)}, at::kFloat);
  for (size_t q = 0; q < ranks.size(); ++q) {
    const parallel::Checkpoint& k = ranks[q];
    const std::vector<parallel::ShardRun> held = strategy::held_of(old, static_cast<int64_t>(q));
    const int64_t n = runs_numel(held);
    auto place = [&](int64_t begin, const at::Tensor& values) {  // values at local [begin, ...)
      const int64_t end = begin + values.numel();
      for (const parallel::ShardRun& r : held) {
        const int64_t lo = std::max(r.local, begin), hi = std::min(r.local + r.len, end);
        if (lo < hi) whole.narrow(0, r.flat + lo - r.local, hi - lo).copy_(values.narrow(0, lo - begin, hi - lo));
      }
    };
    const nlohmann::json shard = k.state.value("optim", nlohmann::json::object()).value("shard", nlohmann::json::object());
    if (const int64_t of = shard.value("of", int64_t{1}); of > 1) {
      const parallel::ShardLayout cut = shard.contains("units")
                                            ? parallel::ShardLayout(shard["units"].get<std::vector<int64_t>>(), of)
                                            : parallel::ShardLayout::contiguous(n, of);
      const std::string name = str_cat("optim/0/", kind);
      for (const parallel::ShardRun& r : cut.runs(shard.value("rank", int64_t{0}), 0, n))
        place(r.flat, parallel::read_range(k, name, r.local, r.len));
      continue;
    }
    if (strategy::replica_of(old, static_cast<int64_t>(q)) != 0) continue;  // its part's first replica has it all
    const auto names = k.state.at("worker").at("layout").at("trainable").get<std::vector<std::string>>();
    int64_t at = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      const std::string name = kind == "param" ? "model/" + names[i] : str_cat("optim/", i, "/", kind);
      const int64_t m = parallel::tensor_numel(k, name);
      if (m < 0) throw DataError(str_cat("checkpoint of step ", k.step, ", old worker ", q, ": no tensor '", name, "'"));
      place(at, parallel::read_range(k, name, 0, m));
      at += m;
    }
    if (at != n)
      throw DataError(str_cat("checkpoint of step ", k.step, ", old worker ", q, ": its parameters hold ", at,
                              " values, its layout ", n, ": the model changed"));
  }
  return whole;
}

// A resume onto another layout (the site's pipeline stages or tensor slices changed, or a site
// of them got another number of workers or shard mode): from the old workers' checkpoints
// (`ranks`, cut by `old`) this worker (`rank` of a site cut by `now`) takes the values it holds
// now, its optimizer's part of AdamW's moments and its part of the outer state. Each kind is
// assembled whole once (one model's worth of float32 at a time) and cut: simple, not ZeRO-3's
// range reads. Its data position, generator and tokens are the caller's.
void restore_relayout(const std::vector<parallel::Checkpoint>& ranks, const strategy::SiteLayout& old,
                      const strategy::SiteLayout& now, int rank, Task& task, parallel::InnerOptimizer& optimizer,
                      strategy::Strategy& strategy, parallel::FullShard* full) {
  // The whole model's trainable parameters by name: where each lies in the flat vector.
  std::vector<std::string> names;
  std::set<std::string> seen;
  for (const auto& k : ranks)
    for (const auto& name : k.state.at("worker").at("layout").at("trainable").get<std::vector<std::string>>())
      if (seen.insert(name).second) names.push_back(name);
  const std::vector<std::vector<int64_t>> shapes = task.trainable_shapes();
  if (names.size() != shapes.size())
    throw DataError(str_cat("checkpoint of step ", ranks[0].step, ": its workers held ", names.size(),
                            " trainable parameters, this model has ", shapes.size(), ": the model changed"));
  std::map<std::string, std::pair<int64_t, int64_t>> where;  // name: flat offset, values
  int64_t offset = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    const int64_t n = shape_numel(shapes[i]);
    where[names[i]] = {offset, n};
    offset += n;
  }
  const std::vector<at::Tensor> params = task.trainable();
  std::vector<std::vector<int64_t>> sizes;  // ZeRO-3's parameters hold no values: their shapes'
  for (size_t i = 0; i < params.size(); ++i) sizes.push_back(full ? full->shapes().at(i) : params[i].sizes().vec());
  const std::vector<parallel::ShardRun> held = strategy::held_of(now, rank);
  // This worker's values of a whole vector, one tensor per trainable parameter.
  auto mine = [&](const at::Tensor& whole) {
    std::vector<at::Tensor> out;
    const int64_t n = runs_numel(held);
    at::Tensor local = at::empty({n}, at::kFloat);
    for (const auto& r : held) local.narrow(0, r.local, r.len).copy_(whole.narrow(0, r.flat, r.len));
    int64_t at = 0;
    for (const auto& shape : sizes) {
      const int64_t m = shape_numel(shape);
      NEBULA_CHECK(at + m <= n, "the layout holds ", n, " values, the parameters more");
      out.push_back(local.narrow(0, at, m).view(shape));
      at += m;
    }
    NEBULA_CHECK(at == n, "the layout holds ", n, " values, the parameters ", at);
    return out;
  };
  parallel::Checkpoint k;  // what this worker would have written unsharded, in its layout
  k.step = ranks[0].step;
  k.state = ranks[0].state;
  const at::Tensor values = assemble(ranks, old, "param");
  std::map<const void*, std::string> name_of;
  for (const auto& item : task.module().named_parameters()) name_of[item.value().unsafeGetTensorImpl()] = item.key();
  const std::vector<at::Tensor> own = mine(values);
  for (size_t i = 0; i < params.size(); ++i) k.tensors["model/" + name_of.at(params[i].unsafeGetTensorImpl())] = own[i];
  // The rest of the model: parameters let go (a stage's of the others), a tie's copy of a whole
  // parameter, buffers (from the first old checkpoint that holds them).
  auto rest = [&](const std::string& name, const at::Tensor& t) {
    if (k.tensors.count("model/" + name)) return;
    at::Tensor& out = k.tensors["model/" + name];
    if (t.numel() == 0) {
      out = at::empty(t.sizes(), t.options());
    } else if (auto it = where.find(name); it != where.end() && it->second.second == t.numel()) {
      out = values.narrow(0, it->second.first, t.numel()).view(t.sizes());
    } else {
      for (const auto& old_k : ranks)
        if (parallel::tensor_numel(old_k, "model/" + name) == t.numel()) {
          out = parallel::read_range(old_k, "model/" + name, 0, t.numel()).to(t.scalar_type()).view(t.sizes());
          return;
        }
      throw DataError(str_cat("checkpoint of step ", k.step, ": no old worker's checkpoint holds model tensor '", name,
                              "' of ", t.numel(), " values: the model changed"));
    }
  };
  for (const auto& item : task.module().named_parameters()) rest(item.key(), item.value());
  for (const auto& item : task.module().named_buffers()) rest(item.key(), item.value());
  // AdamW: the one step count every old worker's moments share, and this worker's moments.
  const nlohmann::json optim = ranks[0].state.value("optim", nlohmann::json::object());
  const auto steps = optim.value("steps", std::vector<int64_t>{});
  const int64_t step = steps.empty() ? 0 : steps[0];
  for (const auto& old_k : ranks)
    for (int64_t s : old_k.state.value("optim", nlohmann::json::object()).value("steps", std::vector<int64_t>{}))
      if (s != step)
        throw DataError(str_cat("checkpoint of step ", k.step, ": its workers took different numbers of AdamW steps (",
                                s, " and ", step, "), so their state cannot be cut anew"));
  k.state["optim"] = {{"steps", std::vector<int64_t>(params.size(), step)}, {"shard", {{"of", 1}}}};
  if (step > 0)
    for (const char* kind : {"exp_avg", "exp_avg_sq"}) {
      const std::vector<at::Tensor> part = mine(assemble(ranks, old, kind));
      for (size_t i = 0; i < part.size(); ++i) k.tensors[str_cat("optim/", i, "/", kind)] = part[i];
    }
  load_model(k, task, full != nullptr);
  if (full) load_parameter_pieces(k, task, *full, rank);
  optimizer.load_resharded({&k});
  // The outer state: each old worker's part, cut by the layout that wrote it.
  std::vector<strategy::StrategyState> states;
  for (const auto& old_k : ranks) {
    states.push_back(strategy_state(old_k));
    if (!std::holds_alternative<parallel::ShardLayout>(old)) states.back().written = old;
  }
  strategy.load_resharded(states);
}

// Where the site's newest checkpoints came from, as rank 0's says: another number of workers
// or [parallel] shard than now means resharding, from every old rank's checkpoint; other
// pipeline stages or tensor slices (or a site of them resharded) mean cutting the model anew.
struct WrittenLayout {
  int workers = 0;
  bool shard_changed = false;
  bool relayout = false;
  bool reshard(int workers_now) const { return workers != workers_now || shard_changed || relayout; }
};

WrittenLayout written_layout(const Config& c, const WorkerIdentity& who, collective::SiteGroup& group,
                             const std::optional<parallel::Checkpoint>& newest, const parallel::InnerOptimizer& optimizer) {
  const SiteConfig& site = c.sites.at(who.site);
  const int workers = static_cast<int>(site.workers);
  // [old workers, 1 if the shard mode changed, 1 if the stages or slices did]
  at::Tensor layout = at::zeros({3}, at::kFloat);
  layout[0] = static_cast<float>(workers);
  if (who.local_rank == 0 && newest) {
    const auto& w = newest->state.value("worker", nlohmann::json::object());
    const int old_workers = w.value("workers", workers);
    layout[0] = static_cast<float>(old_workers);
    // The shard mode, or the units its shards were cut into (parallel/shard_layout.h: ZeRO-3's
    // layout changed with the model's layers, or a checkpoint from before ZeRO-3 cut by layer).
    const auto& shard = newest->state.value("optim", nlohmann::json::object()).value("shard", nlohmann::json::object());
    const std::vector<int64_t> whole{0, optimizer.total_numel()};
    const bool units_changed = optimizer.sharded() && shard.value("of", 1) > 1 &&
                               shard.value("units", whole) != optimizer.layout().bounds();
    const bool shard_changed = w.value("shard", c.parallel.shard) != c.parallel.shard || units_changed;
    layout[1] = shard_changed ? 1.0f : 0.0f;
    const parallel::SiteGrid grid = site_grid(c, site);
    const int64_t pipeline = w.value("pipeline", int64_t{1}), tensor = w.value("tensor", int64_t{1});
    const bool cut = pipeline > 1 || tensor > 1 || grid.pipeline > 1 || grid.tensor > 1;
    layout[2] = pipeline != grid.pipeline || tensor != grid.tensor ||
                        (cut && (old_workers != workers || shard_changed)) ? 1.0f : 0.0f;
  }
  if (workers > 1) group.broadcast_from_root(layout);
  return {static_cast<int>(layout[0].item<float>()), layout[1].item<float>() > 0, layout[2].item<float>() > 0};
}

}  // namespace

WorkerCheckpoints::WorkerCheckpoints(const Config& config, const WorkerIdentity& who, collective::Hierarchy& comm,
                                     Task& task, parallel::InnerOptimizer& optimizer, strategy::Strategy& strategy,
                                     parallel::FullShard* full, strategy::SiteLayout layout, bool outer_per_part)
    : c_(config), who_(who), comm_(comm), task_(task), optimizer_(optimizer), strategy_(strategy), full_(full),
      layout_(std::move(layout)), outer_per_part_(outer_per_part), dir_(rank_dir(who.local_rank)),
      fingerprint_(training_fingerprint(config)) {}

std::string WorkerCheckpoints::rank_dir(int rank) const {
  return str_cat(c_.checkpoint.dir, "/", c_.sites.at(who_.site).name, "/rank-", rank);
}

void WorkerCheckpoints::save(const WorkerProgress& progress) {
  const SiteConfig& site = c_.sites.at(who_.site);
  auto save = [&] {
    parallel::Checkpoint k = capture(progress.step, task_, optimizer_, strategy_);
    k.state["worker"] = {{"tokens", progress.tokens}, {"eval_start", progress.eval_start}, {"site", site.name},
                         {"rank", who_.local_rank},   {"workers", site.workers},           {"shard", c_.parallel.shard},
                         {"pipeline", site_grid(c_, site).pipeline}, {"tensor", site_grid(c_, site).tensor},
                         {"layout", layout_record(layout_, task_)}};
    parallel::save_checkpoint(dir_, k, fingerprint_, static_cast<int>(c_.checkpoint.keep));
  };
  // Sharded, each rank saves its shard of the trainable parameters: ZeRO-3 gathers nothing.
  if (optimizer_.sharded())
    save();
  else
    parallel::with_whole_model(full_, save);
  spdlog::info("checkpoint of step {} written to {}", progress.step, dir_);
}

void WorkerCheckpoints::restore_relaid(std::vector<parallel::Checkpoint>& ranks, int64_t target) {
  const strategy::SiteLayout old = written_site_layout(ranks.at(0), task_.trainable_shapes(), strategy::total_of(layout_));
  const int rank = who_.local_rank;
  restore_relayout(ranks, old, layout_, rank, task_, optimizer_, strategy_, full_);
  // With as many data replicas as before, each continues its replica's data position and
  // generator (its first worker's: a stage's or slice's all read the same batches), and the
  // replica's first worker its tokens; else the site's data is partitioned anew, every
  // position starts over and rank 0 carries the site's tokens.
  const int64_t replicas = strategy::replicas_of(layout_), replica = strategy::replica_of(layout_, rank);
  const bool same = strategy::replicas_of(old) == replicas;
  int64_t so_far = 0;
  for (size_t q = 0; q < ranks.size(); ++q) {
    const auto qq = static_cast<int64_t>(q);
    const int64_t tokens = ranks[q].state.value("worker", nlohmann::json::object()).value("tokens", int64_t{0});
    if (same ? strategy::replica_of(old, qq) == replica && strategy::holding_of(layout_, rank) == 0 : rank == 0)
      so_far += tokens;
    if (same && strategy::replica_of(old, qq) == replica && strategy::holding_of(old, qq) == 0) {
      parallel::load_torch_rng(ranks[q]);
      task_.load_state(ranks[q]);
    }
  }
  if (!same && static_cast<size_t>(rank) < ranks.size()) parallel::load_torch_rng(ranks[static_cast<size_t>(rank)]);
  ranks[0].state["worker"]["tokens"] = so_far;
  auto describe = [](const strategy::SiteLayout& l) {
    if (const auto* st = std::get_if<parallel::StageLayout>(&l)) return str_cat(st->stages(), " pipeline stages × ", st->data());
    if (const auto* sl = std::get_if<parallel::SliceLayout>(&l)) return str_cat(sl->slices(), " tensor slices × ", sl->data());
    const int64_t n = strategy::workers_of(l);
    return str_cat(n, n == 1 ? " worker" : " workers");
  };
  spdlog::info("cut the checkpoint of step {} written by {} anew for {}{}", target, describe(old), describe(layout_),
               same ? " (each data replica continues its position)"
                    : " (the site's data is partitioned anew: each worker's position starts over)");
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
  // Pipeline stages and tensor slices: each worker's checkpoint holds its own part and says how
  // (layout_record); another cut takes each worker's values from the old parts. Not when the
  // outer optimizer's state is per stage or slice (a one-site job's), nor from a checkpoint
  // that does not say.
  const parallel::SiteGrid grid = site_grid(c_, site);
  if (layout.relayout && newest) {
    const auto& w = newest->state.value("worker", nlohmann::json::object());
    const int64_t old_pipeline = w.value("pipeline", int64_t{1}), old_tensor = w.value("tensor", int64_t{1});
    const auto strings = newest->state.value("strategy", nlohmann::json::object()).value("strings", nlohmann::json::object());
    const bool old_cut = old_pipeline > 1 || old_tensor > 1;
    const std::string why =
        old_cut && !w.contains("layout")
            ? "its checkpoints do not record how their workers held the model (written by an older nebula)"
        : outer_per_part_ || (old_cut && c_.strategy.kind != "sync" && !strings.contains("stages") && !strings.contains("slices"))
            ? str_cat("a one-site job's stages or slices keep strategy.kind = \"", c_.strategy.kind,
                      "\"'s outer state per stage or slice, which cannot be cut anew")
            : "";
    auto key = [&](int64_t own, const char* name) {
      return str_cat(own > 0 ? str_cat("sites[", who_.site, "].") : std::string(), "parallel.", name);
    };
    if (!why.empty())
      throw ConfigError(str_cat(dir_, ": the checkpoint was written by ", old_workers, " workers in ", old_pipeline,
                                " pipeline stage(s) × ", old_tensor, " tensor slice(s) per replica; this run has ", workers,
                                " in ", grid.pipeline, " × ", grid.tensor, ", and ", why, ": resume with ",
                                key(site.pipeline, "pipeline"), " = ", old_pipeline, ", ", key(site.tensor, "tensor"), " = ",
                                old_tensor, " and the site's ", old_workers, " workers"));
  }
  // Resharding leaves the sharded state in the old files, to read by range; so does ZeRO-3 the
  // trainable parameters of a checkpoint that holds them whole (load_parameter_pieces).
  std::set<std::string> pieces_of;
  if (full_)
    for (const std::string& name : trainable_names(task_)) pieces_of.insert(name);
  // Another cut reads every old worker's parameters by range too.
  auto unread = [&](const std::string& name) {
    return sharded_state(name) || pieces_of.count(name) > 0 || (layout.relayout && name.rfind("model/", 0) == 0);
  };
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
    if (layout.relayout) {
      restore_relaid(ranks, target);
    } else {
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
      ranks[0].state["worker"]["tokens"] = so_far;
      spdlog::info("resharded the checkpoint of step {} from {} workers onto {}{}", target, old_workers, workers,
                   old_workers == workers ? "" : " (the site's data is partitioned anew: each worker's position starts over)");
    }
    olds.clear();
    newest = std::move(ranks[0]);
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
