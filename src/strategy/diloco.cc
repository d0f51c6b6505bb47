#include "strategy/diloco.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: ATen.h no longer brings it in LibTorch 2.x
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>


#include "nebula/error.h"
#include "wire/frame.h"

namespace nebula::strategy {

namespace {
// What each site attaches to an exchange: compute seconds per inner step, the slowest of its
// measured WAN paths (bits/s) and the longest RTT (s), 0 = not measured; and 1 + the bitmask
// of lost sites its gateway has a fresh link from (elastic rejoin; 0 = this site sent nothing).
constexpr size_t kInfo = 4;
constexpr uint64_t kTagBase = 1000;  // exchange tags: kTagBase + fragment
constexpr int64_t kSlice = 1 << 16;  // elementwise work on the whole model goes in slices of this many
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
  o.heterogeneous = c.heterogeneous;
  o.adaptive = c.adaptive;
  o.codec = c.codec;
  o.codec_options = wan_codec_options(c);
  o.timeout = timeout;
  o.max_update_norm = c.max_update_norm;
  return o;
}

DilocoStrategy::DilocoStrategy(collective::Hierarchy& comm, DilocoOptions options)
    : comm_(comm), options_(std::move(options)), dp_rng_(std::random_device{}()) {
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

std::vector<at::Tensor> DilocoStrategy::part_views(const Fragment& fr) const {
  if (shard_numel_ == 0) return param_views(fr);
  if (fr.part_len == 0) return {flat_params_.narrow(0, 0, 0)};  // ZeRO-3: the part may lie past this worker's shard
  return {flat_params_.narrow(0, fr.offset + fr.part_at - flat_begin_, fr.part_len)};
}

std::vector<int64_t> DilocoStrategy::part_counts(const Fragment& fr) const {
  const int64_t n = comm_.site().size();
  std::vector<int64_t> counts(static_cast<size_t>(n), 0);
  for (int64_t q = 0; q < n; ++q) {
    const int64_t lo = std::clamp(q * shard_numel_ - fr.offset, int64_t{0}, fr.numel);
    const int64_t hi = std::clamp((q + 1) * shard_numel_ - fr.offset, int64_t{0}, fr.numel);
    counts[static_cast<size_t>(q)] = hi - lo;
  }
  return counts;
}

void DilocoStrategy::spread_part(const Fragment& fr) {
  // ZeRO-3 keeps the parameters sharded: its layers gather them when they run.
  if (shard_numel_ > 0 && gathered_)
    comm_.site().all_gather_parts(flat_params_.narrow(0, fr.offset, fr.numel), part_counts(fr));
}

void DilocoStrategy::with_global_weights(const std::function<void()>& fn) {
  at::NoGradGuard no_grad;
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
  params_ = params;
  for (size_t i = 0; i < params.size(); ++i)
    NEBULA_CHECK(params[i].is_contiguous(), "parameter #", i, " of shape ", params[i].sizes(),
                 " is not contiguous: fragments are ranges of the flat parameter vector; make it contiguous");
  std::vector<at::Tensor> state = params;
  state.insert(state.end(), buffers_.begin(), buffers_.end());
  make_replicas_equal(comm_, state);
  total_numel_ = 0;
  for (const auto& p : params) total_numel_ += p.numel();
  buffer_numel_ = 0;
  for (const auto& b : buffers_) buffer_numel_ += b.numel();
  if (buffer_numel_ > 0 && options_.dp_clip > 0 && comm_.is_gateway())
    spdlog::warn("[privacy]: the model's {} buffer values (e.g. BatchNorm statistics) are statistics of this site's "
                 "data; they stay inside the site (averaged over its workers), each site keeps its own",
                 buffer_numel_);

  // Fragments: F ranges of the flat parameter vector of n/F values each, up to half a row of
  // the tensor a cut falls in (cuts go between rows, so that a per-tensor codec gets matrices:
  // a row block of a large tensor, such as the token embedding, is a matrix of its own).
  const int64_t total = total_numel_;
  const auto f = static_cast<size_t>(std::min<int64_t>(options_.fragments, std::max<int64_t>(total, 1)));
  if (static_cast<int64_t>(f) != options_.fragments)
    spdlog::warn("strategy.fragments = {} but the model has {} values: using {}", options_.fragments, total, f);
  std::vector<int64_t> start(params.size() + 1, 0);  // of each tensor in the flat vector
  for (size_t i = 0; i < params.size(); ++i) start[i + 1] = start[i] + params[i].numel();
  auto row_length = [&](size_t i) {
    const at::Tensor& t = params[i];
    return t.dim() >= 1 && t.size(0) > 0 ? t.numel() / t.size(0) : std::max<int64_t>(t.numel(), 1);
  };
  std::vector<int64_t> cut(f + 1, total);
  cut[0] = 0;
  for (size_t j = 1; j < f; ++j) {
    const int64_t target = total * static_cast<int64_t>(j) / static_cast<int64_t>(f);
    const auto i = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), target) - start.begin()) - 1;
    const int64_t row = row_length(i);
    int64_t c = start[i] + (target - start[i] + row / 2) / row * row;  // the nearest row boundary
    // Never empty (a model with fewer rows than fragments: cuts inside rows).
    c = std::clamp<int64_t>(c, cut[j - 1] + 1, total - static_cast<int64_t>(f - j));
    cut[j] = c;
  }
  fragments_.assign(f, Fragment{});
  for (size_t j = 0; j < f; ++j) {
    Fragment& fr = fragments_[j];
    fr.offset = cut[j];
    fr.numel = cut[j + 1] - cut[j];
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t lo = std::max(fr.offset, start[i]), hi = std::min(fr.offset + fr.numel, start[i + 1]);
      if (lo >= hi) continue;
      Piece pc{i, lo - start[i], hi - lo, {hi - lo}};
      const int64_t row = row_length(i);
      if (params[i].dim() >= 2 && pc.at % row == 0 && pc.numel % row == 0) {
        pc.shape = params[i].sizes().vec();
        pc.shape[0] = pc.numel / row;
      } else if (pc.numel == params[i].numel()) {
        pc.shape = params[i].sizes().vec();
      }
      fr.pieces.push_back(std::move(pc));
    }
    fr.part_at = 0;
    fr.part_len = fr.numel;
  }
  // Sharded (expect_sharding): only this worker's part, ZeRO's cut [r S, (r + 1) S) of the
  // flat vector, read straight from the parameters; set_sharding() checks it against the layout.
  const int64_t n = comm_.site().size(), rank = comm_.site().rank();
  const int64_t shard = expect_sharding_ && n > 1 ? (total + n - 1) / n : 0;
  for (Fragment& fr : fragments_) {
    if (shard > 0) {
      fr.part_at = std::clamp(rank * shard - fr.offset, int64_t{0}, fr.numel);
      fr.part_len = std::clamp((rank + 1) * shard - fr.offset, int64_t{0}, fr.numel) - fr.part_at;
    }
    fr.global = read_range(fr, fr.part_at, fr.part_len);
    fr.momentum = at::zeros({fr.part_len}, at::kFloat);
  }
  last_step_end_ = Clock::now();
}

