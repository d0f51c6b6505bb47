#include "strategy/quorum_ledger.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "nebula/error.h"

namespace nebula::strategy {
namespace {

constexpr size_t A = 0, B = 1, C = 2, D = 3;
constexpr double kA = 100, kB = 100, kC = 300, kD = 50;  // tokens per contribution

QuorumContribution from(size_t site, int64_t base, double tokens, bool final = false) {
  return {site, base, tokens, final};
}

QuorumEntry entry(size_t site, int64_t base, int64_t tau, double weight) { return {site, base, tau, weight}; }

void expect_record(const std::optional<QuorumRecord>& got, int64_t step, std::vector<QuorumEntry> merged,
                   std::vector<QuorumEntry> dropped = {}, std::vector<size_t> lost = {}, std::vector<size_t> admitted = {},
                   bool after_grace = false) {
  ASSERT_TRUE(got.has_value()) << "no record where step " << step << " was expected";
  EXPECT_EQ(got->step, step);
  ASSERT_EQ(got->merged.size(), merged.size()) << "step " << step;
  for (size_t i = 0; i < merged.size(); ++i) {
    EXPECT_EQ(got->merged[i].site, merged[i].site) << "step " << step << " entry " << i;
    EXPECT_EQ(got->merged[i].base, merged[i].base) << "step " << step << " entry " << i;
    EXPECT_EQ(got->merged[i].staleness, merged[i].staleness) << "step " << step << " entry " << i;
    EXPECT_DOUBLE_EQ(got->merged[i].weight, merged[i].weight) << "step " << step << " entry " << i;
  }
  EXPECT_EQ(got->dropped, dropped) << "step " << step;
  EXPECT_EQ(got->lost, lost) << "step " << step;
  EXPECT_EQ(got->admitted, admitted) << "step " << step;
  EXPECT_EQ(got->after_grace, after_grace) << "step " << step;
}

// A scripted arrival order on four sites, min_sites 2, alpha 0.5, max_staleness 2, against records
// written out by hand: a quorum recorded on the grace window, a late site merged with its
// staleness weight (tokens / sqrt(1 + tau)), a lost site (the quorum shrinks, the loss recorded),
// its rejoin (admitted by the next record, contributing from that step), a contribution too stale
// to merge (dropped, recorded), and the final contributions (the ledger is done).
std::vector<QuorumRecord> scripted(const std::function<void(const std::optional<QuorumRecord>&, int)>& check) {
  QuorumLedger q({4, 2, 0.5, 2});
  std::vector<QuorumRecord> out;
  int n = 0;
  auto see = [&](std::optional<QuorumRecord> r) {
    check(r, n++);
    if (r) out.push_back(*r);
  };
  see(q.contributed(from(A, 0, kA)));  // 0: one of two
  EXPECT_FALSE(q.waiting_for_grace());
  see(q.contributed(from(B, 0, kB)));  // 1: the quorum, not everyone: the grace timer starts
  EXPECT_TRUE(q.waiting_for_grace());
  see(q.grace_expired());              // 2: step 1 {A, B}
  EXPECT_FALSE(q.waiting_for_grace());
  see(q.grace_expired());              // 3: a timer that ran out after the record: nothing
  see(q.contributed(from(A, 1, kA)));  // 4
  see(q.contributed(from(C, 0, kC)));  // 5: C is late: based on step 0
  see(q.contributed(from(B, 1, kB)));  // 6
  see(q.contributed(from(D, 0, kD)));  // 7: everyone: step 2 at once, C and D with tau 1
  see(q.lost(D));                      // 8: nothing waiting: no record, the quorum shrinks to 3
  EXPECT_FALSE(q.member(D));
  see(q.contributed(from(A, 2, kA)));  // 9
  see(q.contributed(from(B, 2, kB)));  // 10
  see(q.contributed(from(C, 2, kC)));  // 11: the three active sites: step 3, D's loss in it
  q.rejoin(D);
  see(q.contributed(from(A, 3, kA)));  // 12
  see(q.contributed(from(B, 3, kB)));  // 13
  see(q.grace_expired());              // 14: step 4 {A, B}; D admitted from step 4
  EXPECT_TRUE(q.member(D));
  see(q.contributed(from(A, 4, kA)));  // 15
  see(q.contributed(from(B, 4, kB)));  // 16
  see(q.contributed(from(D, 4, kD)));  // 17: 3 of 4 (C is slow)
  see(q.grace_expired());              // 18: step 5 {A, B, D}
  see(q.contributed(from(C, 3, kC)));  // 19: C, based on step 3
  see(q.contributed(from(A, 5, kA)));  // 20
  see(q.contributed(from(B, 5, kB)));  // 21
  see(q.grace_expired());              // 22: step 6: C's tau 6 - 3 - 1 = 2 (kept), D not in
  see(q.contributed(from(D, 5, kD)));  // 23
  see(q.contributed(from(A, 6, kA)));  // 24
  see(q.contributed(from(B, 6, kB)));  // 25
  see(q.grace_expired());              // 26: step 7 {A, B, D}
  see(q.contributed(from(C, 6, kC)));  // 27: C based on 6
  see(q.contributed(from(A, 7, kA, true)));  // 28
  see(q.contributed(from(B, 7, kB, true)));  // 29
  see(q.grace_expired());              // 30: step 8 {A, B, C}: A and B leave with their finals
  EXPECT_FALSE(q.done());
  see(q.contributed(from(D, 7, kD)));  // 31: D and C are the active ones now: q = min(2, 2)
  see(q.contributed(from(C, 8, kC, true)));  // 32: step 9 {C, D}: C leaves
  see(q.contributed(from(D, 9, kD, true)));  // 33: D alone is the quorum: step 10, done
  EXPECT_TRUE(q.done());
  return out;
}

TEST(QuorumLedger, ScriptedArrivalsGiveTheHandComputedRecords) {
  const double half = std::pow(2.0, -0.5), third = std::pow(3.0, -0.5);
  auto check = [&](const std::optional<QuorumRecord>& r, int event) {
    switch (event) {
      case 2: expect_record(r, 1, {entry(A, 0, 0, kA), entry(B, 0, 0, kB)}, {}, {}, {}, true); break;
      case 7:
        expect_record(r, 2, {entry(A, 1, 0, kA), entry(B, 1, 0, kB), entry(C, 0, 1, kC * half), entry(D, 0, 1, kD * half)});
        break;
      case 11: expect_record(r, 3, {entry(A, 2, 0, kA), entry(B, 2, 0, kB), entry(C, 2, 0, kC)}, {}, {D}); break;
      case 14: expect_record(r, 4, {entry(A, 3, 0, kA), entry(B, 3, 0, kB)}, {}, {}, {D}, true); break;
      case 18: expect_record(r, 5, {entry(A, 4, 0, kA), entry(B, 4, 0, kB), entry(D, 4, 0, kD)}, {}, {}, {}, true); break;
      case 22:
        expect_record(r, 6, {entry(A, 5, 0, kA), entry(B, 5, 0, kB), entry(C, 3, 2, kC * third)}, {}, {}, {}, true);
        break;
      case 26: expect_record(r, 7, {entry(A, 6, 0, kA), entry(B, 6, 0, kB), entry(D, 5, 1, kD * half)}, {}, {}, {}, true); break;
      case 30: expect_record(r, 8, {entry(A, 7, 0, kA), entry(B, 7, 0, kB), entry(C, 6, 1, kC * half)}, {}, {}, {}, true); break;
      case 32: expect_record(r, 9, {entry(C, 8, 0, kC), entry(D, 7, 1, kD * half)}); break;
      case 33: expect_record(r, 10, {entry(D, 9, 0, kD)}); break;
      default: EXPECT_FALSE(r.has_value()) << "event " << event << " made step " << r->step;
    }
  };
  const auto first = scripted(check);
  EXPECT_EQ(first.size(), 10u);
  // The same events give the same records: nothing but the events decides.
  EXPECT_EQ(scripted(check), first);
}

// A contribution staler than max_staleness is dropped (recorded with weight 0), and its site
// contributes again from that record's step. Two sites, min_sites 1: A alone is a quorum, but B
// is active, so A's records wait for the grace window.
TEST(QuorumLedger, TooStaleIsDroppedAndRecorded) {
  QuorumLedger q({2, 1, 1.0, 1});
  EXPECT_FALSE(q.contributed(from(A, 0, kA)).has_value());
  EXPECT_TRUE(q.waiting_for_grace());
  expect_record(q.grace_expired(), 1, {entry(A, 0, 0, kA)}, {}, {}, {}, true);
  EXPECT_FALSE(q.contributed(from(A, 1, kA)).has_value());
  expect_record(q.grace_expired(), 2, {entry(A, 1, 0, kA)}, {}, {}, {}, true);
  EXPECT_FALSE(q.contributed(from(A, 2, kA)).has_value());
  // B, based on step 0, completes step 3: tau 3 - 0 - 1 = 2 > 1: dropped.
  expect_record(q.contributed(from(B, 0, kB)), 3, {entry(A, 2, 0, kA)}, {entry(B, 0, 2, 0)});
  EXPECT_FALSE(q.contributed(from(B, 3, kB)).has_value());
  expect_record(q.contributed(from(A, 3, kA)), 4, {entry(A, 3, 0, kA), entry(B, 3, 0, kB)});
}

// A site lost while the others wait for it: the quorum shrinks and the record is made at once.
// A lost site's waiting contribution is dropped with it.
TEST(QuorumLedger, LosingTheSiteEveryoneWaitsForRecordsAtOnce) {
  QuorumLedger q({3, 3, 0.5, 4});
  EXPECT_FALSE(q.contributed(from(A, 0, kA)).has_value());
  EXPECT_FALSE(q.contributed(from(B, 0, kB)).has_value());
  EXPECT_FALSE(q.waiting_for_grace());  // min_sites 3: no quorum yet
  expect_record(q.lost(C), 1, {entry(A, 0, 0, kA), entry(B, 0, 0, kB)}, {}, {C});
  EXPECT_FALSE(q.contributed(from(A, 1, kA)).has_value());
  EXPECT_FALSE(q.lost(A).has_value());  // B has nothing waiting
  expect_record(q.contributed(from(B, 1, kB)), 2, {entry(B, 1, 0, kB)}, {}, {A});
}

TEST(QuorumLedger, MisuseNamesTheSite) {
  auto throws_with = [](const std::function<void()>& f, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << "no error, expected one with '" << what << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  throws_with([] { QuorumLedger({0, 1}); }, "0 sites");
  throws_with([] { QuorumLedger({3, 4}); }, "min_sites = 4");
  throws_with([] { QuorumLedger({3, 0}); }, "min_sites = 0");
  throws_with([] { QuorumLedger({3, 2, -1}); }, "staleness exponent -1");
  throws_with([] { QuorumLedger({3, 2, 0.5, -1}); }, "max_staleness = -1");
  QuorumLedger q({3, 3});
  q.contributed(from(A, 0, kA));
  throws_with([&] { q.contributed(from(A, 0, kA)); }, "site 0 sent a second contribution");
  throws_with([&] { q.contributed(from(B, 1, kB)); }, "site 1's contribution is based on step 1");
  throws_with([&] { q.contributed(from(B, 0, 0)); }, "weighs 0 tokens");
  throws_with([&] { q.contributed(from(5, 0, kB)); }, "site 5 of 3");
  throws_with([&] { q.rejoin(B); }, "site 1 rejoins but is a member");
  q.lost(C);
  throws_with([&] { q.lost(C); }, "site 2 lost twice");
  throws_with([&] { q.contributed(from(C, 0, kC)); }, "not a member");
  QuorumLedger f({1, 1});
  f.contributed(from(A, 0, kA, true));
  EXPECT_TRUE(f.done());
  throws_with([&] { f.contributed(from(A, 1, kA)); }, "after its final one was merged");
}

}  // namespace
}  // namespace nebula::strategy
