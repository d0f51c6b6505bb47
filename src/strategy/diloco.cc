#include "strategy/diloco.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: ATen.h no longer brings it in LibTorch 2.x
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <variant>

#include "nebula/error.h"
#include "strategy/controller.h"
#include "strategy/replica_check.h"
#include "util/allocator.h"

namespace nebula::strategy {

namespace {
// What each site attaches to an exchange: kSiteInfo values (round_planner.h), then the outer
// step id and the global hash (replica_check.h).
constexpr size_t kInfo = kSiteInfo;
constexpr uint64_t kTagBase = 1000;  // exchange tags: kTagBase + fragment
using Clock = std::chrono::steady_clock;
}  // namespace

DilocoOptions DilocoOptions::from(const StrategyConfig& c, std::chrono::milliseconds timeout, size_t num_sites,
                                  size_t site_index) {
  DilocoOptions o;
  o.num_sites = num_sites;
  o.site_index = site_index;
  o.name = c.kind;
  o.inner_steps = c.inner_steps;
  o.outer_lr = c.outer_lr;
  o.outer_momentum = c.outer_momentum;
  o.nesterov = c.outer_nesterov;
  o.fragments = c.kind == "streaming" ? c.fragments : 1;
  o.delay = c.kind == "streaming" ? c.delay : 0;
  o.staging_bytes = c.kind == "diloco" ? c.staging_bytes : 0;
  o.heterogeneous = c.heterogeneous;
  o.adaptive = c.adaptive;
  o.codec = c.codec;
  o.codec_options = wan_codec_options(c);
  o.timeout = timeout;
  o.max_update_norm = c.max_update_norm;
  o.max_loss_penalty = c.max_loss_penalty;
  return o;
}

DilocoStrategy::DilocoStrategy(collective::Hierarchy& comm, DilocoOptions options)
    : comm_(comm),
      options_(std::move(options)),
      outer_({options_.outer_lr, options_.outer_momentum, options_.nesterov}),
      dp_rng_(std::random_device{}()) {
  NEBULA_CHECK(options_.num_sites >= 1 && options_.site_index < options_.num_sites, "site ", options_.site_index,
               " of ", options_.num_sites);
  NEBULA_CHECK(options_.inner_steps >= 0 && options_.fragments >= 1 && options_.delay >= 0, "inner_steps ",
               options_.inner_steps, " fragments ", options_.fragments, " delay ", options_.delay);
  if (options_.codec != "auto") set_codec(options_.codec);
}

DilocoStrategy::~DilocoStrategy() {
  // Exchanges still queued hold pointers into this object's tensors and codecs.
  for (auto& f : fragments_)
    if (f.work) try {
        f.work->wait(Deadline::after(options_.timeout));
      } catch (...) {
      }
}

void DilocoStrategy::set_codec(const std::string& kind) {
  codec::CodecOptions o = options_.codec_options;
  o.kind = kind;
  // A codec in use by an exchange in flight must outlive it: retired ones are kept.
  if (codec_) retired_.push_back(std::move(codec_));
  codec_ = kind == "none" ? nullptr : codec::make_codec(o);
  codec_kind_ = kind;
}

std::vector<at::Tensor> DilocoStrategy::param_views(const Fragment& fr) const {
  NEBULA_CHECK(!staged(), "param_views on a pipeline stage: its parameters are the stage's, not the model's");
  std::vector<at::Tensor> views;
  for (const Piece& pc : fr.pieces) views.push_back(params_[pc.param].view({-1}).narrow(0, pc.at, pc.numel));
  return views;
}

at::Tensor DilocoStrategy::read_params(const Fragment& fr) const { return flatten(param_views(fr)); }

at::Tensor DilocoStrategy::read_range(const Fragment& fr, int64_t begin, int64_t len) const {
  at::Tensor out = at::empty({len}, at::kFloat);
  int64_t pos = 0;
  for (const auto& v : param_views(fr)) {  // piece by piece: no copy of the rest
    const int64_t lo = std::max(begin, pos), hi = std::min(begin + len, pos + v.numel());
    if (lo < hi) out.narrow(0, lo - begin, hi - lo).copy_(v.narrow(0, lo - pos, hi - lo));
    pos += v.numel();
  }
  return out;
}

void DilocoStrategy::write_params(const Fragment& fr, const at::Tensor& flat) const {
  unflatten_into(flat, param_views(fr));
}

std::vector<at::Tensor> DilocoStrategy::stage_views(int64_t local, int64_t len) const {
  std::vector<at::Tensor> views;
  int64_t pos = 0;
  for (const auto& p : params_) {  // the stage's parameters in order: its values one after another
    const int64_t lo = std::max(local, pos), hi = std::min(local + len, pos + p.numel());
    if (lo < hi) views.push_back(p.view({-1}).narrow(0, lo - pos, hi - lo));
    pos += p.numel();
  }
  return views;
}

std::pair<int64_t, int64_t> DilocoStrategy::stage_span(const Fragment& fr) const {
  const auto& layout = std::get<parallel::StageLayout>(layouts_.at(options_.site_index));
  const int64_t s = layout.stage_of(comm_.site().rank()), begin = layout.stage_begin(s), n = layout.stage_numel(s);
  return {std::clamp(fr.offset - begin, int64_t{0}, n), std::clamp(fr.offset + fr.numel - begin, int64_t{0}, n)};
}

std::vector<at::Tensor> DilocoStrategy::part_views(const Fragment& fr) const {
  if (staged() && fr.part_len == 0) return {at::empty({0}, at::kFloat)};
  if (staged() && shard_numel_ == 0) {  // the stage's parameters, by index among its values
    std::vector<at::Tensor> views;
    for (const parallel::ShardRun& r : fr.part)
      for (at::Tensor& v : stage_views(r.local, r.len)) views.push_back(std::move(v));
    return views;
  }
  if (shard_numel_ == 0) return param_views(fr);
  if (fr.part_len == 0) return {flat_params_.narrow(0, 0, 0)};  // ZeRO-3: the part may lie past this worker's shard
  std::vector<at::Tensor> views;  // ZeRO-1/2: flat_params_ is the whole flat vector; ZeRO-3: this worker's shard
  for (const parallel::ShardRun& r : fr.part)  // a stage's ZeRO-1/2: flat_params_ is the stage's values
    views.push_back(flat_params_.narrow(0, gathered_ && !staged() ? r.flat : r.local, r.len));
  return views;
}

parallel::ShardLayout DilocoStrategy::site_layout(int64_t workers) const {
  return unit_bounds_.empty() ? parallel::ShardLayout::contiguous(total_numel_, workers)
                              : parallel::ShardLayout(unit_bounds_, workers);
}

SiteLayout DilocoStrategy::layout_of(size_t site) const {
  if (!layouts_.empty() && !std::holds_alternative<parallel::ShardLayout>(layouts_.at(site))) return layouts_[site];
  return site_layout(site == options_.site_index ? comm_.site().size() : comm_.workers_per_site().at(site));
}

std::vector<std::vector<parallel::ShardRun>> DilocoStrategy::site_parts(const Fragment& fr) const {
  return parts_of(fr.range(), layout_of(options_.site_index));
}

std::vector<int64_t> DilocoStrategy::part_counts(const Fragment& fr) const { return counts_of(site_parts(fr)); }

void DilocoStrategy::copy_runs(const std::vector<std::vector<parallel::ShardRun>>& parts, int64_t offset,
                               const at::Tensor& whole, const at::Tensor& joined, bool to_whole) {
  int64_t at = 0;
  for (const auto& runs : parts)
    for (const parallel::ShardRun& r : runs) {
      at::Tensor w = whole.narrow(0, r.flat - offset, r.len), j = joined.narrow(0, at, r.len);
      (to_whole ? w : j).copy_(to_whole ? j : w);
      at += r.len;
    }
}

at::Tensor DilocoStrategy::take_part(const Fragment& fr, const at::Tensor& whole) const {
  at::Tensor out = at::empty({fr.part_len}, at::kFloat);
  copy_runs({fr.part}, fr.offset, whole, out, false);
  return out;
}

void DilocoStrategy::gather_to_gateway(const Fragment& fr, const at::Tensor& part, const at::Tensor& whole) {
  const auto parts = site_parts(fr);
  collective::SiteGroup& site = comm_.site();
  if (in_rank_order(parts)) return site.gather_parts_to_root(part, whole, counts_of(parts));
  // ZeRO-3's units: each rank's part arrives (one at a time, through one buffer of a part's
  // size) and is put where its runs lie.
  site.gather_parts_each(part, counts_of(parts), [&](int rank, const at::Tensor& values) {
    copy_runs({parts[static_cast<size_t>(rank)]}, fr.offset, whole, values, true);
  });
}

void DilocoStrategy::scatter_from_gateway(const Fragment& fr, const at::Tensor& whole, const at::Tensor& part) {
  const auto parts = site_parts(fr);
  collective::SiteGroup& site = comm_.site();
  if (in_rank_order(parts)) return site.scatter_parts_from_root(whole, part, counts_of(parts));
  site.scatter_parts_each(part, counts_of(parts), [&](int rank, const at::Tensor& values) {
    copy_runs({parts[static_cast<size_t>(rank)]}, fr.offset, whole, values, false);
  });
}

void DilocoStrategy::spread_part(const Fragment& fr) {
  if (const parallel::SliceLayout* sl = slices()) {
    const int64_t t = sl->slice_of_rank(comm_.site().rank());
    auto refresh = [&](const std::vector<parallel::ShardRun>& runs, const std::function<void(at::Tensor&)>& collective) {
      std::vector<at::Tensor> views;
      for (const parallel::ShardRun& r : runs)
        for (at::Tensor& v : stage_views(r.local, r.len)) views.push_back(std::move(v));
      at::Tensor values = flatten(views);
      collective(values);
      unflatten_into(values, views);
    };
    // The slice's replicas all-gather their pieces of what it owns of fr ...
    std::vector<int64_t> counts;
    for (int64_t q = 0; q < sl->data(); ++q)
      counts.push_back(counts_of({sl->runs(q * sl->slices() + t, fr.offset, fr.numel)})[0]);
    if (sl->data() > 1 && std::accumulate(counts.begin(), counts.end(), int64_t{0}) > 0)
      refresh(sl->owned_runs(t, fr.offset, fr.numel), [&](at::Tensor& v) { stage_group_->all_gather_parts(v, counts); });
    // ... then slice 0 gives the others the whole parameters (the same positions on every slice).
    const auto whole = sl->whole_runs(t, fr.offset, fr.numel);
    if (sl->slices() > 1 && !whole.empty()) refresh(whole, [&](at::Tensor& v) { tensor_group_->broadcast_from_root(v); });
    return;
  }
  if (staged()) {  // the stage's replicas all-gather their pieces of the stage's values of fr
    const auto [lo, hi] = stage_span(fr);
    const int64_t d = stage_group_->size(), first = comm_.site().rank() / d * d;
    if (d == 1 || lo == hi) return;
    const auto parts = site_parts(fr);
    std::vector<int64_t> counts;
    for (int64_t q = 0; q < d; ++q) counts.push_back(counts_of({parts.at(static_cast<size_t>(first + q))})[0]);
    if (shard_numel_ > 0) return stage_group_->all_gather_parts(flat_params_.narrow(0, lo, hi - lo), counts);
    at::Tensor values = flatten(stage_views(lo, hi - lo));
    stage_group_->all_gather_parts(values, counts);
    unflatten_into(values, stage_views(lo, hi - lo));
    return;
  }
  // ZeRO-3 keeps the parameters sharded: its layers gather them when they run.
  if (shard_numel_ > 0 && gathered_)
    comm_.site().all_gather_parts(flat_params_.narrow(0, fr.offset, fr.numel), part_counts(fr));
}

void DilocoStrategy::with_global_weights(const std::function<void()>& fn) {
  at::NoGradGuard no_grad;
  if (staged()) {  // each worker writes its piece, the stage's replicas all-gather; the stage's own values back after
    const at::Tensor local = flatten(params_);
    for (const Fragment& fr : fragments_) {
      write_part(fr, fr.global);
      spread_part(fr);
    }
    try {
      fn();
    } catch (...) {
      unflatten_into(local, params_);
      throw;
    }
    unflatten_into(local, params_);
    return;
  }
  // Sharded, each worker writes its shard of θ_global and the site all-gathers (and again to
  // put the replica back; ZeRO-3 gathers where the model runs); else every worker writes all of it.
  const bool sharded = shard_numel_ > 0;
  at::Tensor shard = !sharded   ? at::Tensor()
                     : gathered_ ? flat_params_.narrow(0, comm_.site().rank() * shard_numel_, shard_numel_)
                                 : flat_params_;
  std::vector<at::Tensor> local;
  if (sharded) local.push_back(shard.clone());
  for (const Fragment& fr : fragments_) {
    if (!sharded) local.push_back(read_params(fr));
    write_part(fr, fr.global);
  }
  if (sharded && gathered_) comm_.site().all_gather(shard, flat_params_);
  auto restore = [&] {
    if (!sharded) {
      for (size_t f = 0; f < fragments_.size(); ++f) write_params(fragments_[f], local[f]);
      return;
    }
    shard.copy_(local[0]);
    if (gathered_) comm_.site().all_gather(shard, flat_params_);
  };
  try {
    fn();
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

void DilocoStrategy::init(const std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i)
    NEBULA_CHECK(params[i].is_contiguous(), "parameter #", i, " of shape ", params[i].sizes(),
                 " is not contiguous: fragments are ranges of the flat parameter vector; make it contiguous");
  if (!layouts_.empty()) {  // sites of different layouts: no worker holds all to send
    params_ = params;
    const SiteLayout& mine = layouts_.at(options_.site_index);
    const int64_t whole = total_of(mine);
    const int64_t rank = comm_.site().rank();
    int64_t want = whole;
    if (const auto* stages = std::get_if<parallel::StageLayout>(&mine)) want = stages->stage_numel(stages->stage_of(rank));
    if (const auto* sl = std::get_if<parallel::SliceLayout>(&mine)) want = sl->held(sl->slice_of_rank(rank));
    NEBULA_CHECK(held_numel() == want, "init: ", held_numel(), " parameter values on this worker, its site's layout "
                 "gives it ", want, " (of the model's ", whole, ")");
    init_fragments(layout_shapes_, [&](const Fragment& fr, const parallel::ShardRun& r) {
      return staged() ? flatten(stage_views(r.local, r.len)) : read_range(fr, r.flat - fr.offset, r.len);
    });
    check_initial_weights("the sites hold the model in different layouts ([[sites]] parallel), so none holds a "
                          "whole copy to send");
    return;
  }
  std::vector<at::Tensor> state = params;
  state.insert(state.end(), buffers_.begin(), buffers_.end());
  make_replicas_equal(comm_, state);
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : params) shapes.push_back(p.sizes().vec());
  params_ = params;
  // Sharded (expect_sharding): only this worker's part, its runs of the fragment in the site's
  // layout, read straight from the parameters; set_sharding() checks it against the layout.
  init_fragments(shapes, [&](const Fragment& fr, const parallel::ShardRun& r) {
    return read_range(fr, r.flat - fr.offset, r.len);
  });
}

void DilocoStrategy::init_from_shard(const std::vector<at::Tensor>& params,
                                     const std::vector<std::vector<int64_t>>& shapes, const at::Tensor& shard) {
  at::NoGradGuard no_grad;
  NEBULA_CHECK(params.size() == shapes.size() && shard.dim() == 1 && shard.scalar_type() == at::kFloat &&
                   !unit_bounds_.empty(),
               "init_from_shard: ", params.size(), " parameters, ", shapes.size(), " shapes, a shard of ",
               shard.sizes(), " (want one shape per parameter, 1-D float32, set_unit_bounds first)");
  make_replicas_equal(comm_, buffers_);  // the buffers are whole, as init() makes them equal
  params_ = params;
  const bool sharded = comm_.site().size() > 1;
  NEBULA_CHECK(sharded == expect_sharding_, "init_from_shard on a site of ", comm_.site().size(),
               " workers: expect_sharding() exactly when the site has more than one");
  // The parts as in init(): a worker's runs lie at their local offsets in its shard; a site of
  // one worker holds the flat vector itself.
  init_fragments(shapes, [&](const Fragment&, const parallel::ShardRun& r) {
    return shard.narrow(0, sharded ? r.local : r.flat, r.len);
  });
  check_initial_weights("with parallel.shard = \"full\" each worker builds only its pieces of the model and none "
                        "holds a whole copy to send");
}

void DilocoStrategy::check_initial_weights(const std::string& why) {
  // Every site built its replica from the same seed: the whole θ_global's CRC (taken over the
  // site's pieces in flat order, whatever its layout) must be global rank 0's. Nothing can put
  // it right from here (the pieces are all there is), so a difference is an error.
  const double hash = global_hash(fragments_.size());
  if (!replicas_agree(comm_, static_cast<uint32_t>(hash), comm_.is_gateway()))
    throw Error(str_cat("site '", comm_.site().site(), "' (site #", options_.site_index,
                        "): the initial weights differ between sites (CRC of this site's ", total_numel_,
                        " values: ", static_cast<uint32_t>(hash), "); ", why,
                        ": give every site the same job.seed, model and model.init"));
}

void DilocoStrategy::set_layouts(Layouts layouts) {
  NEBULA_CHECK(fragments_.empty(), "set_layouts after init()");
  NEBULA_CHECK(layouts.sites.size() == options_.num_sites, "set_layouts: ", layouts.sites.size(),
               " sites' layouts for a job of ", options_.num_sites);
  const SiteLayout& mine = layouts.sites[options_.site_index];
  NEBULA_CHECK(workers_of(mine) == comm_.site().size(), "set_layouts: this site's layout has ", workers_of(mine),
               " workers, the site ", comm_.site().size());
  if (const auto* stages = std::get_if<parallel::StageLayout>(&mine)) {
    NEBULA_CHECK(layouts.stage && layouts.stage->size() == stages->data(), "set_layouts: a staged site's worker needs "
                 "the group of its stage's ", stages->data(), " replicas");
    NEBULA_CHECK(buffers_.empty(), "a pipeline stage's model buffers in a job of several sites are not kept equal yet "
                 "(each stage holds its own): use a model without buffers or pipeline = 1");
    stage_group_ = layouts.stage;
  }
  if (const auto* sl = std::get_if<parallel::SliceLayout>(&mine)) {
    NEBULA_CHECK(layouts.stage && layouts.stage->size() == sl->data(), "set_layouts: a sliced site's worker needs "
                 "the group of its slice's ", sl->data(), " replicas");
    NEBULA_CHECK(layouts.tensor && layouts.tensor->size() == sl->slices(), "set_layouts: a sliced site's worker "
                 "needs the group of its replica's ", sl->slices(), " slices");
    NEBULA_CHECK(buffers_.empty(), "a tensor slice's model buffers in a job of several sites are not kept equal yet: "
                 "use a model without buffers or tensor = 1");
    stage_group_ = layouts.stage;
    tensor_group_ = layouts.tensor;
  }
  layouts_ = std::move(layouts.sites);
  layout_shapes_ = std::move(layouts.shapes);
}

void DilocoStrategy::init_fragments(const std::vector<std::vector<int64_t>>& shapes, const PartReader& read) {
  total_numel_ = 0;
  for (const auto& shape : shapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    total_numel_ += n;
  }
  buffer_numel_ = 0;
  for (const auto& b : buffers_) buffer_numel_ += b.numel();
  if (buffer_numel_ > 0 && options_.dp_clip > 0 && comm_.is_gateway())
    spdlog::warn("[privacy]: the model's {} buffer values (e.g. BatchNorm statistics) are statistics of this site's "
                 "data; they stay inside the site (averaged over its workers), each site keeps its own",
                 buffer_numel_);

  // Fragments: F ranges of the flat parameter vector, cut between rows (fragment_schedule.h).
  // Streaming's are the user's F; diloco's in gateway mode as many as keep each within
  // staging_bytes (the gateway stages one fragment's pseudo-gradient and payloads, not the model's).
  const int64_t total = total_numel_;
  int64_t count = options_.fragments;
  together_ = false;
  const auto staging = static_cast<int64_t>(options_.staging_bytes / sizeof(float));
  if (staging > 0 && !comm_.every_worker() && total > staging) {
    if (options_.dp_clip > 0) {
      if (comm_.is_gateway())
        spdlog::warn("[privacy]: the gateway clips the site's whole update, so it stages all {} values of the outer "
                     "step at once (strategy.staging applies without [privacy])",
                     total);
    } else {
      count = (total + staging - 1) / staging;
      together_ = true;
    }
  }
  std::vector<FragmentCut> cuts = cut_fragments(shapes, count);
  if (static_cast<int64_t>(cuts.size()) != count)
    spdlog::warn("{} fragments but the model has {} values: using {}", count, total, cuts.size());
  fragments_.assign(cuts.size(), Fragment{});
  // What each round's plan rests on besides the measurements (start_round).
  planner_.codec = options_.codec;
  planner_.inner_steps = options_.inner_steps;
  planner_.adaptive = options_.adaptive;
  planner_.heterogeneous = options_.heterogeneous;
  planner_.codec_options = options_.codec_options;
  planner_.outer_momentum = options_.outer_momentum;
  planner_.max_loss_penalty = options_.max_loss_penalty;
  planner_.site_index = options_.site_index;
  planner_.params = total_numel_;
  planner_.fragments = together_ ? 1 : static_cast<int64_t>(cuts.size());  // the controller's exchange: all of them
  planner_.delay = options_.delay;
  for (size_t j = 0; j < cuts.size(); ++j) {
    static_cast<FragmentCut&>(fragments_[j]) = std::move(cuts[j]);
    fragments_[j].part = {{fragments_[j].offset, 0, fragments_[j].numel}};
    fragments_[j].part_len = fragments_[j].numel;
  }
  const int64_t n = comm_.site().size(), rank = comm_.site().rank();
  const bool sharded = (expect_sharding_ && n > 1) || staged();
  parted_ = sharded;
  for (Fragment& fr : fragments_) {
    if (sharded) {
      fr.part = site_parts(fr).at(static_cast<size_t>(rank));
      fr.part_len = counts_of({fr.part})[0];
    }
    fr.global = at::empty({fr.part_len}, at::kFloat);
    int64_t at = 0;
    for (const auto& r : fr.part) {  // run by run: no copy of the rest
      fr.global.narrow(0, at, r.len).copy_(read(fr, r));
      at += r.len;
    }
    fr.momentum = at::zeros({fr.part_len}, at::kFloat);
  }
  last_step_end_ = Clock::now();
}

bool DilocoStrategy::keep_training(int64_t /*step*/, int64_t steps) {
  if (!round_open_) {
    if (nominal_done_ >= steps) return false;
    start_round(steps);
    if (joiners_due_) welcome();
  }
  return true;
}

void DilocoStrategy::start_round(int64_t steps) {
  const RoundPlan plan = plan_round(
      planner_, {known_info(info_of_round_, rounds_, options_.delay), rounds_, steps, nominal_done_, round_steps_, codec_kind_},
      controller_);
  for (const std::string* line : {&plan.controller_line, &plan.steps_line}) {
    if (line->empty()) continue;
    decisions_.push_back(*line);
    if (comm_.is_gateway()) {
      if (line == &plan.controller_line)
        spdlog::info("controller: {}", *line);
      else
        spdlog::info("{}", *line);
    }
  }
  if (plan.codec != codec_kind_) set_codec(plan.codec);
  nominal_h_ = plan.nominal_h;
  round_steps_ = plan.round_steps;
  in_round_ = 0;
  next_fragment_ = 0;
  round_open_ = true;
  compute_seconds_ = 0;
  timed_steps_ = 0;
}

std::vector<double> DilocoStrategy::site_info() const {
  std::vector<double> info(kInfo, 0.0);
  info[0] = timed_steps_ > 0 ? compute_seconds_ / static_cast<double>(timed_steps_) : 0.0;
  if (options_.assumed_step_seconds > 0) info[0] = options_.assumed_step_seconds;
  SlowestPath path;
  for (const auto& e : comm_.stats().links) {
    path.add(e.bandwidth_bits_per_s, e.bandwidth_at_least);
    info[2] = std::max(info[2], e.rtt_s);
  }
  info[1] = path.bits_per_s;
  info[6] = path.at_least ? 1.0 : 0.0;
  // The link estimates time the transfer alone (transport/resilient_link.h, "Estimates"); an
  // exchange's own bytes / time would count the wait for a slower site as transfer time.
  // Before the first exchange they rest on handshakes and heartbeats alone, frames too small
  // to fill the path: report unknown until then.
  if (options_.assumed_bits_per_s > 0) {
    info[1] = options_.assumed_bits_per_s;
    info[6] = 0.0;
  }
  if (exchange_bits_per_s_ <= 0) info[1] = info[6] = 0.0;
  info[3] = 1.0 + static_cast<double>(comm_.ready_joiners());
  info[4] = merge_gap_.gap();
  info[5] = merge_gap_.reduction();
  info[7] = static_cast<double>(merge_gap_.count());
  return info;
}

void DilocoStrategy::after_step(int64_t /*step*/) {
  NEBULA_CHECK(round_open_, "after_step outside a round: call keep_training before each step");
  const auto now = Clock::now();
  compute_seconds_ += std::chrono::duration<double>(now - last_step_end_).count();
  ++timed_steps_;
  ++local_step_;
  ++in_round_;
  // Fragment j goes at the end of slot j of the round (sent together: all at its end). What is
  // due merges before the next send, all but the fragment just sent, whose exchange overlaps
  // the next one's gathering: at most two fragments' exchanges are staged at once.
  auto due_now = [&](size_t j) {
    return together_ ? in_round_ >= round_steps_ : fragment_due(j, in_round_, round_steps_, fragments_.size());
  };
  while (next_fragment_ < fragments_.size() && due_now(next_fragment_)) {
    const size_t sent = next_fragment_++;
    send(sent);
    for (size_t due; (due = next_merge(fragments_, local_step_)) < fragments_.size() && due != sent;) merge(due);
  }
  if (next_fragment_ == fragments_.size()) {
    // Watching quality (diloco, delay 0): this round's exchange merges below, within this step.
    // Measured whenever the round merges at once (plain numbers), so a fixed setting's gap is in
    // the metrics too; the controller acts on it only with max_loss_penalty.
    if (options_.max_loss_penalty > 0 || (options_.delay == 0 && (together_ || fragments_.size() == 1)))
      merge_gap_.merged(setting_reduction(codec_kind_, nominal_h_, total_numel_, options_.codec_options));
    nominal_done_ += nominal_h_;
    ++rounds_;
    round_open_ = false;
  }
  // Merge, in the order sent, what is due.
  for (size_t due; (due = next_merge(fragments_, local_step_)) < fragments_.size();) merge(due);
  last_step_end_ = Clock::now();
  outer_sync_seconds_ += std::chrono::duration<double>(last_step_end_ - now).count();
}

void DilocoStrategy::send(size_t f) {
  Fragment& fr = fragments_[f];
  if (fr.in_flight) merge(f);  // a round shorter than the delay: merge before sending again
  at::NoGradGuard no_grad;
  release_free_memory();  // the step's activations, before the exchange's fragment-sized buffers
  // θ_local at the send is needed at the merge only if training goes on in between (delay > 0).
  if (options_.delay > 0) fr.sent_local = read_part(fr);
  fr.round = rounds_;
  fr.seq = next_seq_++;
  // Heterogeneous sites (FedNova, Wang et al. 2020): a site that ran H_s inner steps where the
  // slowest ran H sends its pseudo-gradient and its weight (tokens) scaled by H / H_s, so that
  // the merged update is H · Σ b_s (Δ_s / H_s) / Σ b_s, b_s the site's tokens per step: each
  // site's update per step, weighted by its batch, times the round's H (FedNova with
  // τ_eff = H). A faster site's extra steps sharpen its direction but no longer weigh twice (in
  // its update's size and in its token count), and the update is no larger than a round of H
  // steps of equal sites, for which the outer learning rate was set. Equal sites: scale 1.
  const double scale = round_steps_ > nominal_h_ && nominal_h_ > 0
                           ? static_cast<double>(nominal_h_) / static_cast<double>(round_steps_)
                           : 1.0;
  const double weight = (site_weight_ - fr.weight_at_send) * scale;
  fr.weight_at_send = site_weight_;
  const double hash = global_hash(f);  // of θ_global at the send, unchanged until the merge
  if (comm_.every_worker()) {
    send_own_part(fr, weight, scale, hash);
  } else {
    send_through_gateway(fr, weight, scale, hash);
  }
  if (f + 1 == fragments_.size() && buffers_cross_sites()) {
    // The buffers go with the round's last fragment (exactly, weighted like it) and are merged with it.
    buffers_sent_ = flatten(buffers_);
    if (comm_.is_gateway()) {
      buffer_mean_ = buffers_sent_.clone();
      collective::AllreduceOptions o;
      o.op = collective::ReduceOp::kWeightedMean;
      o.weight = weight;
      o.tag = kTagBase - 1;
      buffer_work_ = comm_.exchange_async({buffer_mean_}, std::move(o));
    }
  }
  fr.in_flight = true;
  fr.merge_at = local_step_ + options_.delay;
}

// The pseudo-gradient θ_global - θ_local of this worker's part, written where it goes (no
// other copy of θ_local): the gateway's part of fr.delta. Sharded, the gateway gathers the
// other workers' parts into the rest of it, and alone sends the whole.
void DilocoStrategy::send_through_gateway(Fragment& fr, double weight, double scale, double hash) {
  const size_t f = static_cast<size_t>(&fr - fragments_.data());
  const bool sharded = parted();
  at::Tensor part;
  if (comm_.is_gateway()) fr.delta = at::empty({fr.numel}, at::kFloat);
  if (sharded)
    part = at::empty({fr.part_len}, at::kFloat);
  else if (comm_.is_gateway())
    part = fr.delta;
  if (part.defined()) {
    part.copy_(fr.global);
    int64_t pos = 0;
    for (const auto& v : part_views(fr)) {
      part.narrow(0, pos, v.numel()).sub_(v.to(part.device()));  // a GPU site's shard: from the device
      pos += v.numel();
    }
  }
  if (sharded) gather_to_gateway(fr, part, fr.delta);
  if (comm_.is_gateway()) {
    if (scale != 1.0) fr.delta.mul_(scale);
    if (options_.dp_clip > 0) privatize(fr.delta);
    std::vector<at::Tensor> bucket;
    const bool per_tensor = codec_ && codec_->id() == codec::CodecId::kPowerSgd;
    if (per_tensor) {  // each piece in its shape: whole tensors, or row blocks of split ones
      int64_t at = 0;
      for (const Piece& pc : fr.pieces) {
        bucket.push_back(fr.delta.narrow(0, at, pc.numel).view(pc.shape));
        at += pc.numel;
      }
    } else {
      bucket.push_back(fr.delta);
    }
    collective::AllreduceOptions o;
    o.op = collective::ReduceOp::kWeightedMean;
    o.weight = weight;
    o.codec = codec_.get();
    o.tag = kTagBase + f;
    o.per_tensor = per_tensor;
    o.site_info = site_info();
    // The outer step's id and the hash of the global weights it starts from: every site must
    // send the same (checked at the merge).
    o.site_info.push_back(static_cast<double>(fr.seq));
    o.site_info.push_back(hash);
    o.max_norm = options_.max_update_norm;
    fr.work = comm_.exchange_async(std::move(bucket), std::move(o));
  }
}

// wan.mode = "every_worker": every worker exchanges the cut of the pseudo-gradient that ZeRO
// gives it (its shard's part when sharded; unsharded, the same range of its whole copy) with
// the workers of the other sites over its own links.
void DilocoStrategy::send_own_part(Fragment& fr, double weight, double scale, double hash) {
  const size_t f = static_cast<size_t>(&fr - fragments_.data());
  collective::Holdings holdings = wan_holdings(fr);
  const auto& mine = holdings[options_.site_index][static_cast<size_t>(comm_.site().rank())];
  at::Tensor part;
  int64_t len = 0;
  for (const auto& span : mine) len += span.end - span.begin;
  if (parted()) {
    NEBULA_CHECK(len == fr.part_len, "fragment ", f, ": this worker's part has ", fr.part_len,
                 " values, its WAN holding ", len);
    fr.delta = part = fr.global.clone();
    int64_t pos = 0;
    for (const auto& v : part_views(fr)) {
      part.narrow(0, pos, v.numel()).sub_(v.to(part.device()));  // a GPU site's shard: from the device
      pos += v.numel();
    }
  } else {  // unsharded: the values of this worker's holding, from the whole fragment
    fr.delta = part = at::empty({len}, at::kFloat);
    int64_t pos = 0;
    for (const auto& span : mine) {
      const int64_t n = span.end - span.begin;
      part.narrow(0, pos, n).copy_(fr.global.narrow(0, span.begin, n)).sub_(read_range(fr, span.begin, n));
      pos += n;
    }
  }
  if (scale != 1.0) part.mul_(scale);
  collective::AllreduceOptions o;
  o.op = collective::ReduceOp::kWeightedMean;
  o.weight = weight;
  o.codec = codec_.get();
  o.tag = kTagBase + f;
  if (comm_.is_gateway()) {  // rank 0's reach every site; the other workers' are not read
    o.site_info = site_info();
    o.site_info.push_back(static_cast<double>(fr.seq));
    o.site_info.push_back(hash);
  }
  o.max_norm = options_.max_update_norm;
  fr.work = comm_.exchange_parts_async(std::move(part), std::move(holdings), std::move(o));
}

collective::Holdings DilocoStrategy::wan_holdings(const Fragment& fr) const {
  std::vector<SiteLayout> layouts;
  for (size_t s = 0; s < options_.num_sites; ++s) layouts.push_back(layout_of(s));
  return strategy::wan_holdings(fr.range(), layouts);
}

void DilocoStrategy::merge(size_t f) {
  Fragment& fr = fragments_[f];
  at::NoGradGuard no_grad;
  const int64_t info_len = static_cast<int64_t>(options_.num_sites * kInfo);
  const bool with_buffers = buffers_sent_.defined() && f + 1 == fragments_.size();
  const int64_t buffers_len = with_buffers ? buffer_numel_ : 0;
  // The mean pseudo-gradient goes to the site's other workers in place (the gateway's
  // exchanged fr.delta), the sites' info and the buffers in a small tensor of their own.
  at::Tensor buf = at::zeros({info_len + buffers_len}, at::kFloat);
  if (comm_.every_worker() && !comm_.is_gateway()) {  // its own part; rank 0 reads the sites' info below
    fr.work->wait(Deadline::after(options_.timeout));
    fr.work.reset();
  }
  if (comm_.is_gateway()) {
    fr.work->wait(Deadline::after(options_.timeout));
    // What this site sent (the hash is of θ_global at the send, unchanged until this merge).
    check_agreement(fr.work->site_info(), static_cast<double>(fr.seq), fr.work->site_info().at(options_.site_index).back(),
                    str_cat("outer step ", fr.seq, " (round ", fr.round, ", fragment ", f, ")"));
    ++hash_checks_;
    if (fr.work->seconds() > 0 && fr.work->wan_bytes_sent() > 0)
      exchange_bits_per_s_ = static_cast<double>(fr.work->wan_bytes_sent()) * 8 / fr.work->seconds() /
                             static_cast<double>(std::max<size_t>(options_.num_sites - 1, 1));  // per path
    // The update guard left these out, the same on every site (the sender's own included).
    for (const auto& r : fr.work->rejected()) {
      ++rejected_updates_;
      std::string what = str_cat("round ", fr.round, fragments_.size() > 1 ? str_cat(", fragment ", f) : "",
                                 ": the update of site #", r.site, " was rejected on every site: ", r.reason);
      if (r.site == options_.site_index) what += " (this site's own update: applied nowhere)";
      spdlog::warn("{}", what);
      decisions_.push_back(what);
    }
    const auto& info = fr.work->site_info();
    NEBULA_CHECK(info.size() == options_.num_sites, "exchange returned ", info.size(), " sites' info, the job has ",
                 options_.num_sites);
    for (size_t s = 0; s < info.size(); ++s)
      for (size_t k = 0; k < kInfo && k < info[s].size(); ++k)
        buf[static_cast<int64_t>(s * kInfo + k)] = static_cast<float>(info[s][k]);
    fr.work.reset();
    if (with_buffers) {
      buffer_work_->wait(Deadline::after(options_.timeout));
      buf.narrow(0, info_len, buffers_len).copy_(buffer_mean_);
      buffer_work_.reset();
    }
  }
  // The sites' mean pseudo-gradient for this worker's part (sharded: scattered, else all of it).
  at::Tensor update = fr.delta;
  if (comm_.every_worker()) {  // this worker's part of the mean, exchanged in place
    if (!parted() && comm_.site().size() > 1) {  // unsharded: the site's parts joined
      const auto parts = site_parts(fr);
      NEBULA_CHECK(in_rank_order(parts), "fragment ", f, ": an unsharded site's WAN cut is of one unit");
      const int64_t at = parts[static_cast<size_t>(comm_.site().rank())].empty()
                             ? 0
                             : parts[static_cast<size_t>(comm_.site().rank())][0].flat - fr.offset;
      update = at::empty({fr.numel}, at::kFloat);
      update.narrow(0, at, fr.delta.numel()).copy_(fr.delta);
      comm_.site().all_gather_parts(update, counts_of(parts));
    }
  } else if (parted()) {
    update = at::empty({fr.part_len}, at::kFloat);
    scatter_from_gateway(fr, fr.delta, update);
  } else if (comm_.site().size() > 1) {
    if (!comm_.is_gateway()) update = fr.delta = at::empty({fr.numel}, at::kFloat);
    comm_.site().broadcast_from_root(fr.delta);
  }
  if (comm_.site().size() > 1) comm_.site().broadcast_from_root(buf);
  if (with_buffers) {  // the mean, plus what forward changed since the send (0 with delay 0)
    at::Tensor progress = flatten(buffers_) - buffers_sent_;
    if (!at::isfinite(progress).all().item<bool>()) progress.zero_();
    unflatten_into(buf.narrow(0, info_len, buffers_len) + progress, buffers_);
    buffers_sent_ = at::Tensor();
  }
  if (f + 1 == fragments_.size()) {
    at::Tensor tail = buf.narrow(0, 0, info_len).contiguous();
    if (info_of_round_.size() <= static_cast<size_t>(fr.round)) info_of_round_.resize(static_cast<size_t>(fr.round) + 1);
    info_of_round_[static_cast<size_t>(fr.round)].assign(tail.data_ptr<float>(), tail.data_ptr<float>() + info_len);
    // Lost sites that every site of this exchange has a fresh link from come back at the
    // start of the next round (the same decision everywhere: it rests on this exchange).
    uint64_t agreed = ~uint64_t{0};
    for (size_t s = 0; s < options_.num_sites; ++s) {
      const float v = tail.data_ptr<float>()[s * kInfo + 3];
      if (v > 0) agreed &= static_cast<uint64_t>(v) - 1;
    }
    joiners_due_ = agreed == ~uint64_t{0} ? 0 : agreed;
  }

  // The outer step, the same on every worker of every site, in place: no copy of the model.
  outer_.step(fr.global, fr.momentum, std::move(update));
  update = fr.delta = at::Tensor();
  if (!fr.sent_local.defined()) {  // delay 0: no training since the send
    write_part(fr, fr.global);
  } else {
    // Keep the inner progress made while the fragment was in flight, unless it is not finite
    // (a diverged site restarts from the global weights; sharded, the site decides together).
    at::Tensor progress = read_part(fr).sub_(fr.sent_local);
    fr.sent_local = at::Tensor();
    at::Tensor diverged = at::full({1}, at::isfinite(progress).all().item<bool>() ? 0.0f : 1.0f);
    if (parted()) comm_.site().allreduce_sum(diverged);
    if (diverged.item<float>() > 0) progress.zero_();
    write_part(fr, progress.add_(fr.global));
  }
  spread_part(fr);
  fr.in_flight = false;
  if (!together_ || f + 1 == fragments_.size()) ++outer_steps_;  // staged pieces: one outer step
  release_free_memory();  // the exchange's buffers, before the next step's activations
}

void DilocoStrategy::privatize(at::Tensor& delta) {
  const double norm = delta.norm().item<double>();
  if (norm > options_.dp_clip) {
    delta.mul_(options_.dp_clip / norm);
    ++dp_clipped_;
  }
  if (options_.dp_noise_multiplier > 0) {
    std::normal_distribution<float> noise(0.0f, static_cast<float>(options_.dp_noise_multiplier * options_.dp_clip));
    float* d = delta.data_ptr<float>();
    for (int64_t i = 0; i < delta.numel(); ++i) d[i] += noise(dp_rng_);
    // Each release (a fragment's counts as one: together they compose) is one Gaussian
    // mechanism on the site's clipped update, of L2 sensitivity 2·dp_clip (diloco.h).
    accountant_.add(1.0, dp_accounted_sigma(), 1);
  }
  ++dp_releases_;
}

std::map<std::string, double> DilocoStrategy::metrics() const {
  std::map<std::string, double> m{{"rejected_updates", static_cast<double>(rejected_updates_)},
                                  {"outer_steps", static_cast<double>(outer_steps_)},
                                  {"outer_sync_seconds", outer_sync_seconds_}};
  if (comm_.is_gateway()) m["hash_checks"] = static_cast<double>(hash_checks_);
  if (merge_gap_.count() > 0) {  // this worker's, at the last setting (merge_gap.h)
    m["merge_gap"] = merge_gap_.gap();
    m["merge_gap_rounds"] = static_cast<double>(merge_gap_.count());
  }
  if (options_.dp_clip > 0 && comm_.is_gateway()) {
    m["dp_releases"] = static_cast<double>(dp_releases_);
    m["dp_clipped"] = static_cast<double>(dp_clipped_);
    m["dp_delta"] = options_.dp_delta;
    if (options_.dp_noise_multiplier > 0 && dp_releases_ > 0)
      m["dp_epsilon"] = accountant_.spent(options_.dp_delta).epsilon;
  }
  return m;
}

void DilocoStrategy::drain() {
  for (size_t next; (next = next_merge(fragments_)) < fragments_.size();) merge(next);
}

void DilocoStrategy::finish() {
  drain();
  // The last merges are checked too: one small exchange of ids and hashes.
  const double hash = global_hash(fragments_.size());
  if (comm_.is_gateway()) {
    const auto info = exchange_positions(comm_, next_seq_, hash, options_.timeout);
    const auto& mine = info.at(options_.site_index);
    check_agreement(info, mine.at(0), mine.at(1),
                    str_cat("the end of training (after outer step ", static_cast<int64_t>(next_seq_) - 1, ")"));
    ++hash_checks_;
  }
}

double DilocoStrategy::global_hash(size_t f) {
  const bool all = f == fragments_.size();
  const size_t begin = all ? 0 : f, end = all ? fragments_.size() : f + 1;
  std::vector<at::Tensor> globals;
  std::vector<std::vector<std::vector<parallel::ShardRun>>> parts;  // empty: the state is whole
  for (size_t j = begin; j < end; ++j) {
    globals.push_back(fragments_[j].global);
    if (parted()) parts.push_back(site_parts(fragments_[j]));
  }
  return strategy::global_hash(comm_, globals, parts);
}

bool DilocoStrategy::can_save() const {
  for (const auto& fr : fragments_)
    if (fr.in_flight) return false;
  return true;
}

}  // namespace nebula::strategy