void DilocoStrategy::sync_gradients(const std::vector<at::Tensor>& params, double weight) {
  NEBULA_CHECK(params.size() == params_.size(), "sync_gradients with ", params.size(), " parameters, init had ",
               params_.size());
  collective::SiteGroup& site = comm_.site();
  if (site.size() == 1) {  // nothing to average; the weight still counts for the exchange
    site_weight_ += weight;
    return;
  }
  at::NoGradGuard no_grad;
  // The weight and the weighted buffers (as forward left them this step) travel beside the
  // gradients as a tail [w, b·w]; summed, it gives the site's total weight and buffer mean.
  auto pack_tail = [&](at::Tensor tail) {
    tail[0] = static_cast<float>(weight);
    if (buffer_numel_ > 0) tail.narrow(0, 1, buffer_numel_).copy_(flatten(buffers_)).mul_(weight);
  };
  auto unpack_tail = [&](const at::Tensor& tail) {
    const double total = tail[0].item<double>();
    NEBULA_CHECK(total > 0, "site ", site.site(), ": total weight ", total, " in a data parallel step");
    site_weight_ += total;
    if (buffer_numel_ > 0) unflatten_into(tail.narrow(0, 1, buffer_numel_).div(total), buffers_);
    return total;
  };
  if (flat_grad_.defined()) {
    // ZeRO-2: the weighted gradients are reduce-scattered where they are, the tail all-reduced
    // beside them; this worker's shard ends as the site's average. ZeRO-3's layers did the
    // weighting and the reduce-scatter in backward already.
    at::Tensor tail = at::empty({1 + buffer_numel_}, at::kFloat);
    pack_tail(tail);
    at::Tensor shard = flat_grad_;
    if (gathered_) {
      flat_grad_.mul_(weight);
      shard = flat_grad_.narrow(0, site.rank() * shard_numel_, shard_numel_);
      site.reduce_scatter_sum(flat_grad_, shard);
    }
    site.allreduce_sum(tail);
    shard.div_(unpack_tail(tail));
    return;
  }
  // Every step: the weighted gradients and the tail go straight into one buffer (no
  // intermediate flat copy), one all-reduce, and straight back.
  const int64_t n = total_numel_;
  at::Tensor buf = at::empty({n + 1 + buffer_numel_}, at::kFloat);
  int64_t offset = 0;
  for (const auto& p : params) {
    at::Tensor slice = buf.narrow(0, offset, p.numel());
    if (p.grad().defined())
      slice.copy_(p.grad().reshape({-1})).mul_(weight);
    else
      slice.zero_();
    offset += p.numel();
  }
  pack_tail(buf.narrow(0, n, 1 + buffer_numel_));
  site.allreduce_sum(buf);
  buf.narrow(0, 0, n).div_(unpack_tail(buf.narrow(0, n, 1 + buffer_numel_)));
  offset = 0;
  for (auto& p : params_) {
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    p.mutable_grad().copy_(buf.narrow(0, offset, p.numel()).view_as(p));
    offset += p.numel();
  }
}

