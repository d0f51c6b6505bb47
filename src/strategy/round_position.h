// Where a diloco / streaming job stands between steps: the counters of rounds and outer steps,
// the round in progress, the controller's memory, the codec and the per-site numbers the next
// rounds' decisions rest on. Two encodings, both fixed formats that must not change (old
// checkpoints load, and sites of different builds agree):
//
//   checkpoints  StrategyState numbers "rounds", "outer_steps", ..., "f<j>/round",
//                "info/<round>/<k>" (the last two rounds'), and strings["codec"];
//   reconcile    one vector of doubles that the site furthest ahead sends to the others with the
//                exchange (Hierarchy site_info): [next_seq, rounds, outer_steps, nominal_done,
//                round_open, nominal_h, in_round, next_fragment, controller h, decided,
//                decided_measured, codec index], F fragment rounds, then for each of the last two
//                rounds its info's length and values, then the controller's ceiling (newer
//                builds; "controller_ceiling" in checkpoints, absent when 0). It leaves round_steps out: a site that
//                adopts a position runs the round without the heterogeneous scaling.
//
// Also the verdict of reconcile (which site leads, who adopts its state).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "strategy/round_planner.h"
#include "strategy/strategy.h"

namespace nebula::strategy {

struct RoundPosition {
  uint64_t next_seq = 0;          // the next outer step id (fragments' sends, in order)
  int64_t rounds = 0;             // rounds finished (all fragments sent)
  int64_t outer_steps = 0;        // merges so far
  int64_t nominal_done = 0;       // Σ nominal H over finished rounds: the job's step count
  bool round_open = false;
  int64_t nominal_h = 0;          // H this round
  int64_t round_steps = 0;        // H_s this round (checkpoints only)
  int64_t in_round = 0;           // inner steps done this round
  size_t next_fragment = 0;       // the next fragment to send this round
  ControllerMemory controller;
  std::string codec;              // the codec in use ("" = leave the current one)
  std::vector<int64_t> fragment_rounds;            // per fragment: round of its last send
  std::vector<std::vector<float>> info_of_round;   // per round: every site's info (round_planner.h)

  // Checkpoints: writes the keys above into out.numbers and out.strings.
  void save(StrategyState& out) const;
  // Reads them back for `fragments` fragments; DataError naming a missing key.
  static RoundPosition load(const StrategyState& in, size_t fragments);
  // Reconcile's vector, and back (p: at least as many values as to_vector() gave the sender,
  // zeros after them);
  // round_steps comes back as nominal_h. Throws Error for a codec without an index.
  std::vector<double> to_vector() const;
  static RoundPosition from_vector(const double* p, size_t fragments);
};

// A number of a checkpoint's strategy state; DataError naming it if missing.
double state_number(const StrategyState& in, const std::string& name);

// reconcile(): from every site's (outer step id, global hash) (exchange_positions; empty for a
// lost site), the site furthest ahead (the lowest-numbered among equals), whether any site
// differs from it, and whether this site (`me`) does, and so takes its state.
struct ReconcileVerdict {
  size_t leader = 0;
  bool any = false, adopt = false;
};
ReconcileVerdict reconcile_verdict(const std::vector<std::vector<double>>& positions, size_t me);

}  // namespace nebula::strategy
