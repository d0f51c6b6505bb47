#include "strategy/quorum_ledger.h"

#include <algorithm>
#include <cmath>

#include "nebula/error.h"

namespace nebula::strategy {

QuorumLedger::QuorumLedger(QuorumOptions options) : o_(options) {
  if (o_.num_sites < 1 || o_.num_sites > 64)
    throw ConfigError(str_cat("quorum: ", o_.num_sites, " sites; want 1 to 64"));
  if (o_.min_sites < 1 || o_.min_sites > o_.num_sites)
    throw ConfigError(str_cat("quorum: min_sites = ", o_.min_sites, "; want 1 to the job's ", o_.num_sites, " sites"));
  if (!(o_.staleness_exponent >= 0) || !std::isfinite(o_.staleness_exponent))
    throw ConfigError(str_cat("quorum: staleness exponent ", o_.staleness_exponent, "; want a finite value >= 0"));
  if (o_.max_staleness < 0) throw ConfigError(str_cat("quorum: max_staleness = ", o_.max_staleness, "; want >= 0"));
  member_.assign(o_.num_sites, true);
  finished_.assign(o_.num_sites, false);
  waiting_.resize(o_.num_sites);
  since_.assign(o_.num_sites, 0);
}

bool QuorumLedger::member(size_t site) const { return site < o_.num_sites && member_[site]; }

size_t QuorumLedger::active() const {
  size_t n = 0;
  for (size_t s = 0; s < o_.num_sites; ++s) n += member_[s] && !finished_[s];
  return n;
}

size_t QuorumLedger::waiting() const {
  size_t n = 0;
  for (const auto& w : waiting_) n += w.has_value();
  return n;
}

bool QuorumLedger::done() const { return active() == 0; }

bool QuorumLedger::quorum() const {
  const size_t a = active();
  return a > 0 && waiting() >= std::min(o_.min_sites, a);
}

bool QuorumLedger::waiting_for_grace() const { return quorum() && waiting() < active(); }

std::optional<QuorumRecord> QuorumLedger::contributed(const QuorumContribution& c) {
  NEBULA_CHECK(c.site < o_.num_sites, "quorum: a contribution from site ", c.site, " of ", o_.num_sites);
  NEBULA_CHECK(member_[c.site], "quorum: a contribution from site ", c.site,
               ", which is not a member (lost; rejoin it first)");
  NEBULA_CHECK(!finished_[c.site], "quorum: a contribution from site ", c.site, " after its final one was merged");
  NEBULA_CHECK(!waiting_[c.site], "quorum: site ", c.site, " sent a second contribution while its first (base ",
               waiting_[c.site] ? waiting_[c.site]->base : 0, ") waits; a site waits for the record that merges it");
  NEBULA_CHECK(c.base >= since_[c.site] && c.base <= step_, "quorum: site ", c.site, "'s contribution is based on step ",
               c.base, "; want ", since_[c.site], " (its last merge or admission) to ", step_, " (the latest)");
  NEBULA_CHECK(std::isfinite(c.tokens) && c.tokens > 0, "quorum: site ", c.site, "'s contribution weighs ", c.tokens,
               " tokens; want > 0");
  waiting_[c.site] = c;
  return maybe_record(false);
}

std::optional<QuorumRecord> QuorumLedger::grace_expired() {
  if (!waiting_for_grace()) return std::nullopt;  // a timer that ran out after the record was made
  return maybe_record(true);
}

std::optional<QuorumRecord> QuorumLedger::lost(size_t site) {
  NEBULA_CHECK(site < o_.num_sites, "quorum: site ", site, " of ", o_.num_sites, " lost");
  NEBULA_CHECK(member_[site], "quorum: site ", site, " lost twice");
  member_[site] = false;
  waiting_[site].reset();
  lost_since_.push_back(site);
  return maybe_record(false);  // the quorum may now be whole without it
}

void QuorumLedger::rejoin(size_t site) {
  NEBULA_CHECK(site < o_.num_sites, "quorum: site ", site, " of ", o_.num_sites, " rejoins");
  NEBULA_CHECK(!member_[site], "quorum: site ", site, " rejoins but is a member");
  if (std::find(rejoining_.begin(), rejoining_.end(), site) == rejoining_.end()) rejoining_.push_back(site);
}

std::optional<QuorumRecord> QuorumLedger::maybe_record(bool grace) {
  if (!quorum()) return std::nullopt;
  const size_t a = active(), w = waiting();
  if (w < a && !grace) return std::nullopt;  // the quorum, but not everyone: the grace window decides
  QuorumRecord r;
  r.step = ++step_;
  r.after_grace = w < a;
  for (size_t s = 0; s < o_.num_sites; ++s) {
    if (!waiting_[s]) continue;
    const QuorumContribution c = *waiting_[s];
    waiting_[s].reset();
    QuorumEntry e{s, c.base, r.step - c.base - 1, 0};
    since_[s] = r.step;
    if (c.final) finished_[s] = true;
    if (e.staleness > o_.max_staleness) {
      r.dropped.push_back(e);
      continue;
    }
    e.weight = c.tokens * std::pow(1.0 + static_cast<double>(e.staleness), -o_.staleness_exponent);
    r.merged.push_back(e);
  }
  std::sort(lost_since_.begin(), lost_since_.end());
  r.lost = std::move(lost_since_);
  lost_since_.clear();
  std::sort(rejoining_.begin(), rejoining_.end());
  for (size_t s : rejoining_) {
    member_[s] = true;
    finished_[s] = false;
    since_[s] = r.step;
  }
  r.admitted = std::move(rejoining_);
  rejoining_.clear();
  return r;
}

}  // namespace nebula::strategy