void DilocoStrategy::set_sharding(const Sharding& shards) {
  collective::SiteGroup& site = comm_.site();
  const int64_t n = site.size();
  NEBULA_CHECK(n > 1 && !fragments_.empty() && shard_numel_ == 0 && can_save(),
               "set_sharding: once, after init() and before the first step, on a site of more than one worker");
  const int64_t shards_held = shards.gathered ? n : 1;  // ZeRO-3: this worker's only
  auto check = [&](const at::Tensor& flat, const char* what) {
    NEBULA_CHECK(flat.numel() % shards_held == 0 && flat.numel() / shards_held * n >= total_numel_ &&
                     flat.scalar_type() == at::kFloat &&
                     flat.is_contiguous() && flat.dim() == 1,
                 "set_sharding: ", flat.numel(), " ", what, " for ", total_numel_, " parameters over ", n,
                 " workers (want ", shards.gathered ? "N equal shards" : "one of N equal shards",
                 " covering them, 1-D float32, contiguous)");
  };
  check(shards.params, "parameter values");
  int64_t offset = 0;
  for (size_t i = 0; i < params_.size() && shards.gathered; ++i) {
    NEBULA_CHECK(params_[i].numel() == 0 || params_[i].data_ptr() == shards.params.narrow(0, offset, 1).data_ptr(),
                 "set_sharding: parameter #", i, " is not the flat buffer's values from ", offset);
    offset += params_[i].numel();
  }
  if (shards.grads.defined()) {
    check(shards.grads, "gradient values");
    flat_grad_ = shards.grads;
  }
  flat_params_ = shards.params;
  gathered_ = shards.gathered;
  shard_numel_ = shards.params.numel() / shards_held;
  flat_begin_ = gathered_ ? 0 : site.rank() * shard_numel_;
  // This worker's part of each fragment: the fragment's range cut by the shard [r S, (r + 1) S).
  at::NoGradGuard no_grad;
  for (Fragment& fr : fragments_) {
    const std::vector<int64_t> counts = part_counts(fr);
    fr.part_at = 0;
    for (int q = 0; q < site.rank(); ++q) fr.part_at += counts[static_cast<size_t>(q)];
    const int64_t part_len = counts[static_cast<size_t>(site.rank())];
    if (expect_sharding_) {  // init() made the part already
      NEBULA_CHECK(fr.global.numel() == part_len, "set_sharding: init() cut a part of ", fr.global.numel(),
                   " values, the shards give ", part_len);
    } else {
      fr.global = fr.global.narrow(0, fr.part_at, part_len).clone();
      fr.momentum = fr.momentum.narrow(0, fr.part_at, part_len).clone();
    }
    fr.part_len = part_len;
  }
}

bool DilocoStrategy::keep_training(int64_t /*step*/, int64_t steps) {
  if (!round_open_) {
    if (nominal_done_ >= steps) return false;
    start_round(steps);
    if (joiners_due_) welcome();
  }
  return true;
}

void DilocoStrategy::welcome() {
  if (!can_save()) drain();
  if (comm_.is_gateway()) comm_.admit(joiners_due_, Deadline::after(options_.timeout));
  decisions_.push_back(str_cat("round ", rounds_, ": lost sites (mask ", joiners_due_, ") rejoin"));
  joiners_due_ = 0;
  reconcile();  // they take this site's global state (or one further ahead)
}

void DilocoStrategy::join() {
  if (comm_.is_gateway()) comm_.join(Deadline::after(options_.timeout));
  reconcile();
}

std::vector<float> DilocoStrategy::known_info() const {
  // With delay 0 the previous round's last exchange is merged when this round starts; with a
  // delay only the one before it is sure to be, on every site.
  const int64_t lag = options_.delay == 0 ? 1 : 2;
  const int64_t r = rounds_ - lag;
  if (r < 0 || static_cast<size_t>(r) >= info_of_round_.size()) return {};
  return info_of_round_[static_cast<size_t>(r)];
}

void DilocoStrategy::start_round(int64_t steps) {
  const std::vector<float> info = known_info();
  // Per site: [seconds per step, bandwidth, rtt]; the slowest site paces the job.
  double slowest = 0, mine = 0, bandwidth = 0, rtt = 0;
  for (size_t s = 0; s + kInfo <= info.size(); s += kInfo) {
    slowest = std::max(slowest, static_cast<double>(info[s]));
    if (info[s + 1] > 0) bandwidth = bandwidth > 0 ? std::min(bandwidth, double(info[s + 1])) : double(info[s + 1]);
    rtt = std::max(rtt, static_cast<double>(info[s + 2]));
  }
  if (!info.empty() && options_.site_index * kInfo < info.size()) mine = info[options_.site_index * kInfo];

  // Codec and H: pinned, or the controller's (once measured; every round if adaptive).
  int64_t h = options_.inner_steps;
  if (options_.codec == "auto" || options_.inner_steps == 0) {
    const bool measured = slowest > 0 && bandwidth > 0;
    if (!decided_ || (options_.adaptive && measured) || (measured && !decided_measured_)) {
      ControllerInput in{slowest, bandwidth, rtt, total_numel_, static_cast<int64_t>(fragments_.size()), options_.delay};
      ControllerPins pins;
      pins.codec = options_.codec;
      pins.inner_steps = options_.inner_steps;
      pins.codec_options = options_.codec_options;
      ControllerChoice choice = decide(in, pins);
      // Logged when it changes, and the first time it rests on measurements.
      if (!decided_ || (measured && !decided_measured_) || choice.codec != codec_kind_ ||
          choice.inner_steps != controller_h_) {
        decisions_.push_back(str_cat("round ", rounds_, ": codec ", choice.codec, ", H ", choice.inner_steps, " — ",
                                     choice.reason));
        if (comm_.is_gateway()) spdlog::info("controller: {}", decisions_.back());
      }
      if (choice.codec != codec_kind_) set_codec(choice.codec);
      controller_h_ = choice.inner_steps;
      decided_ = true;
      decided_measured_ = decided_measured_ || measured;
    }
    h = controller_h_;
  }
  nominal_h_ = std::min<int64_t>(h, steps - nominal_done_);
  // Heterogeneous sites: the slowest runs H, a faster one proportionally more.
  int64_t mine_h = nominal_h_;
  if (options_.heterogeneous && slowest > 0 && mine > 0)
    mine_h = std::max<int64_t>(nominal_h_, std::llround(static_cast<double>(nominal_h_) * slowest / mine));
  if (mine_h != round_steps_ && (mine_h != nominal_h_ || round_steps_ > nominal_h_)) {
    decisions_.push_back(str_cat("round ", rounds_, ": this site runs ", mine_h, " inner steps (H ", nominal_h_,
                                 "; ", mine * 1e3, " ms per step here, ", slowest * 1e3, " ms at the slowest site)"));
    if (comm_.is_gateway()) spdlog::info("{}", decisions_.back());
  }
  round_steps_ = mine_h;
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
  for (const auto& e : comm_.stats().links) {
    if (e.bandwidth_bits_per_s > 0)
      info[1] = info[1] > 0 ? std::min(info[1], e.bandwidth_bits_per_s) : e.bandwidth_bits_per_s;
    info[2] = std::max(info[2], e.rtt_s);
  }
  // The link estimates time the transfer alone (transport/resilient_link.h, "Estimates"); an
  // exchange's own bytes / time would count the wait for a slower site as transfer time.
  // Before the first exchange they rest on handshakes and heartbeats alone, frames too small
  // to fill the path: report unknown until then.
  if (exchange_bits_per_s_ <= 0) info[1] = 0.0;
  info[3] = 1.0 + static_cast<double>(comm_.ready_joiners());
  return info;
}

