// DiLoCo (Douillard et al., arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512) as one
// strategy: inside each site ordinary data parallel every step (the inner optimizer, AdamW,
// steps on the site's averaged gradient; LAN only); every H inner steps the sites exchange
// pseudo-gradients Δ = θ_global − θ_local over the WAN, encoded with any codec, and every
// worker applies the same outer step (SGD with Nesterov momentum) to θ_global:
//
//   m ← μ m + Δ̄        θ_global ← θ_global − lr_outer (Δ̄ + μ m)   (plain m without Nesterov)
//   θ_local ← θ_global + (θ_local_now − θ_local_at_send)
//
// Δ̄ is the mean of the sites' Δ weighted by the tokens each processed since its last send.
//
//   diloco     the whole model at once (F = 1), merged at once (delay 0): every worker of
//              every site holds bit-identical weights after every outer step.
//   streaming  the model cut into F fragments sent at staggered steps (fragment j at the end
//              of slot j of each round); each exchange runs on the communication thread while
//              inner steps go on and is merged `delay` inner steps later. The inner progress
//              made while a fragment was in flight is kept (the last term above; 0 when
//              delay = 0), so the WAN time disappears from the step time as long as an
//              exchange takes less than `delay` steps.
//
// With codec "sparseloco" this is SparseLoCo (arXiv 2508.15706): the codec's per-site error
// feedback carries what top-k dropped, and outer_momentum = 0, outer_lr = 1 reproduce it.
//
// Heterogeneous sites: each exchange carries the site's measured compute time per inner
// step; a faster site then runs proportionally more inner steps per round (H_s = H · t_slowest
// / t_s, the slowest runs H), so all sites reach each exchange together; Δ̄ is weighted by
// tokens. The adaptive controller (controller.h) chooses codec and H from the same numbers.
// Every site applies a round's decisions from the exchange of the previous round's last
// fragment, which every site has merged by then, so all make the same decisions.
//
// The parts, each tested alone: the outer optimizer (outer_optimizer.h), the fragments and when
// they go (fragment_schedule.h), who holds which values in an exchange (exchange_layout.h), the
// round's H_s and codec (round_planner.h), the replica checks (replica_check.h) and the round
// position that checkpoints and reconcile carry (round_position.h). This class composes them:
// diloco.cc sends and merges, diloco_site.cc runs the site's data parallel step and ZeRO's
// sharded outer state, diloco_state.cc checkpoints, reconcile and the elastic rejoin.
//
// Threads: all of it runs on the training thread except the WAN leg (Hierarchy::exchange_async
// on the gateway's communication thread); the site-group collectives are the training thread's.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "privacy/rdp.h"
#include "strategy/exchange_layout.h"
#include "strategy/fragment_schedule.h"
#include "strategy/merge_gap.h"
#include "strategy/outer_optimizer.h"
#include "strategy/round_planner.h"
#include "strategy/round_position.h"
#include "strategy/strategy.h"

namespace nebula::strategy {

struct DilocoOptions {
  std::string name = "diloco";
  int64_t inner_steps = 50;       // H; 0 = the controller chooses
  double outer_lr = 0.7;
  double outer_momentum = 0.9;
  bool nesterov = true;
  int64_t fragments = 1;          // F
  // diloco, gateway mode: the round's exchange in fragments of about this many bytes (cut between rows), sent
  // together at the round's end, each merged once the next is on its way (0: one exchange).
  // Not with [privacy] (the gateway clips the site's whole update) nor every_worker (each
  // worker exchanges only its own part).
  uint64_t staging_bytes = 0;
  int64_t delay = 0;              // inner steps between sending a fragment and merging it
  bool heterogeneous = true;
  bool adaptive = true;           // re-decide auto choices every round (else once measured)
  std::string codec = "none";     // or "auto"
  codec::CodecOptions codec_options;
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  size_t num_sites = 1;           // of the job
  size_t site_index = 0;          // this worker's site
  double assumed_step_seconds = 0;  // tests: report this compute time per step instead of measuring
  double assumed_bits_per_s = 0;    // tests: report this bandwidth (after the first exchange) instead of the links' estimate
  double max_update_norm = 0;     // the update guard's bound (non-finite updates are always rejected)
  double max_loss_penalty = 0;    // > 0: the controller watches the merge gap (controller.h)
  // Differential privacy ([privacy]): the gateway clips each pseudo-gradient it sends to L2
  // norm dp_clip and adds N(0, (dp_noise_multiplier · dp_clip)²) to every value (noise drawn
  // from a generator seeded by std::random_device: it must not be reproducible elsewhere).
  // Neighbouring inputs are any two datasets of the site (the unit protected is the site's
  // whole data, other sites' data fixed). Every site's noised update reaches every other
  // gateway on its own, and the clipped update of one dataset can be any vector of the
  // dp_clip ball, that of another any other one (H inner steps bound no single example's
  // influence): L2 sensitivity 2·dp_clip, so the accountant records noise multiplier
  // dp_noise_multiplier / 2 per release.
  double dp_clip = 0;             // 0 = off
  double dp_noise_multiplier = 0;
  double dp_delta = 1e-5;

