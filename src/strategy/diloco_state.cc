// DilocoStrategy's state across restarts: checkpoints (save_state, load_state, load_resharded),
// reconcile() after a resume, and the elastic rejoin (welcome, join). The round position's two
// encodings are round_position.h's.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: ATen.h no longer brings it in LibTorch 2.x
#include <spdlog/spdlog.h>

#include <algorithm>
#include <sstream>

#include "nebula/error.h"
#include "strategy/diloco.h"
#include "strategy/replica_check.h"

namespace nebula::strategy {

RoundPosition DilocoStrategy::position() const {
  RoundPosition p;
  p.next_seq = next_seq_;
  p.rounds = rounds_;
  p.outer_steps = outer_steps_;
  p.nominal_done = nominal_done_;
  p.round_open = round_open_;
  p.nominal_h = nominal_h_;
  p.round_steps = round_steps_;
  p.in_round = in_round_;
  p.next_fragment = next_fragment_;
  p.controller = controller_;
  p.codec = codec_kind_;
  for (const auto& fr : fragments_) p.fragment_rounds.push_back(fr.round);
  p.info_of_round = info_of_round_;
  return p;
}

void DilocoStrategy::set_position(const RoundPosition& p) {
  next_seq_ = p.next_seq;
  rounds_ = p.rounds;
  outer_steps_ = p.outer_steps;
  nominal_done_ = p.nominal_done;
  round_open_ = p.round_open;
  nominal_h_ = p.nominal_h;
  round_steps_ = p.round_steps;
  in_round_ = p.in_round;
  next_fragment_ = p.next_fragment;
  controller_ = p.controller;
  if (!p.codec.empty() && p.codec != codec_kind_) set_codec(p.codec);
  for (size_t j = 0; j < fragments_.size(); ++j) fragments_[j].round = p.fragment_rounds.at(j);
  info_of_round_ = p.info_of_round;
  // A row of another width (an older build's, of fewer values per site) is not read as this one.
  for (auto& row : info_of_round_)
    if (row.size() != options_.num_sites * kSiteInfo) row.clear();
}

void DilocoStrategy::save_state(StrategyState& out) const {
  NEBULA_CHECK(can_save(), "save_state while a fragment is on the WAN");
  save_codec_states(comm_, out);
  auto& n = out.numbers;
  n["fragments"] = static_cast<double>(fragments_.size());
  n["parts"] = parted() ? static_cast<double>(comm_.site().size()) : 1.0;  // each worker's part, or whole
  if (const auto* stages = staged() ? std::get_if<parallel::StageLayout>(&layouts_.at(options_.site_index)) : nullptr) {
    // the stages the parts are cut by (a resume onto another layout is refused)
    std::string bounds;
    for (int64_t b : stages->bounds()) bounds += (bounds.empty() ? "" : ",") + std::to_string(b);
    out.strings["stages"] = str_cat(bounds, "x", stages->data());
  }
  if (const parallel::SliceLayout* sl = slices()) out.strings["slices"] = str_cat(sl->slices(), "x", sl->data());
  if (shard_numel_ > 0 && !unit_bounds_.empty()) {  // the units the parts are cut by (load_resharded)
    std::string units;
    for (int64_t b : unit_bounds_) units += (units.empty() ? "" : ",") + std::to_string(b);
    out.strings["units"] = units;
  }
  for (size_t j = 0; j < fragments_.size(); ++j) {
    const Fragment& fr = fragments_[j];
    out.tensors[str_cat("f", j, "/global")] = fr.global;
    out.tensors[str_cat("f", j, "/momentum")] = fr.momentum;
    n[str_cat("f", j, "/weight_at_send")] = fr.weight_at_send;
  }
  position().save(out);
  n["local_step"] = static_cast<double>(local_step_);
  n["site_weight"] = site_weight_;
  n["rejected_updates"] = static_cast<double>(rejected_updates_);
  n["hash_checks"] = static_cast<double>(hash_checks_);
  n["dp_releases"] = static_cast<double>(dp_releases_);
  n["dp_clipped"] = static_cast<double>(dp_clipped_);
  n["exchange_bits_per_s"] = exchange_bits_per_s_;
  out.decisions = decisions_;
}

void DilocoStrategy::load_state(const StrategyState& in) {
  auto integer = [&](const std::string& name) { return static_cast<int64_t>(state_number(in, name)); };
  if (static_cast<size_t>(integer("fragments")) != fragments_.size())
    throw DataError(str_cat("the checkpoint has ", integer("fragments"), " fragments, this job ", fragments_.size(),
                            " (streaming: strategy.fragments; diloco in gateway mode: the model's bytes over "
                            "strategy.staging): resume with the settings it was saved with"));
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
      *target = values.numel() == fr.part_len ? values.clone() : take_part(fr, values);
    }
    fr.weight_at_send = state_number(in, str_cat("f", j, "/weight_at_send"));
    fr.in_flight = false;
  }
  set_position(RoundPosition::load(in, fragments_.size()));
  local_step_ = integer("local_step");
  site_weight_ = state_number(in, "site_weight");
  rejected_updates_ = integer("rejected_updates");
  hash_checks_ = integer("hash_checks");
  dp_releases_ = integer("dp_releases");
  dp_clipped_ = integer("dp_clipped");
  exchange_bits_per_s_ = state_number(in, "exchange_bits_per_s");
  if (options_.dp_clip > 0 && options_.dp_noise_multiplier > 0 && dp_releases_ > 0)
    accountant_.add(1.0, dp_accounted_sigma(), dp_releases_);  // the privacy already spent
  decisions_ = in.decisions;
  load_codec_states(comm_, in);
  // θ_local at the checkpoint is in the parameters (the worker loads them).
  last_step_end_ = std::chrono::steady_clock::now();
}

