// Asynchronous outer steps with a quorum (issue [5/7], first part): the sequencer's rules as a
// pure state machine. NOT YET WIRED into DilocoStrategy or the gateways; what it decides is what
// a later `sync = "quorum"` mode will apply.
//
// In lock-step diloco every outer step waits for every live site. With a quorum, one site's
// gateway (the sequencer) numbers the outer steps and decides which sites' pseudo-gradients go
// into each; every site applies the same records in the same order, so every site still ends
// every outer step with bit-identical global weights, and the same event order gives the same
// records. The ledger sees only events, never time or tensors:
//
//   contributed(c)   site c.site's pseudo-gradient is held by every member (so any record that
//                    names it can be applied everywhere). c.base = the outer steps the site had
//                    applied when its round began. A site has at most one contribution waiting:
//                    after sending it waits for the record that merges (or drops) it.
//   grace_expired()  the grace window, started when waiting_for_grace() turned true, ran out.
//   lost(s)          site s is gone: its waiting contribution is dropped, the quorum shrinks.
//   rejoin(s)        a lost site is ready again: admitted by the next record, from whose step
//                    it starts (given the global state at that step).
//
// The rule: with q = min(min_sites, active sites) (active: members whose last contribution is
// not yet merged, finished sites leave once their final one is), an outer step is recorded as
// soon as q sites have a contribution waiting and either every active site has one or the grace
// window expired. It merges every waiting contribution, each with staleness
// tau = step - base - 1 (0: based on the step just before) and weight tokens * (1 + tau)^-alpha;
// one staler than max_staleness is dropped (recorded, not merged). The weights are written into
// the record, so no site recomputes pow() (bit-identical everywhere). A record whose
// contributions were all dropped still takes a step number (nothing to apply).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace nebula::strategy {

struct QuorumOptions {
  size_t num_sites = 0;
  size_t min_sites = 1;             // contributions an outer step needs (fewer active sites: all of them)
  double staleness_exponent = 0.5;  // alpha in tokens * (1 + tau)^-alpha
  int64_t max_staleness = 4;        // a contribution staler than this is dropped
};

struct QuorumContribution {
  size_t site = 0;
  int64_t base = 0;     // outer steps applied when its round began
  double tokens = 0;    // its weight before staleness (tokens, FedNova-scaled as in lock-step)
  bool final = false;   // the site's last: it leaves the quorum once this is merged
};

struct QuorumEntry {
  size_t site = 0;
  int64_t base = 0;
  int64_t staleness = 0;  // tau
  double weight = 0;      // tokens * (1 + tau)^-alpha (0 when dropped)
  bool operator==(const QuorumEntry&) const = default;
};

struct QuorumRecord {
  int64_t step = 0;                   // 1, 2, ...: the outer step this record makes
  std::vector<QuorumEntry> merged;    // by site
  std::vector<QuorumEntry> dropped;   // too stale (by site)
  std::vector<size_t> lost;           // sites lost since the previous record (their waiting contribution dropped)
  std::vector<size_t> admitted;       // sites that rejoin from this step
  bool after_grace = false;           // recorded on the grace window, not because every active site was in
  bool operator==(const QuorumRecord&) const = default;
};

class QuorumLedger {
 public:
  // Throws ConfigError for num_sites outside [1, 64], min_sites outside [1, num_sites], a
  // negative alpha or max_staleness.
  explicit QuorumLedger(QuorumOptions options);

  // Each event returns the record it completes, if any. Misuse (a second waiting contribution
  // from a site, one from a site that is not a member, from the future or after its final,
  // losing a site twice, rejoining a member) throws Error naming the site.
  std::optional<QuorumRecord> contributed(const QuorumContribution& c);
  std::optional<QuorumRecord> grace_expired();
  std::optional<QuorumRecord> lost(size_t site);
  void rejoin(size_t site);

  // The quorum is there but not every active site: the driver starts the grace timer.
  bool waiting_for_grace() const;
  int64_t steps() const { return step_; }
  bool member(size_t site) const;
  // No active site is left: every member merged its final contribution.
  bool done() const;

 private:
  std::optional<QuorumRecord> maybe_record(bool grace);
  bool quorum() const;  // q contributions wait (q = min(min_sites, active sites))
  size_t active() const;
  size_t waiting() const;

  QuorumOptions o_;
  int64_t step_ = 0;
  std::vector<bool> member_, finished_;          // finished: final contribution merged
  std::vector<int64_t> since_;                   // a site's last merge or admission: its next base is at least this
  std::vector<std::optional<QuorumContribution>> waiting_;
  std::vector<size_t> lost_since_, rejoining_;
};

}  // namespace nebula::strategy
