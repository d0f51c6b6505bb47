// Planning a round of diloco / streaming: how many inner steps this site runs and which codec
// the exchanges use, from the per-site numbers of the last exchange every site has surely
// merged (so that every site plans alike).
//
// Each exchange carries, per site, kSiteInfo values: [seconds of compute per inner step,
// the slowest of its measured WAN paths (bits/s), its longest RTT (s), 1 + the bitmask of lost
// sites its gateway has a fresh link from, its merge gap (the mean of those measured in a row
// at one setting), the reduction of that setting, 1 if that bandwidth is only a lower bound, how
// many gaps the mean holds] (0 = not measured / sent nothing; controller.h, "Watching quality").
//
//   codec and H   pinned by the options, or the adaptive controller's (controller.h) when
//                 codec = "auto" or inner_steps = 0: once before any measurement, again the
//                 first time measurements exist, and every round if adaptive;
//   H_s           this site's inner steps: H, or with heterogeneous sites
//                 max(H, round(H · t_slowest / t_mine)), so that all reach each exchange together.
//
// Pure functions on plain values; the controller's memory (ControllerMemory) is the caller's,
// saved in checkpoints and carried by reconcile (round_position.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "codec/codec.h"

namespace nebula::strategy {

constexpr size_t kSiteInfo = 8;  // values per site in an exchange's info (above)

// The slowest of several WAN paths' bandwidth figures, and whether it is only a lower bound
// (LinkEstimates::bandwidth_at_least; of paths equally slow, a bound if any is). A site takes it
// over its links, the planner over the sites.
struct SlowestPath {
  double bits_per_s = 0;  // 0 = none measured
  bool at_least = false;
  void add(double bits, bool bound) {
    if (bits <= 0) return;
    if (bits_per_s <= 0 || bits < bits_per_s) {
      bits_per_s = bits;
      at_least = bound;
    } else if (bits == bits_per_s) {
      at_least = at_least || bound;
    }
  }
};

// The per-site info every site is sure to have merged when round `rounds` starts: the previous
// round's last exchange with delay 0, else the one before it (every site's, kSiteInfo each;
// float-rounded alike on every worker). Empty before there is one.
std::vector<float> known_info(const std::vector<std::vector<float>>& info_of_round, int64_t rounds, int64_t delay);

// What the controller decided last (every site alike).
struct ControllerMemory {
  bool decided = false;           // it ran
  bool decided_measured = false;  // it ran on measurements
  int64_t h = 0;                  // its H
  double ceiling = 0;             // watching quality: the reduction whose gap went over budget (0 = none)
};

struct RoundPlannerOptions {
  std::string codec = "none";     // "auto": the controller's choice
  int64_t inner_steps = 50;       // 0: the controller's choice
  bool adaptive = true;           // re-decide every round once measured (else once measured)
  bool heterogeneous = true;      // H_s scales with the sites' step times
  codec::CodecOptions codec_options;
  double outer_momentum = 0;  // the outer optimizer's: > 0 keeps the controller from choosing sparseloco
  double max_loss_penalty = 0;  // > 0: the controller watches quality (controller.h), every round
  size_t site_index = 0;
  int64_t params = 0;             // values per full exchange
  int64_t fragments = 1;
  int64_t delay = 0;
};

// The state a plan starts from.
struct RoundPlanInput {
  std::vector<float> info;        // known_info()
  int64_t rounds = 0;             // rounds done (this round's index, for the decision lines)
  int64_t steps = 0;              // the job's inner steps
  int64_t nominal_done = 0;       // Σ nominal H over finished rounds
  int64_t round_steps = 0;        // last round's H_s
  std::string codec;              // the codec in use
};

struct RoundPlan {
  std::string codec;              // the codec to use this round (== the input's unless changed)
  int64_t nominal_h = 0;          // H this round (capped at the job's steps left)
  int64_t round_steps = 0;        // H_s
  // Decision lines, empty when there is nothing new to say: the controller's choice (logged as
  // "controller: ...") and this site's H_s (when it differs from H, or goes back to it).
  std::string controller_line, steps_line;
};

// Updates `memory` when the controller runs.
RoundPlan plan_round(const RoundPlannerOptions& options, const RoundPlanInput& in, ControllerMemory& memory);

}  // namespace nebula::strategy