void DilocoStrategy::load_resharded(const std::vector<StrategyState>& ranks) {
  NEBULA_CHECK(!ranks.empty(), "load_resharded without states");
  auto parts_it = ranks[0].numbers.find("parts");
  const auto parts = static_cast<size_t>(parts_it == ranks[0].numbers.end() ? 1.0 : parts_it->second);
  if (static_cast<size_t>(state_number(ranks[0], "fragments")) != fragments_.size())
    return load_state(ranks[0]);  // refused, naming the setting that changed
  // The old layout: the stages or slices that wrote it (each worker's part is its runs there),
  // or the units its parts were cut by (none recorded: one unit) at its workers.
  const bool cut = ranks[0].strings.count("stages") || ranks[0].strings.count("slices");
  if (cut && !ranks[0].written)
    throw DataError("the checkpoint's strategy state is cut by pipeline stages or tensor slices its worker "
                    "checkpoints do not describe (written by an older nebula): resume with the layout it was saved with");
  std::vector<int64_t> bounds{0, total_numel_};
  if (auto it = ranks[0].strings.find("units"); it != ranks[0].strings.end()) {
    bounds.clear();
    std::stringstream in(it->second);
    for (std::string b; std::getline(in, b, ',');) bounds.push_back(std::stoll(b));
  }
  if (bounds.empty() || bounds.back() != total_numel_)
    throw DataError(str_cat("the checkpoint's strategy state is cut into units of ", bounds.empty() ? 0 : bounds.back(),
                            " values for a model of ", total_numel_, ": the model changed"));
  // Unsharded, every old worker holds the whole state: rank 0's is read.
  const size_t olds = cut || parts > 1 ? ranks.size() : 1;
  const SiteLayout old = cut ? *ranks[0].written : SiteLayout(parallel::ShardLayout(bounds, static_cast<int64_t>(olds)));
  if (cut && (static_cast<size_t>(workers_of(old)) != ranks.size() || total_of(old) != total_numel_))
    throw DataError(str_cat("the checkpoint's strategy state is cut for ", workers_of(old), " workers and ",
                            total_of(old), " values; ", ranks.size(), " workers' checkpoints were found and this job's outer state has ", total_numel_,
                            " (a one-site job's stages or slices keep their outer state per stage: resume those "
                            "with the layout they were saved with)"));
  if (!cut && parts > 1 && parts != ranks.size())
    throw DataError(str_cat("the checkpoint's strategy state is cut into ", parts, " parts, but ", ranks.size(),
                            " workers' checkpoints were found"));
  // Values [begin, begin + len) of old rank q's piece `key`, and its size: loaded, or read from
  // its checkpoint file by range.
  auto numel_of = [&](size_t q, const std::string& key) -> int64_t {
    if (auto it = ranks[q].tensors.find(key); it != ranks[q].tensors.end()) return it->second.numel();
    if (auto it = ranks[q].unread.find(key); it != ranks[q].unread.end() && ranks[q].read) return it->second;
    throw DataError(str_cat("the checkpoint of rank ", q, " has no strategy tensor ", key));
  };
  auto values_of = [&](size_t q, const std::string& key, int64_t begin, int64_t len) {
    if (auto it = ranks[q].tensors.find(key); it != ranks[q].tensors.end()) return it->second.reshape({-1}).narrow(0, begin, len);
    return ranks[q].read(key, begin, len);
  };
  // This worker's part of every fragment's global weights and momentum, taken from the old
  // ranks' pieces where they overlap it: no worker joins a whole fragment.
  StrategyState mine = ranks[0];
  if (comm_.every_worker() && (cut || staged() || slices()))  // each worker's error feedback is of its own part
    for (auto it = mine.tensors.begin(); it != mine.tensors.end();)
      it = it->first.rfind("codec/", 0) == 0 ? mine.tensors.erase(it) : std::next(it);
  for (size_t j = 0; j < fragments_.size(); ++j)
    for (const char* name : {"global", "momentum"}) {
      const std::string key = str_cat("f", j, "/", name);
      const Fragment& fr = fragments_[j];
      const auto parts = parts_of(fr.range(), old);
      const std::vector<int64_t> counts = counts_of(parts);
      for (size_t q = 0; q < olds; ++q)
        if (const int64_t n = numel_of(q, key); n != counts[q])
          throw DataError(str_cat("the checkpoint of rank ", q, " holds ", n, " values of ", key, ", its layout ",
                                  counts[q], ": the model changed"));
      at::Tensor part = at::empty({fr.part_len}, at::kFloat);
      int64_t at = 0;
      for (const parallel::ShardRun& r : fr.part) {
        for (size_t q = 0; q < olds; ++q) {
          int64_t pos = 0;  // where run o starts in rank q's piece
          for (const parallel::ShardRun& o : parts[q]) {
            const int64_t lo = std::max(o.flat, r.flat), hi = std::min(o.flat + o.len, r.flat + r.len);
            if (lo < hi) part.narrow(0, at + lo - r.flat, hi - lo).copy_(values_of(q, key, pos + lo - o.flat, hi - lo));
            pos += o.len;
          }
        }
        at += r.len;
      }
      mine.tensors[key] = part;
    }
  load_state(mine);
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

void DilocoStrategy::reconcile() {
  at::NoGradGuard no_grad;
  const size_t me = options_.site_index;
  // Gateways: every site's position. Then, inside the site: [leader, any site differs, this one does].
  at::Tensor verdict = at::zeros({3}, at::kFloat);
  const double hash = global_hash(fragments_.size());
  if (comm_.is_gateway()) {
    const auto info = exchange_positions(comm_, next_seq_, hash, options_.timeout);
    const ReconcileVerdict v = reconcile_verdict(info, me);
    verdict[0] = static_cast<float>(v.leader);
    verdict[1] = v.any ? 1.0f : 0.0f;
    verdict[2] = v.adopt ? 1.0f : 0.0f;
    if (v.any)
      spdlog::info("resume: site #{} is furthest ahead (outer step {}); {}", v.leader, info[v.leader].at(0),
                   v.adopt ? str_cat("this site (at outer step ", next_seq_, ") takes its global state")
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
  const bool sharded = parted();
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
        gather_to_gateway(fr, fr.*field, comm_.is_gateway() ? values.narrow(0, at, fr.numel) : at::Tensor());
        at += fr.numel;
      }
    if (comm_.is_gateway() && buffers_len > 0) values.narrow(0, at, buffers_len).copy_(flatten(buffers_));
  }
  std::vector<double> position_vector = position().to_vector();
  at::Tensor pos = at::zeros({1024}, at::kDouble);
  if (comm_.is_gateway()) {
    collective::AllreduceOptions o;
    o.weight = me == leader ? 1.0 : 0.0;
    o.site_info = std::move(position_vector);
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
  int64_t at = 0;
  for (at::Tensor Fragment::*field : {&Fragment::global, &Fragment::momentum})
    for (auto& fr : fragments_) {
      if (sharded)  // each worker's part, from the gateway
        scatter_from_gateway(fr, comm_.is_gateway() ? values.narrow(0, at, fr.numel) : at::Tensor(), fr.*field);
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
  set_position(RoundPosition::from_vector(pos.data_ptr<double>(), fragments_.size()));
  // The local weights start again from the global ones; the tokens count from here.
  for (Fragment& fr : fragments_) {
    write_part(fr, fr.global);
    spread_part(fr);
    fr.weight_at_send = site_weight_;
  }
  decisions_.push_back(str_cat("resume: took the global state of site #", leader, " at outer step ", next_seq_));
}

}  // namespace nebula::strategy