void DilocoStrategy::after_step(int64_t /*step*/) {
  NEBULA_CHECK(round_open_, "after_step outside a round: call keep_training before each step");
  const auto now = Clock::now();
  compute_seconds_ += std::chrono::duration<double>(now - last_step_end_).count();
  ++timed_steps_;
  ++local_step_;
  ++in_round_;
  // Fragment j goes at the end of slot j of the round.
  const auto f = static_cast<int64_t>(fragments_.size());
  while (next_fragment_ < fragments_.size() &&
         in_round_ * f >= static_cast<int64_t>(next_fragment_ + 1) * round_steps_)
    send(next_fragment_++);
  if (next_fragment_ == fragments_.size()) {
    nominal_done_ += nominal_h_;
    ++rounds_;
    round_open_ = false;
  }
  // Merge, in the order sent, what is due.
  for (;;) {
    Fragment* due = nullptr;
    for (auto& fr : fragments_)
      if (fr.in_flight && fr.merge_at <= local_step_ && (!due || fr.seq < due->seq)) due = &fr;
    if (!due) break;
    merge(static_cast<size_t>(due - fragments_.data()));
  }
  last_step_end_ = Clock::now();
  outer_sync_seconds_ += std::chrono::duration<double>(last_step_end_ - now).count();
}

