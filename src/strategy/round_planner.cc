#include "strategy/round_planner.h"

#include <algorithm>
#include <cmath>

#include "nebula/error.h"
#include "strategy/controller.h"

namespace nebula::strategy {

std::vector<float> known_info(const std::vector<std::vector<float>>& info_of_round, int64_t rounds, int64_t delay) {
  // With delay 0 the previous round's last exchange is merged when this round starts; with a
  // delay only the one before it is sure to be, on every site.
  const int64_t lag = delay == 0 ? 1 : 2;
  const int64_t r = rounds - lag;
  if (r < 0 || static_cast<size_t>(r) >= info_of_round.size()) return {};
  return info_of_round[static_cast<size_t>(r)];
}

RoundPlan plan_round(const RoundPlannerOptions& options, const RoundPlanInput& in, ControllerMemory& memory) {
  const std::vector<float>& info = in.info;
  // Per site: [seconds per step, bandwidth, rtt]; the slowest site paces the job.
  double slowest = 0, mine = 0, rtt = 0;
  SlowestPath path;
  // The merge gap: the mean of the sites that measured one, when all measured the same setting.
  double gap_sum = 0, gap_reduction = 0, gap_count = 0;  // gap_count: the fewest any site's mean holds
  int gaps = 0;
  bool same_setting = true;
  for (size_t s = 0; s + kSiteInfo <= info.size(); s += kSiteInfo) {
    slowest = std::max(slowest, static_cast<double>(info[s]));
    path.add(info[s + 1], info[s + 6] > 0);
    rtt = std::max(rtt, static_cast<double>(info[s + 2]));
    if (info[s + 5] > 0) {
      same_setting = same_setting && (gaps == 0 || info[s + 5] == static_cast<float>(gap_reduction));
      gap_reduction = info[s + 5];
      gap_sum += info[s + 4];
      gap_count = gaps == 0 ? info[s + 7] : std::min(gap_count, double(info[s + 7]));
      ++gaps;
    }
  }
  if (!info.empty() && options.site_index * kSiteInfo < info.size()) mine = info[options.site_index * kSiteInfo];

  RoundPlan plan;
  plan.codec = in.codec;
  // Codec and H: pinned, or the controller's (once measured; every round if adaptive).
  int64_t h = options.inner_steps;
  if (options.codec == "auto" || options.inner_steps == 0) {
    const bool measured = slowest > 0 && path.bits_per_s > 0;
    const bool quality = options.max_loss_penalty > 0;
    // Watching quality, every round from the setting in use: the gaps need no time measurements.
    if (!memory.decided || quality || (options.adaptive && measured) || (measured && !memory.decided_measured)) {
      ControllerInput ci{slowest, path.bits_per_s, path.at_least, rtt, options.params, options.fragments, options.delay};
      if (quality && memory.decided) {  // from the setting in use
        ci.codec = in.codec;
        ci.inner_steps = memory.h;
        if (gaps > 0 && same_setting) {
          ci.merge_gap = gap_sum / gaps;
          ci.gap_reduction = gap_reduction;
          ci.gap_count = gap_count;
        }
        ci.ceiling = memory.ceiling;
      }
      ControllerPins pins;
      pins.codec = options.codec;
      pins.inner_steps = options.inner_steps;
      pins.codec_options = options.codec_options;
      pins.outer_momentum = options.outer_momentum;
      pins.max_loss_penalty = options.max_loss_penalty;
      ControllerChoice choice = decide(ci, pins);
      // Logged when it changes, the first time it rests on measurements, and each time it acts
      // on a measured merge gap.
      if (!memory.decided || (!quality && measured && !memory.decided_measured) || choice.codec != in.codec ||
          choice.inner_steps != memory.h || choice.on_gap)
        plan.controller_line =
            str_cat("round ", in.rounds, ": codec ", choice.codec, ", H ", choice.inner_steps, " — ", choice.reason);
      plan.codec = choice.codec;
      memory.h = choice.inner_steps;
      memory.ceiling = choice.ceiling;
      memory.decided = true;
      memory.decided_measured = memory.decided_measured || measured;
    }
    h = memory.h;
  }
  plan.nominal_h = std::min<int64_t>(h, in.steps - in.nominal_done);
  // Heterogeneous sites: the slowest runs H, a faster one proportionally more.
  int64_t mine_h = plan.nominal_h;
  if (options.heterogeneous && slowest > 0 && mine > 0)
    mine_h = std::max<int64_t>(plan.nominal_h, std::llround(static_cast<double>(plan.nominal_h) * slowest / mine));
  // Said when heterogeneous sites change it (with the times it rests on); without them a round
  // runs H (the last one cut to the job's steps), nothing to say and no timing in the log.
  if (options.heterogeneous && mine_h != in.round_steps && (mine_h != plan.nominal_h || in.round_steps > plan.nominal_h))
    plan.steps_line = str_cat("round ", in.rounds, ": this site runs ", mine_h, " inner steps (H ", plan.nominal_h, "; ",
                              mine * 1e3, " ms per step here, ", slowest * 1e3, " ms at the slowest site)");
  plan.round_steps = mine_h;
  return plan;
}

}  // namespace nebula::strategy