  static DilocoOptions from(const StrategyConfig& config, std::chrono::milliseconds timeout, size_t num_sites,
                            size_t site_index);
};

class DilocoStrategy : public Strategy {
 public:
  DilocoStrategy(collective::Hierarchy& comm, DilocoOptions options);
  ~DilocoStrategy() override;
  std::string name() const override { return options_.name; }
  void init(const std::vector<at::Tensor>& params) override;
  void init_from_shard(const std::vector<at::Tensor>& params, const std::vector<std::vector<int64_t>>& shapes,
                       const at::Tensor& shard) override;
  // The site's own data parallel step: gradients averaged over the site's workers, weighted.
  void sync_gradients(const std::vector<at::Tensor>& params, double weight) override;
  // ZeRO: this worker keeps its shard of θ_global and the outer momentum (and of θ_local at a
  // send, with a delay); the gateway gathers the site's pseudo-gradient from the shards for
  // the WAN and scatters the sites' mean back, every worker steps its own shard and the site
  // all-gathers the parameters. ZeRO-2: the site's gradients are reduce-scattered in place.
  // The same arithmetic as unsharded, elementwise: bit-identical weights (strategy.h).
  void set_sharding(const Sharding& shards) override;
  // init() then makes only this worker's part of θ_global and the outer momentum (ZeRO's cut
  // at the site's number of workers), so start-up never holds them whole.
  void expect_sharding() override { expect_sharding_ = true; }
  // ZeRO-3's units (FullShard::unit_bounds): every site's workers hold a piece of each, and
  // exchange (every_worker) and keep their outer state by those pieces.
  void set_unit_bounds(std::vector<int64_t> bounds) override { unit_bounds_ = std::move(bounds); }
  // Sites of different layouts (a site of pipeline stages among others): every site's cut of
  // the flat vector. A staged site's workers keep their pieces of the outer state (StageLayout),
  // run the data parallel step over their stage's replicas, and after a merge all-gather the
  // stage's values over them; the exchanges (both WAN modes) cut by each site's layout.
  void set_layouts(Layouts layouts) override;
  void observe_loss(double loss) override { merge_gap_.observe(loss); }
  void after_step(int64_t step) override;
  bool keep_training(int64_t step, int64_t steps) override;
  void finish() override;
  void with_global_weights(const std::function<void()>& fn) override;
  std::vector<std::string> decisions() const override { return decisions_; }
  // outer_steps, outer_sync_seconds, hash_checks, rejected_updates; with [privacy]: dp_releases, dp_clipped,
  // dp_delta and dp_epsilon (with noise).
  std::map<std::string, double> metrics() const override;

  // Checkpoints happen between steps when no fragment is on the WAN (diloco: always).
  bool can_save() const override;
  void drain() override;
  void save_state(StrategyState& out) const override;
  void load_state(const StrategyState& in) override;
  // This worker's part of every fragment's outer state, read from the old workers' parts (or
  // rank 0's whole state) where they overlap it: no whole fragment is joined.
  void load_resharded(const std::vector<StrategyState>& ranks) override;
  // The sites compare how many outer steps they have taken; a site behind (its newest
  // checkpoint is older) takes the global weights, momentum and round position from the
  // site furthest ahead (the lowest-numbered one among equals), in one exchange.
  void reconcile() override;
  // Elastic rejoin: this site restarted while the others went on; it waits to be admitted
  // (at the start of a round of theirs) and takes the global state. The live sites admit a
  // lost site at the first round start after an exchange in which all of them reported a
  // fresh link from it, and run the same reconcile().
  void join() override;