void DilocoStrategy::send(size_t f) {
  Fragment& fr = fragments_[f];
  if (fr.in_flight) merge(f);  // a round shorter than the delay: merge before sending again
  at::NoGradGuard no_grad;
  // θ_local at the send is needed at the merge only if training goes on in between (delay > 0).
  if (options_.delay > 0) fr.sent_local = read_part(fr);
  fr.round = rounds_;
  fr.seq = next_seq_++;
  const double weight = site_weight_ - fr.weight_at_send;
  fr.weight_at_send = site_weight_;
  const double hash = global_hash(f);  // of θ_global at the send, unchanged until the merge
  if (comm_.every_worker()) {
    send_own_part(fr, weight, hash);
  } else {
    send_through_gateway(fr, weight, hash);
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
void DilocoStrategy::send_through_gateway(Fragment& fr, double weight, double hash) {
  const size_t f = static_cast<size_t>(&fr - fragments_.data());
  const bool sharded = shard_numel_ > 0;
  at::Tensor part;
  if (comm_.is_gateway()) {
    fr.delta = at::empty({fr.numel}, at::kFloat);
    part = fr.delta.narrow(0, fr.part_at, fr.part_len);
  } else if (sharded) {
    part = at::empty({fr.part_len}, at::kFloat);
  }
  if (part.defined()) {
    part.copy_(fr.global);
    int64_t pos = 0;
    for (const auto& v : part_views(fr)) {
      part.narrow(0, pos, v.numel()).sub_(v);
      pos += v.numel();
    }
  }
  if (sharded) comm_.site().gather_parts_to_root(part, fr.delta, part_counts(fr));
  if (comm_.is_gateway()) {
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
void DilocoStrategy::send_own_part(Fragment& fr, double weight, double hash) {
  const size_t f = static_cast<size_t>(&fr - fragments_.data());
  auto cuts = wan_cuts(fr);
  const size_t me = options_.site_index, rank = static_cast<size_t>(comm_.site().rank());
  const int64_t lo = cuts[me][rank], len = cuts[me][rank + 1] - lo;
  at::Tensor part;
  if (shard_numel_ > 0) {
    NEBULA_CHECK(fr.part_at == lo && fr.part_len == len, "fragment ", f, ": this worker's part [", fr.part_at, ", +",
                 fr.part_len, ") is not its WAN cut [", lo, ", +", len, ")");
    fr.delta = part = fr.global.clone();
    int64_t pos = 0;
    for (const auto& v : part_views(fr)) {
      part.narrow(0, pos, v.numel()).sub_(v);
      pos += v.numel();
    }
  } else {
    fr.delta = part = fr.global.narrow(0, lo, len).clone();
    part.sub_(read_range(fr, lo, len));
  }
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
  fr.work = comm_.exchange_parts_async(std::move(part), std::move(cuts), std::move(o));
}

std::vector<std::vector<int64_t>> DilocoStrategy::wan_cuts(const Fragment& fr) const {
  std::vector<std::vector<int64_t>> cuts;
  for (int64_t w : comm_.workers_per_site()) {
    const int64_t shard = (total_numel_ + w - 1) / w;  // ZeRO's shard at a site of w workers (inner_optimizer.cc)
    std::vector<int64_t> c;
    for (int64_t q = 0; q <= w; ++q) c.push_back(std::clamp(q * shard - fr.offset, int64_t{0}, fr.numel));
    cuts.push_back(std::move(c));
  }
  return cuts;
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
    check_agreement(fr.work->site_info(), static_cast<double>(fr.seq),
                    fr.work->site_info().at(options_.site_index).back(), str_cat("outer step ", fr.seq, " (round ", fr.round, ", fragment ", f, ")"));
    if (fr.work->seconds() > 0 && fr.work->wan_bytes_sent() > 0)
      exchange_bits_per_s_ = static_cast<double>(fr.work->wan_bytes_sent()) * 8 / fr.work->seconds() /
                             static_cast<double>(std::max<size_t>(options_.num_sites - 1, 1));  // per path
    // The update guard left these out, the same on every site (the sender's own included).
    for (const auto& r : fr.work->rejected()) {
      ++rejected_updates_;
      std::string what = str_cat("round ", fr.round, options_.fragments > 1 ? str_cat(", fragment ", f) : "",
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
    if (shard_numel_ == 0 && comm_.site().size() > 1) {  // unsharded: the site's parts joined
      const auto cuts = wan_cuts(fr)[options_.site_index];
      std::vector<int64_t> counts;
      for (size_t q = 0; q + 1 < cuts.size(); ++q) counts.push_back(cuts[q + 1] - cuts[q]);
      update = at::empty({fr.numel}, at::kFloat);
      update.narrow(0, cuts[static_cast<size_t>(comm_.site().rank())], fr.delta.numel()).copy_(fr.delta);
      comm_.site().all_gather_parts(update, counts);
    }
  } else if (shard_numel_ > 0) {
    update = comm_.is_gateway() ? fr.delta.narrow(0, fr.part_at, fr.part_len) : at::empty({fr.part_len}, at::kFloat);
    comm_.site().scatter_parts_from_root(fr.delta, update, part_counts(fr));
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
  const double mu = options_.outer_momentum;
  if (mu > 0) {
    fr.momentum.mul_(mu).add_(update);
    if (options_.nesterov)  // update + (mu m), the product rounded first; in slices, not a copy of the model
      for (int64_t at = 0; at < fr.part_len; at += kSlice) {
        const int64_t k = std::min(kSlice, fr.part_len - at);
        update.narrow(0, at, k).add_(fr.momentum.narrow(0, at, k) * mu);
      }
    else
      update = fr.momentum;
  }
  fr.global.sub_(update, options_.outer_lr);
  update = fr.delta = at::Tensor();
  if (!fr.sent_local.defined()) {  // delay 0: no training since the send
    write_part(fr, fr.global);
  } else {
    // Keep the inner progress made while the fragment was in flight, unless it is not finite
    // (a diverged site restarts from the global weights; sharded, the site decides together).
    at::Tensor progress = read_part(fr).sub_(fr.sent_local);
    fr.sent_local = at::Tensor();
    at::Tensor diverged = at::full({1}, at::isfinite(progress).all().item<bool>() ? 0.0f : 1.0f);
    if (shard_numel_ > 0) comm_.site().allreduce_sum(diverged);
    if (diverged.item<float>() > 0) progress.zero_();
    write_part(fr, progress.add_(fr.global));
  }
  spread_part(fr);
  fr.in_flight = false;
  ++outer_steps_;
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
  for (;;) {
    Fragment* next = nullptr;
    for (auto& fr : fragments_)
      if (fr.in_flight && (!next || fr.seq < next->seq)) next = &fr;
    if (!next) break;
    merge(static_cast<size_t>(next - fragments_.data()));
  }
}

void DilocoStrategy::finish() {
  drain();
  // The last merges are checked too: one small exchange of ids and hashes.
  const double hash = global_hash(fragments_.size());
  if (comm_.is_gateway()) {
    const auto info = exchange_positions(hash);
    const auto& mine = info.at(options_.site_index);
    check_agreement(info, mine.at(0), mine.at(1),
                    str_cat("the end of training (after outer step ", static_cast<int64_t>(next_seq_) - 1, ")"));
  }
}

std::vector<std::vector<double>> DilocoStrategy::exchange_positions(double hash) {
  collective::AllreduceOptions o;
  o.site_info = {static_cast<double>(next_seq_), hash};
  auto work = comm_.exchange_async({at::empty({0}, at::kFloat)}, std::move(o));
  work->wait(Deadline::after(options_.timeout));
  return work->site_info();
}

double DilocoStrategy::global_hash(size_t f) {
  const bool all = f == fragments_.size();
  const size_t begin = all ? 0 : f, end = all ? fragments_.size() : f + 1;
  auto crc_of = [](uint32_t crc, const at::Tensor& values) {
    const at::Tensor g = values.contiguous();
    return wire::crc32(crc, {static_cast<const uint8_t*>(g.data_ptr()), static_cast<size_t>(g.numel()) * sizeof(float)});
  };
  if (shard_numel_ == 0) {
    if (!comm_.is_gateway()) return 0;
    uint32_t crc = 0;
    for (size_t j = begin; j < end; ++j) crc = crc_of(crc, fragments_[j].global);
    return static_cast<double>(crc);
  }
  // Sharded: each worker's CRC of its part of each fragment, summed to the gateway (one slot
  // per worker and fragment: exact in double), combined there in order.
  collective::SiteGroup& site = comm_.site();
  const auto n = static_cast<size_t>(site.size());
  at::Tensor crcs = at::zeros({static_cast<int64_t>((end - begin) * n)}, at::kDouble);
  for (size_t j = begin; j < end; ++j)
    crcs[static_cast<int64_t>((j - begin) * n + static_cast<size_t>(site.rank()))] =
        static_cast<double>(crc_of(0, fragments_[j].global));
  site.reduce_sum_to_root(crcs);
  if (!comm_.is_gateway()) return 0;
  uint32_t crc = 0;
  const double* c = crcs.data_ptr<double>();
  for (size_t j = begin; j < end; ++j) {
    const std::vector<int64_t> counts = part_counts(fragments_[j]);
    for (size_t q = 0; q < n; ++q)
      crc = wire::crc32_combine(crc, static_cast<uint32_t>(c[(j - begin) * n + q]),
                                static_cast<uint64_t>(counts[q]) * sizeof(float));
  }
  return static_cast<double>(crc);
}

void DilocoStrategy::check_agreement(const std::vector<std::vector<double>>& info, double seq, double hash,
                                     const std::string& what) {
  for (size_t s = 0; s < info.size(); ++s) {
    const auto& i = info[s];
    if (i.empty()) continue;  // a lost site (elastic)
    if (i.size() < 2) throw Error(str_cat(what, ": site #", s, " sent no outer step id and hash"));
    const double their_seq = i[i.size() - 2], their_hash = i[i.size() - 1];
    if (their_seq != seq)
      throw Error(str_cat(what, ": site #", s, " contributed its outer step ", static_cast<int64_t>(their_seq),
                          " to this site's outer step ", static_cast<int64_t>(seq),
                          ": the sites are out of step; restart them with nebula run --resume"));
    if (their_hash != hash)
      throw Error(str_cat(what, ": site #", s, " holds other global weights than this site (CRC-32 ",
                          static_cast<uint32_t>(their_hash), " there, ", static_cast<uint32_t>(hash),
                          " here): the sites diverged; restart them with nebula run --resume"));
  }
  ++hash_checks_;
}

bool DilocoStrategy::can_save() const {
  for (const auto& fr : fragments_)
    if (fr.in_flight) return false;
  return true;
}

namespace {
constexpr const char* kCodecKinds[] = {"", "none", "fp16", "bf16", "int8", "int4", "topk", "powersgd", "sparseloco"};
double codec_index(const std::string& kind) {
  for (size_t i = 0; i < std::size(kCodecKinds); ++i)
    if (kind == kCodecKinds[i]) return static_cast<double>(i);
  throw Error(str_cat("codec '", kind, "' has no index for checkpoints"));
}
}  // namespace

void DilocoStrategy::save_state(StrategyState& out) const {
  NEBULA_CHECK(can_save(), "save_state while a fragment is on the WAN");
  save_codec_states(comm_, out);
  auto& n = out.numbers;
  n["fragments"] = static_cast<double>(fragments_.size());
  n["parts"] = shard_numel_ > 0 ? static_cast<double>(comm_.site().size()) : 1.0;  // each worker's part, or whole
  for (size_t j = 0; j < fragments_.size(); ++j) {
    const Fragment& fr = fragments_[j];
    out.tensors[str_cat("f", j, "/global")] = fr.global;
    out.tensors[str_cat("f", j, "/momentum")] = fr.momentum;
    n[str_cat("f", j, "/weight_at_send")] = fr.weight_at_send;
    n[str_cat("f", j, "/round")] = static_cast<double>(fr.round);
  }
  n["rounds"] = static_cast<double>(rounds_);
  n["outer_steps"] = static_cast<double>(outer_steps_);
  n["nominal_done"] = static_cast<double>(nominal_done_);
  n["next_seq"] = static_cast<double>(next_seq_);
  n["local_step"] = static_cast<double>(local_step_);
  n["site_weight"] = site_weight_;
  n["round_open"] = round_open_ ? 1 : 0;
  n["nominal_h"] = static_cast<double>(nominal_h_);
  n["round_steps"] = static_cast<double>(round_steps_);
  n["in_round"] = static_cast<double>(in_round_);
  n["next_fragment"] = static_cast<double>(next_fragment_);
  n["controller_h"] = static_cast<double>(controller_h_);
  n["decided"] = decided_ ? 1 : 0;
  n["decided_measured"] = decided_measured_ ? 1 : 0;
  n["rejected_updates"] = static_cast<double>(rejected_updates_);
  n["hash_checks"] = static_cast<double>(hash_checks_);
  n["dp_releases"] = static_cast<double>(dp_releases_);
  n["dp_clipped"] = static_cast<double>(dp_clipped_);
  n["exchange_bits_per_s"] = exchange_bits_per_s_;
  // What the next rounds' decisions rest on (known_info looks at most two rounds back).
  for (int64_t r = std::max<int64_t>(0, rounds_ - 2); r < static_cast<int64_t>(info_of_round_.size()); ++r)
    for (size_t k = 0; k < info_of_round_[static_cast<size_t>(r)].size(); ++k)
      n[str_cat("info/", r, "/", k)] = info_of_round_[static_cast<size_t>(r)][k];
  out.strings["codec"] = codec_kind_;
  out.decisions = decisions_;
}

void DilocoStrategy::load_state(const StrategyState& in) {
  auto number = [&](const std::string& name) {
    auto it = in.numbers.find(name);
    if (it == in.numbers.end()) throw DataError(str_cat("the checkpoint's strategy state has no '", name, "'"));
    return it->second;
  };
  auto integer = [&](const std::string& name) { return static_cast<int64_t>(number(name)); };
  if (static_cast<size_t>(integer("fragments")) != fragments_.size())
    throw DataError(str_cat("the checkpoint has ", integer("fragments"), " fragments, this job ", fragments_.size()));
  at::NoGradGuard no_grad;
  for (size_t j = 0; j < fragments_.size(); ++j) {
    Fragment& fr = fragments_[j];
    for (auto [name, target] : {std::pair{"global", &fr.global}, std::pair{"momentum", &fr.momentum}}) {
      auto it = in.tensors.find(str_cat("f", j, "/", name));
      // This worker's part, or the whole fragment (load_resharded) to take it from.
      if (it == in.tensors.end() || (it->second.numel() != fr.part_len && it->second.numel() != fr.numel) ||
          it->second.scalar_type() != at::kFloat)
        throw DataError(str_cat("the checkpoint's strategy state has no ", name, " of fragment ", j, " with ",
                                fr.part_len, " float32 values (this worker's part of its ", fr.numel,
                                ": the state is sharded like [parallel] shard and the site's workers)"));
      const at::Tensor values = it->second.reshape({-1});
      *target = (values.numel() == fr.part_len ? values : values.narrow(0, fr.part_at, fr.part_len)).clone();
    }
    fr.weight_at_send = number(str_cat("f", j, "/weight_at_send"));
    fr.round = integer(str_cat("f", j, "/round"));
    fr.in_flight = false;
  }
  rounds_ = integer("rounds");
  outer_steps_ = integer("outer_steps");
  nominal_done_ = integer("nominal_done");
  next_seq_ = static_cast<uint64_t>(integer("next_seq"));
  local_step_ = integer("local_step");
  site_weight_ = number("site_weight");
  round_open_ = integer("round_open") != 0;
  nominal_h_ = integer("nominal_h");
  round_steps_ = integer("round_steps");
  in_round_ = integer("in_round");
  next_fragment_ = static_cast<size_t>(integer("next_fragment"));
  controller_h_ = integer("controller_h");
  decided_ = integer("decided") != 0;
  decided_measured_ = integer("decided_measured") != 0;
  rejected_updates_ = integer("rejected_updates");
  hash_checks_ = integer("hash_checks");
  dp_releases_ = integer("dp_releases");
  dp_clipped_ = integer("dp_clipped");
  exchange_bits_per_s_ = number("exchange_bits_per_s");
  if (options_.dp_clip > 0 && options_.dp_noise_multiplier > 0 && dp_releases_ > 0)
    accountant_.add(1.0, dp_accounted_sigma(), dp_releases_);  // the privacy already spent
  info_of_round_.assign(static_cast<size_t>(rounds_), {});
  for (const auto& [name, value] : in.numbers) {
    long long r = 0, k = 0;
    if (std::sscanf(name.c_str(), "info/%lld/%lld", &r, &k) != 2 || r < 0 || r >= rounds_) continue;
    auto& row = info_of_round_[static_cast<size_t>(r)];
    if (row.size() <= static_cast<size_t>(k)) row.resize(static_cast<size_t>(k) + 1);
    row[static_cast<size_t>(k)] = static_cast<float>(value);
  }
  auto codec = in.strings.find("codec");
  if (codec != in.strings.end() && !codec->second.empty() && codec->second != codec_kind_) set_codec(codec->second);
  decisions_ = in.decisions;
  load_codec_states(comm_, in);
  // θ_local at the checkpoint is in the parameters (the worker loads them).
  last_step_end_ = Clock::now();
}

void DilocoStrategy::load_resharded(const std::vector<StrategyState>& ranks) {
  NEBULA_CHECK(!ranks.empty(), "load_resharded without states");
  auto parts_it = ranks[0].numbers.find("parts");
  const auto parts = static_cast<size_t>(parts_it == ranks[0].numbers.end() ? 1.0 : parts_it->second);
  if (parts <= 1) return load_state(ranks[0]);  // every worker holds the whole state
  if (parts != ranks.size())
    throw DataError(str_cat("the checkpoint's strategy state is cut into ", parts, " parts, but ", ranks.size(),
                            " workers' checkpoints were found"));
  StrategyState whole = ranks[0];
  for (size_t j = 0; j < fragments_.size(); ++j)
    for (const char* name : {"global", "momentum"}) {
      const std::string key = str_cat("f", j, "/", name);
      std::vector<at::Tensor> pieces;
      for (size_t q = 0; q < ranks.size(); ++q) {
        auto it = ranks[q].tensors.find(key);
        if (it == ranks[q].tensors.end())
          throw DataError(str_cat("the checkpoint of rank ", q, " has no strategy tensor ", key));
        pieces.push_back(it->second.reshape({-1}));
      }
      whole.tensors[key] = at::cat(pieces);
    }
  load_state(whole);
}

void DilocoStrategy::reconcile() {
  at::NoGradGuard no_grad;
  const size_t me = options_.site_index;
  // Gateways: every site's position. Then, inside the site: [leader, any site differs, this one does].
  at::Tensor verdict = at::zeros({3}, at::kFloat);
  const double hash = global_hash(fragments_.size());
  if (comm_.is_gateway()) {
    const auto info = exchange_positions(hash);
    size_t leader = me;
    for (size_t s = 0; s < info.size(); ++s)  // lost sites (elastic) sent nothing
      if (!info[s].empty() && (info[s][0] > info[leader].at(0) || (info[s][0] == info[leader][0] && s < leader)))
        leader = s;
    bool any = false;
    for (size_t s = 0; s < info.size(); ++s) any = any || (!info[s].empty() && info[s] != info[leader]);
    verdict[0] = static_cast<float>(leader);
    verdict[1] = any ? 1.0f : 0.0f;
    verdict[2] = info[me] != info[leader] ? 1.0f : 0.0f;
    if (any)
      spdlog::info("resume: site #{} is furthest ahead (outer step {}); {}", leader, info[leader].at(0),
                   verdict[2].item<float>() > 0 ? str_cat("this site (at outer step ", next_seq_, ") takes its global state")
                                                : "this site keeps its own");
  }
  if (comm_.site().size() > 1) comm_.site().broadcast_from_root(verdict);
  if (verdict[1].item<float>() == 0) return;
  const size_t leader = static_cast<size_t>(verdict[0].item<float>());
  const bool adopt = verdict[2].item<float>() > 0;

  // The leader's global weights and momentum, exactly (weight 1 there, 0 elsewhere), and its
  // position: counters (double on the WAN and inside the site), and the info decisions rest on.
  // A site behind takes the leader's buffers too (not with [privacy]: they never leave a site).
  const int64_t buffers_len = buffers_cross_sites() ? buffer_numel_ : 0;
  const bool sharded = shard_numel_ > 0;
  collective::SiteGroup& site = comm_.site();
  at::Tensor values;
  if (!sharded) {
    std::vector<at::Tensor> parts;
    for (const auto& fr : fragments_) parts.push_back(fr.global);
    for (const auto& fr : fragments_) parts.push_back(fr.momentum);
    if (buffers_len > 0) parts.push_back(flatten(buffers_));
    values = at::cat(parts);
  } else {  // the gateway gathers the workers' parts
    values = at::empty({comm_.is_gateway() ? 2 * total_numel_ + buffers_len : 0}, at::kFloat);
    int64_t at = 0;
    for (at::Tensor Fragment::*field : {&Fragment::global, &Fragment::momentum})
      for (const auto& fr : fragments_) {
        site.gather_parts_to_root(fr.*field, comm_.is_gateway() ? values.narrow(0, at, fr.numel) : at::Tensor(),
                                  part_counts(fr));
        at += fr.numel;
      }
    if (comm_.is_gateway() && buffers_len > 0) values.narrow(0, at, buffers_len).copy_(flatten(buffers_));
  }
  std::vector<double> position = {static_cast<double>(next_seq_), static_cast<double>(rounds_),
                                  static_cast<double>(outer_steps_), static_cast<double>(nominal_done_),
                                  round_open_ ? 1.0 : 0.0, static_cast<double>(nominal_h_),
                                  static_cast<double>(in_round_), static_cast<double>(next_fragment_),
                                  static_cast<double>(controller_h_), decided_ ? 1.0 : 0.0,
                                  decided_measured_ ? 1.0 : 0.0, codec_index(codec_kind_)};
  for (const auto& fr : fragments_) position.push_back(static_cast<double>(fr.round));
  const size_t fixed = position.size();
  for (int64_t r = std::max<int64_t>(0, rounds_ - 2); r < rounds_; ++r) {
    const auto& row = static_cast<size_t>(r) < info_of_round_.size() ? info_of_round_[static_cast<size_t>(r)]
                                                                     : std::vector<float>{};
    position.push_back(static_cast<double>(row.size()));
    position.insert(position.end(), row.begin(), row.end());
  }
  at::Tensor pos = at::zeros({1024}, at::kDouble);
  if (comm_.is_gateway()) {
    collective::AllreduceOptions o;
    o.weight = me == leader ? 1.0 : 0.0;
    o.site_info = position;
    auto work = comm_.exchange_async({values}, std::move(o));
    work->wait(Deadline::after(options_.timeout));
    const auto& theirs = work->site_info().at(leader);
    NEBULA_CHECK(theirs.size() <= 1024, "position of ", theirs.size(), " values");
    std::copy(theirs.begin(), theirs.end(), pos.data_ptr<double>());
  }
  if (site.size() > 1) {
    if (!sharded) site.broadcast_from_root(values);
    site.broadcast_from_root(pos);
  }
  if (!adopt) return;  // the same on every worker of the site
  const double* p = pos.data_ptr<double>();
  int64_t at = 0;
  for (at::Tensor Fragment::*field : {&Fragment::global, &Fragment::momentum})
    for (auto& fr : fragments_) {
      if (sharded)  // each worker's part, from the gateway
        site.scatter_parts_from_root(comm_.is_gateway() ? values.narrow(0, at, fr.numel) : at::Tensor(), fr.*field,
                                     part_counts(fr));
      else
        (fr.*field).copy_(values.narrow(0, at, fr.numel));
      at += fr.numel;
    }
  if (buffers_len > 0) {
    at::Tensor buffers = comm_.is_gateway() || !sharded ? values.narrow(0, at, buffers_len).contiguous()
                                                        : at::empty({buffers_len}, at::kFloat);
    if (sharded) site.broadcast_from_root(buffers);
    unflatten_into(buffers, buffers_);
  }
  next_seq_ = static_cast<uint64_t>(p[0]);
  rounds_ = static_cast<int64_t>(p[1]);
  outer_steps_ = static_cast<int64_t>(p[2]);
  nominal_done_ = static_cast<int64_t>(p[3]);
  round_open_ = p[4] != 0;
  nominal_h_ = static_cast<int64_t>(p[5]);
  round_steps_ = nominal_h_;  // this round without the heterogeneous scaling
  in_round_ = static_cast<int64_t>(p[6]);
  next_fragment_ = static_cast<size_t>(p[7]);
  controller_h_ = static_cast<int64_t>(p[8]);
  decided_ = p[9] != 0;
  decided_measured_ = p[10] != 0;
  const std::string kind = kCodecKinds[static_cast<size_t>(p[11])];
  if (!kind.empty() && kind != codec_kind_) set_codec(kind);
  for (size_t j = 0; j < fragments_.size(); ++j) fragments_[j].round = static_cast<int64_t>(p[12 + j]);
  size_t k = fixed;
  info_of_round_.assign(static_cast<size_t>(rounds_), {});
  for (int64_t r = std::max<int64_t>(0, rounds_ - 2); r < rounds_; ++r) {
    const auto len = static_cast<size_t>(p[k++]);
    info_of_round_[static_cast<size_t>(r)].assign(p + k, p + k + len);
    k += len;
  }
  // The local weights start again from the global ones; the tokens count from here.
  for (Fragment& fr : fragments_) {
    write_part(fr, fr.global);
    spread_part(fr);
    fr.weight_at_send = site_weight_;
  }
  decisions_.push_back(str_cat("resume: took the global state of site #", leader, " at outer step ", next_seq_));
}

}  // namespace nebula::strategy
