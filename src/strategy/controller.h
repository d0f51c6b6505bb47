// The adaptive controller: from the measured WAN (bandwidth, RTT) and the measured compute
// time per inner step, chooses the codec and the number of inner steps H between
// synchronizations for diloco / streaming, so that communication stays hidden behind compute
// with the least compression that allows it. Any choice can be pinned in the config
// (strategy.codec != "auto", strategy.inner_steps > 0); the controller then only chooses the
// other one.
//
// The cost model (also what `docs/architecture.md` states):
//   payload(codec)  = bytes one site sends per full-model exchange (codec_payload_bytes)
//   t_wan           = rtt + payload / bandwidth            (each site pair is its own path;
//                   a bandwidth that is only a lower bound, from exchanges too small to fill the
//                   path, makes t_wan an upper bound: the choice is safe, maybe over-compressed)
//   diloco          blocking: the WAN adds t_wan / H per inner step; hidden enough when
//                   t_wan <= max_overhead * H * t_step
//   streaming       F fragments, each merged `delay` inner steps after it is sent: hidden when
//                   each fragment's exchange fits in its delay, t_wan(F) <= delay * t_step,
//                   and the F exchanges of a round fit in the round, F * t_wan(F) <= H * t_step
// Candidates (codec x H: none, fp16, int8, int4, sparseloco x 10 ... 1000; sparseloco only with
// strategy.outer_momentum = 0, see ControllerPins, and not while watching quality) are tried from the
// least total reduction of WAN traffic up, H x the codec's ratio to float32 (ties: smaller H
// first), and the first feasible pair wins: the most information per second that the WAN can
// carry while hidden. ("The least compression" counts both factors: on the demo, README,
// diloco with int4 at H = 50 ended 0.3 % above sync's validation loss, at H = 100 2.8 %.) If none is feasible the most compressed codec with the
// largest H is chosen, and the reason says the WAN cannot be hidden.
//
// Watching quality (strategy.max_loss_penalty = B > 0, diloco): the objective becomes the fewest
// WAN bytes whose measured quality cost stays within B. The measure is the merge gap: each site
// compares its training loss on the first m steps after an outer step (the merged model) with
// what its local model's loss was heading to before it (the last m steps of the round,
// extrapolated m steps along the round's own trend; m = min(10, H / 4)), relative to it
// (diloco.h, "merge gap"). The sites' mean gap for a setting (codec, H) moves the choice along
// the candidates ordered by reduction, from a fixed start (int4, H = 50, or the pinned codec / H).
// Sparseloco is not among them unless pinned: what it costs is the progress its error feedback
// holds back round after round, and a gap is bounded by one round's progress (bench/frontier.sh:
// a 0.96 % gap at 5,600x where the penalty against sync was 8.67 %), so the gap would let it in.
// Step time and bandwidth play no part: the choices rest on the training losses alone, so a
// job's decisions are the same from run to run when its losses are (the demo's are). Taking the gap as
// proportional to the reduction, the most reduction within the budget is R · B / gap (R the
// current reduction):
//   gap > B        back off: to the largest reduction at most that and at most twice the H in
//                  use (else the least there is),
//                  and never again to R or above (the ceiling, the lowest reduction measured
//                  over the budget);
//   gap <= B       climb: to the largest reduction at most that, at most 4 R, at most twice
//                  the H in use and below the ceiling; stay when there is none. (The model is
//                  fitted at one H, and the sites' drift grows with H faster than the gap at a
//                  short H foretells: bench/frontier.sh's controller climbed from int8 H = 100,
//                  gap 0.59 %, to none H = 1000 and ended 4.4 % above sync.)
// A gap is evidence only for the setting it was measured at (each site sends that setting's
// reduction with it); after a move the controller waits for the new setting's gaps, and acts on
// their mean once every site has measured kMergeGapsToAct of them in a row (one gap is noisy:
// merge_gap.h). The gap is a
// proxy, not the penalty against data parallelism at equal tokens: bench/frontier.sh measures
// that for the controller's choice beside the grid.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "codec/codec.h"

namespace nebula::strategy {

struct ControllerInput {
  double step_seconds = 0;          // compute time per inner step of the slowest site; 0 = unknown
  double bandwidth_bits_per_s = 0;  // the slowest measured site-to-site path; 0 = unknown
  // That figure is a lower bound (transport LinkEstimates::bandwidth_at_least): the exchanges so
  // far were too small to fill the path. The time rules then hold for a path at least that
  // fast: a choice they call hidden is hidden, but it may compress more than the path needs,
  // and the reason writes the figure as ">= x".
  bool bandwidth_at_least = false;
  double rtt_s = 0;                 // the longest measured round trip
  int64_t params = 0;               // values synchronized per full exchange (trainable parameters)
  int64_t fragments = 1;            // streaming: F (1 for diloco)
  int64_t delay = 0;                // streaming: inner steps a fragment may take to arrive (0: blocking)
  // Watching quality (pins.max_loss_penalty > 0): the setting in use (codec "" = none yet), the
  // sites' mean merge gap, the reduction of the setting it was measured at (0 = none) and the
  // fewest gaps in a row any site's mean holds, and the ceiling so far (0 = none).
  std::string codec;
  int64_t inner_steps = 0;
  double merge_gap = 0, gap_reduction = 0, gap_count = 0, ceiling = 0;
};

struct ControllerPins {
  std::string codec = "auto";       // a codec name pins it
  int64_t inner_steps = 0;          // > 0 pins H
  double max_overhead = 0.05;       // blocking exchanges may add at most this fraction to compute
  codec::CodecOptions codec_options;  // density / block for the payload sizes
  // The outer optimizer's momentum. SparseLoCo's decayed error feedback stands in for outer
  // momentum; with both, the update is carried twice (docs/strategies.md), so an unpinned codec
  // is never sparseloco while this is > 0, and the reason says so.
  double outer_momentum = 0;
  // > 0: choose the fewest WAN bytes whose measured merge gap stays within this (above).
  double max_loss_penalty = 0;
};

struct ControllerChoice {
  std::string codec;
  int64_t inner_steps = 0;
  bool hidden = false;              // the model says the WAN is hidden (within max_overhead)
  std::string reason;               // one line: the numbers behind the choice
  double ceiling = 0;               // watching quality: the reduction not to reach again (0 = none)
  bool on_gap = false;              // watching quality: decided on a merge gap measured at the setting in use
};

// Gaps in a row at one setting, on every site, before the controller acts on their mean.
constexpr int64_t kMergeGapsToAct = 2;

// The codecs the controller chooses among, least compression first.
const std::vector<std::string>& controller_codecs();
// The H values it tries, smallest first.
const std::vector<int64_t>& controller_inner_steps();

// Bytes one site puts on the WAN for `params` values with this codec: plan::payload_bytes with
// the [strategy] codec options. Throws ConfigError for a codec it has no model for (powersgd:
// its size depends on the tensors' shapes).
double codec_payload_bytes(const std::string& codec, int64_t params, const codec::CodecOptions& options);

// How many times fewer bytes `codec` at H = h sends than float32 every step: h · 4 · params /
// codec_payload_bytes (what the candidates are ordered by).
double setting_reduction(const std::string& codec, int64_t h, int64_t params, const codec::CodecOptions& options);

// Deterministic: the same input gives the same choice on every site.
ControllerChoice decide(const ControllerInput& in, const ControllerPins& pins);

}  // namespace nebula::strategy