  // For tests and metrics.
  int64_t outer_steps() const { return outer_steps_; }  // merges so far (fragments count each)
  int64_t rejected_updates() const { return rejected_updates_; }  // gateway: site updates the guard left out
  // Gateway: exchanges at which every site reported the same outer step id and the same hash
  // of the global weights it held before it (plus one final check in finish()).
  int64_t hash_checks() const { return hash_checks_; }
  int64_t rounds() const { return rounds_; }
  int64_t round_inner_steps() const { return round_steps_; }  // this site's H_s this round
  const std::string& codec_kind() const { return codec_kind_; }
  size_t num_fragments() const { return fragments_.size(); }
  // Fragment j's range of the flat parameter vector (flatten(params)): {offset, numel}.
  std::pair<int64_t, int64_t> fragment_range(size_t j) const { return {fragments_.at(j).offset, fragments_.at(j).numel}; }

 private:
  // A fragment (fragment_schedule.h: its range of the flat parameter vector and its pieces)
  // and its outer state.
  struct Fragment : FragmentCut {
    FragmentRange range() const { return {offset, numel}; }
    // This worker's part of the fragment: the runs of it (ShardRun: absolute flat index, index
    // in this worker's shard) the site's layout gives it, held one after another in `global`
    // and `momentum` (part_len values); the whole fragment, one run, unless the outer state is
    // sharded (set_sharding).
    std::vector<parallel::ShardRun> part;
    int64_t part_len = 0;
    at::Tensor global;               // θ_global of this worker's part (flat, float32)
    at::Tensor momentum;
    at::Tensor sent_local;           // θ_local of the part when last sent (delay > 0)
    at::Tensor delta;                // the whole fragment's, being exchanged (gateway; every_worker: this worker's cut)
    std::shared_ptr<collective::Work> work;  // in flight (gateway; every_worker: every worker)
    bool in_flight = false;          // sent, not merged (every worker)
    int64_t merge_at = 0;            // local step at which to merge
    double weight_at_send = 0;       // site weight processed up to the last send
    int64_t round = 0;               // round of the last send
    uint64_t seq = 0;                // send order
  };
  void send(size_t f);
  // `scale`: H / H_s, the heterogeneous sites' normalisation of the pseudo-gradient (send()).
  void send_through_gateway(Fragment& fr, double weight, double scale, double hash);
  void send_own_part(Fragment& fr, double weight, double scale, double hash);  // wan.mode = "every_worker"
  // Every site's holdings of fragment fr (Hierarchy::exchange_parts_async): the layout at that
  // site's number of workers (site_layout), sharded or not.
  collective::Holdings wan_holdings(const Fragment& fr) const;
  // The layout of a site of `workers` workers: ZeRO-3's units (set_unit_bounds), else one unit.
  parallel::ShardLayout site_layout(int64_t workers) const;
  // Site s's layout: its stages' (set_layouts), else site_layout at its number of workers.
  SiteLayout layout_of(size_t site) const;
  // Every rank of this site's part of fr (runs in flat order), by the site's layout.
  std::vector<std::vector<parallel::ShardRun>> site_parts(const Fragment& fr) const;
  // Whether this worker holds a pipeline stage's or a tensor slice's parameters only
  // (set_layouts), and whether its outer state is its part of each fragment (a stage's or a
  // slice's piece, or ZeRO's shard) rather than all.
  bool staged() const { return stage_group_ != nullptr; }
  // This site's tensor slices (set_layouts), or null.
  const parallel::SliceLayout* slices() const {
    return layouts_.empty() ? nullptr : std::get_if<parallel::SliceLayout>(&layouts_.at(options_.site_index));
  }
  bool parted() const { return parted_; }
  // The values params_ hold: the whole model's, or this worker's stage's (ZeRO-3's hold none).
  int64_t held_numel() const {
    int64_t n = 0;
    for (const auto& p : params_) n += p.numel();
    return n;
  }
  // The workers this worker's data parallel step runs over: its stage's replicas, or the site.
  collective::SiteGroup& data_group() const { return staged() ? *stage_group_ : comm_.site(); }
  // Staged: views of values [local, local + len) of this worker's stage (params_ flattened).
  std::vector<at::Tensor> stage_views(int64_t local, int64_t len) const;
  // Staged: fragment fr's values among this worker's stage's, [first, second).
  std::pair<int64_t, int64_t> stage_span(const Fragment& fr) const;
  // init()'s check with set_layouts or ZeRO-3 (no worker holds all to send): every site's
  // θ_global has global rank 0's CRC; `why` ends the error.
  void check_initial_weights(const std::string& why);
  // This worker's `part` gathered into the gateway's whole fragment `whole` (fr.numel values, in
  // flat order; undefined off the gateway), and back: site collectives.
  void gather_to_gateway(const Fragment& fr, const at::Tensor& part, const at::Tensor& whole);
  void scatter_from_gateway(const Fragment& fr, const at::Tensor& whole, const at::Tensor& part);
  void merge(size_t f);
  // init()'s and init_from_shard()'s common part: the fragments cut from the parameters'
  // `shapes`, and each one's θ_global (this worker's part when sharded) read run by run.
  using PartReader = std::function<at::Tensor(const Fragment& fr, const parallel::ShardRun& run)>;
  void init_fragments(const std::vector<std::vector<int64_t>>& shapes, const PartReader& read);
  void start_round(int64_t steps);
  void set_codec(const std::string& kind);
  // Fragment fr's values of the parameters as one float32 host vector, and back (in place).
  at::Tensor read_params(const Fragment& fr) const;
  // Values [begin, begin + len) of fragment fr's parameters, without reading the rest.
  at::Tensor read_range(const Fragment& fr, int64_t begin, int64_t len) const;
  void write_params(const Fragment& fr, const at::Tensor& flat) const;
  std::vector<at::Tensor> param_views(const Fragment& fr) const;  // flat views into params_
  // Views of the parameters of this worker's part of fr (its whole, unsharded), and their
  // values as one vector and back; after a write, spread_part() all-gathers the fragment's
  // parameters over the site (nothing unsharded).
  std::vector<at::Tensor> part_views(const Fragment& fr) const;
  at::Tensor read_part(const Fragment& fr) const { return flatten(part_views(fr)); }
  void write_part(const Fragment& fr, const at::Tensor& values) const { unflatten_into(values, part_views(fr)); }
  void spread_part(const Fragment& fr);
  std::vector<int64_t> part_counts(const Fragment& fr) const;  // every rank's part_len
  // This worker's part of a whole fragment's values (fr.numel, flat order).
  at::Tensor take_part(const Fragment& fr, const at::Tensor& whole) const;
  // Between `joined` (the runs' values one after another: parts in rank order) and `whole` (the
  // fragment from flat index `offset`, in flat order), either way.
  static void copy_runs(const std::vector<std::vector<parallel::ShardRun>>& parts, int64_t offset, const at::Tensor& whole,
                        const at::Tensor& joined, bool to_whole);
  std::vector<double> site_info() const;
  // The round position (round_position.h) as this object holds it, and back (codec, fragments'
  // rounds, info of the rounds included).
  RoundPosition position() const;
  void set_position(const RoundPosition& p);

  collective::Hierarchy& comm_;
  DilocoOptions options_;
  std::unique_ptr<codec::Codec> codec_;   // null = exact float32
  std::vector<std::unique_ptr<codec::Codec>> retired_;  // replaced by the controller, maybe in flight
  std::string codec_kind_;
  ControllerMemory controller_;  // what the controller decided last (round_planner.h)
  RoundPlannerOptions planner_;  // init(): the options and the model's size for every round's plan
  OuterSgd outer_;
  int64_t total_numel_ = 0;
  at::Tensor flat_params_;  // ZeRO (set_sharding): the parameters' flat buffer, N S values (ZeRO-3: this worker's S)
  bool gathered_ = true;    // flat_params_ holds every shard (ZeRO-1/2), else this worker's only (ZeRO-3)
  std::vector<int64_t> unit_bounds_;  // ZeRO-3's units; empty: one unit
  std::vector<SiteLayout> layouts_;   // set_layouts: every site's; empty: every site by site_layout
  std::vector<std::vector<int64_t>> layout_shapes_;  // set_layouts: the whole model's trainable shapes
  collective::SiteGroup* stage_group_ = nullptr;     // set_layouts on a staged site: its stage's replicas
  collective::SiteGroup* tensor_group_ = nullptr;    // set_layouts on a sliced site: its replica's slices
  int64_t shard_numel_ = 0;  // S; 0 = the outer state is whole
  bool expect_sharding_ = false;  // init() cuts the parts already (set_sharding follows)
  bool parted_ = false;           // each fragment's outer state is this worker's part (staged, or ZeRO)
  at::Tensor flat_grad_;    // ZeRO-2: the gradients' flat buffer, N S values
  bool round_open_ = false;
  uint64_t next_seq_ = 0;
  std::vector<at::Tensor> params_;
  std::vector<Fragment> fragments_;
  bool together_ = false;          // the fragments are staging_bytes' pieces of one outer step, sent together
  int64_t nominal_h_ = 0;          // H this round (before the heterogeneous scaling)
  int64_t round_steps_ = 0;        // H_s: this site's inner steps this round
  int64_t in_round_ = 0;           // inner steps done in this round
  size_t next_fragment_ = 0;       // the next fragment to send this round
  int64_t local_step_ = 0;
  int64_t rounds_ = 0, outer_steps_ = 0;
  int64_t rejected_updates_ = 0;   // gateway: contributions the update guard left out
  int64_t hash_checks_ = 0;        // gateway: exchanges whose ids and global-weight hashes agreed
  uint64_t joiners_due_ = 0;       // lost sites to admit at the next round start (every worker)
  void welcome();
  // CRC-32 of fragment f's θ_global (f = #fragments: all), valid on the gateway. A site
  // collective when the state is sharded (the parts' CRCs combined in order: the same value
  // for any number of workers), so every worker of the site calls it.
  double global_hash(size_t f);
  // Differential privacy (gateway).
  void privatize(at::Tensor& delta);
  // Noise standard deviation over the L2 sensitivity 2·dp_clip (see DilocoOptions).
  double dp_accounted_sigma() const { return options_.dp_noise_multiplier / 2; }
  std::mt19937_64 dp_rng_;
  privacy::RdpAccountant accountant_;
  int64_t dp_releases_ = 0, dp_clipped_ = 0;
  int64_t nominal_done_ = 0;       // Σ nominal H over finished rounds: the job's step count
  double site_weight_ = 0;         // tokens (weights) the site processed so far
  // The per-site numbers of the last fragment's exchange, by round (float-rounded on every
  // worker alike, so that all workers decide alike).
  std::vector<std::vector<float>> info_of_round_;
  // Timing of this worker's own inner steps this round: from the end of one after_step() to the
  // start of the next, so sends and merges (time blocked on the WAN) are left out.
  std::chrono::steady_clock::time_point last_step_end_;
  double compute_seconds_ = 0;
  int64_t timed_steps_ = 0;
  double outer_sync_seconds_ = 0;  // the training thread's time in sends and merges (blocked on the outer sync)
  MergeGap merge_gap_;             // this worker's (the gateway's goes in the site's info)
  std::vector<std::string> decisions_;
  // Model buffers (Strategy::set_buffers): averaged inside the site every step (with the
  // gradients) and over the sites with each round's last fragment (not with [privacy]).
  bool buffers_cross_sites() const { return buffer_numel_ > 0 && options_.dp_clip == 0; }
  int64_t buffer_numel_ = 0;
  at::Tensor buffers_sent_;                       // the buffers at the last fragment's send (every worker)
  at::Tensor buffer_mean_;                        // gateway: being exchanged
  std::shared_ptr<collective::Work> buffer_work_;  // gateway: in flight
  // Gateway: the last exchange's bytes over its whole time, per path. That time includes the
  // wait for the slowest site, so it is no measure of the link (the controller reads the link
  // estimates); > 0 also says an exchange has happened.
  double exchange_bits_per_s_ = 0;
};

}  // namespace nebula::strategy
