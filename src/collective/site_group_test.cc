#include "collective/site_group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "collective/testing.h"
#include "nebula/error.h"

namespace nebula::collective {
namespace {

using namespace std::chrono_literals;

// Port 0 on rank 0: the store binds a port of the kernel's choosing, reports it before the
// rendezvous and through store_port(); the other ranks join on that port.
TEST(SiteGroup, PortZeroOnRankZeroBindsAndPublishesTheRealPort) {
  testing::StorePort port;
  uint16_t reported = 0;
  std::exception_ptr error;
  std::thread other([&] {
    try {
      SiteGroup g = testing::join_group("pair", 1, 2, 30s, port);
      EXPECT_NE(g.store_port(), 0);
      at::Tensor t = at::full({3}, 2.0f);
      g.allreduce_sum(t);
      EXPECT_TRUE(at::equal(t, at::full({3}, 3.0f)));
      g.barrier();
    } catch (...) {
      error = std::current_exception();
    }
  });
  {
    SiteGroup g("pair", "127.0.0.1", 0, 0, 2, 30s, [&](uint16_t p) {
      reported = p;
      port.publish(p);
    });
    EXPECT_NE(g.store_port(), 0);
    EXPECT_EQ(g.store_port(), reported);
    at::Tensor t = at::full({3}, 1.0f);
    g.allreduce_sum(t);
    EXPECT_TRUE(at::equal(t, at::full({3}, 3.0f)));
    g.barrier();
  }
  other.join();
  if (error) std::rethrow_exception(error);
}

TEST(SiteGroup, PortZeroOnAnotherRankIsAnError) {
  EXPECT_THROW(SiteGroup("s", "127.0.0.1", 0, 1, 2, 1s), Error);
}

// A rank waiting for a port that is never published gives up after its timeout, not never.
TEST(SiteGroup, WaitingForAnUnpublishedPortIsBounded) {
  testing::StorePort port;
  EXPECT_THROW(testing::join_group("s", 1, 2, 200ms, port), Timeout);
}

// A collective that a peer never joins fails within the group's timeout, and the error names the
// key that bounds it (a gateway's long evaluation outlasted job.timeout on a 57.5M model).
TEST(SiteGroup, ATimedOutCollectiveNamesJobTimeout) {
  testing::StorePort port;
  std::promise<void> failed;
  std::thread other([&] {
    SiteGroup g = testing::join_group("late", 1, 2, 1s, port);
    failed.get_future().wait();  // joins no collective until rank 0's has timed out
  });
  {
    SiteGroup g = testing::join_group("late", 0, 2, 1s, port);
    at::Tensor t = at::ones({4});
    try {
      g.allreduce_sum(t);
      ADD_FAILURE() << "an all-reduce with a peer that never joins returned";
    } catch (const PeerLost& e) {
      EXPECT_NE(std::string(e.what()).find("site late: intra-site"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("[job] timeout"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("job.timeout"), std::string::npos) << e.what();
    }
    failed.set_value();
  }
  other.join();
}

// The sharded collectives against what they must equal: reduce_scatter_sum is allreduce
// then slice (exactly, on integers-valued floats), all_gather is every shard in rank order;
// and bad shapes are errors naming the sizes.
void check_sharded_collectives(int size, int64_t shard) {
  testing::run_site("ring", size, [&](SiteGroup& g) {
    const int r = g.rank();
    at::Tensor mine = at::arange(size * shard, at::kFloat).mul_(r + 1).add_(r * 1000);
    at::Tensor reference = mine.clone();
    g.allreduce_sum(reference);
    at::Tensor scratch = mine.clone(), got = at::empty({shard});
    g.reduce_scatter_sum(scratch, got);
    EXPECT_TRUE(at::equal(got, reference.narrow(0, r * shard, shard))) << "rank " << r << " of " << size;
    // In place: the shard is the full tensor's own chunk (ZeRO-2's flat gradients).
    at::Tensor in_place = mine.clone();
    at::Tensor own = in_place.narrow(0, r * shard, shard);
    g.reduce_scatter_sum(in_place, own);
    EXPECT_TRUE(at::equal(own, reference.narrow(0, r * shard, shard))) << "in place, rank " << r << " of " << size;

    at::Tensor piece = at::full({shard}, static_cast<float>(r + 1)), full = at::empty({size * shard});
    g.all_gather(piece, full);
    for (int i = 0; i < size; ++i)
      EXPECT_TRUE(at::equal(full.narrow(0, i * shard, shard), at::full({shard}, float(i + 1))))
          << "shard " << i << " on rank " << r;

    at::Tensor odd = at::zeros({size * shard + 1}), small = at::empty({shard});
    try {
      g.reduce_scatter_sum(odd, small);
      ADD_FAILURE() << "an indivisible tensor was reduce-scattered";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("pad it to a multiple"), std::string::npos) << e.what();
    }
  });
}

// Point-to-point: sends posted before any receive, received in another order than posted,
// match by (rank, tag); a subgroup's collectives see its ranks only; a subgroup that does not
// include the caller is refused.
TEST(SiteGroup, SendRecvMatchByTagAndSubgroupsSeeTheirRanksOnly) {
  testing::run_site("p2p", 4, [](SiteGroup& group) {
    const int r = group.rank(), next = (r + 1) % 4, prev = (r + 3) % 4;
    const at::Tensor a = at::full({3}, 10.0f * r), b = at::full({2, 2}, 10.0f * r + 1);
    group.send(a, next, 7);
    group.send(b, next, 8);
    at::Tensor got_b = at::empty({2, 2}), got_a = at::empty({3});
    group.recv(got_b, prev, 8);  // the later send first
    group.recv(got_a, prev, 7);
    group.wait_sends();
    EXPECT_TRUE(at::equal(got_a, at::full({3}, 10.0f * prev)));
    EXPECT_TRUE(at::equal(got_b, at::full({2, 2}, 10.0f * prev + 1)));
    EXPECT_THROW(group.send(a, r, 1), Error);  // to itself

    const std::vector<int> odd{1, 3}, even{0, 2};
    std::unique_ptr<SiteGroup> sub = group.subgroup(r % 2 ? "odd" : "even", r % 2 ? odd : even);
    EXPECT_EQ(sub->size(), 2);
    EXPECT_EQ(sub->rank(), r / 2);
    at::Tensor sum = at::full({1}, static_cast<float>(r));
    sub->allreduce_sum(sum);
    EXPECT_EQ(sum.item<float>(), r % 2 ? 4.0f : 2.0f);
    EXPECT_THROW(group.subgroup("wrong", r % 2 ? even : odd), Error);
  });
}

TEST(SiteGroup, ReduceScatterEqualsAllreduceThenSliceAndAllGatherConcatenates) {
  check_sharded_collectives(1, 5);
  check_sharded_collectives(2, 7);
  check_sharded_collectives(3, 1000);
  check_sharded_collectives(4, 3);
}

// Parts of any sizes, 0 included (diloco's sharded outer state: a fragment cut by the shard
// boundaries; ZeRO-3's layers): all-gather, gather to rank 0 and scatter from it against the
// concatenation of the parts, reduce-scatter against the sum; bad part sizes are errors naming them.
void check_part_collectives(const std::vector<int64_t>& counts) {
  const int size = static_cast<int>(counts.size());
  std::vector<int64_t> at(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) at[i + 1] = at[i] + counts[i];
  // Rank i's part: the values 1000 i + 0, 1, 2, ...
  at::Tensor expected = at::empty({at.back()});
  for (int i = 0; i < size; ++i)
    expected.narrow(0, at[i], counts[i]).copy_(at::arange(counts[i], at::kFloat).add_(1000 * i));
  testing::run_site("parts", size, [&](SiteGroup& g) {
    const int r = g.rank();
    const std::string where = str_cat("rank ", r, " of counts ", at::IntArrayRef(counts));
    at::Tensor mine = expected.narrow(0, at[r], counts[r]).clone();

    at::Tensor full = at::full({at.back()}, -1.0f);
    full.narrow(0, at[r], counts[r]).copy_(mine);
    g.all_gather_parts(full, counts);
    EXPECT_TRUE(at::equal(full, expected)) << "all_gather_parts, " << where;

    at::Tensor gathered = r == 0 ? at::full({at.back()}, -1.0f) : at::Tensor();
    g.gather_parts_to_root(mine, gathered, counts);
    if (r == 0) {
      EXPECT_TRUE(at::equal(gathered, expected)) << "gather_parts_to_root";
    }

    at::Tensor source = r == 0 ? expected.clone() : at::Tensor(), got = at::full({counts[r]}, -1.0f);
    g.scatter_parts_from_root(source, got, counts);
    EXPECT_TRUE(at::equal(got, mine)) << "scatter_parts_from_root, " << where;

    // The same pairs with no whole on rank 0: each rank's part handed over in rank order,
    // through a buffer of the largest part; scatter's callee fills what each rank receives.
    std::vector<int> order;
    at::Tensor assembled = r == 0 ? at::full({at.back()}, -1.0f) : at::Tensor();
    g.gather_parts_each(mine, counts, [&](int q, const at::Tensor& values) {
      order.push_back(q);
      ASSERT_EQ(values.numel(), counts[static_cast<size_t>(q)]) << "gather_parts_each, rank " << q;
      assembled.narrow(0, at[q], counts[q]).copy_(values);
    });
    at::Tensor filled = at::full({counts[r]}, -1.0f);
    g.scatter_parts_each(filled, counts, [&](int q, const at::Tensor& values) {
      order.push_back(q);
      values.copy_(expected.narrow(0, at[q], counts[q]));
    });
    EXPECT_TRUE(at::equal(filled, mine)) << "scatter_parts_each, " << where;
    if (r == 0) {
      EXPECT_TRUE(at::equal(assembled, expected)) << "gather_parts_each";
      std::vector<int> want;
      for (int pass = 0; pass < 2; ++pass)
        for (int q = 0; q < size; ++q)
          if (q == 0 || counts[static_cast<size_t>(q)] > 0) want.push_back(q);
      EXPECT_EQ(order, want) << "parts handed over in rank order, empty ones skipped";
    } else {
      EXPECT_TRUE(order.empty()) << "the callee runs on rank 0 only";
    }

    // Every rank's contribution: rank q's tensor holds (q + 1) times the values of `expected`
    // (small integers: the sum is exact), so each part must end as Σ (q + 1) = size (size + 1) / 2 times.
    at::Tensor contribution = expected.mul(r + 1);
    g.reduce_scatter_parts(contribution, counts);
    EXPECT_TRUE(at::equal(contribution.narrow(0, at[r], counts[r]), mine.mul(size * (size + 1) / 2)))
        << "reduce_scatter_parts, " << where;

    std::vector<int64_t> wrong = counts;
    wrong[0] += 1;
    at::Tensor bad = at::zeros({at.back()});
    try {
      g.all_gather_parts(bad, wrong);
      ADD_FAILURE() << "parts that do not sum to the tensor's size were gathered";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("parts summing to"), std::string::npos) << e.what();
    }
  });
}

TEST(SiteGroup, PartCollectivesOfAnySizesEqualTheConcatenation) {
  check_part_collectives({5});
  check_part_collectives({0});
  check_part_collectives({3, 0});
  check_part_collectives({0, 1});
  check_part_collectives({7, 1, 1000});
  check_part_collectives({2, 0, 5, 1});
  check_part_collectives({0, 0, 0, 4});
}

}  // namespace
}  // namespace nebula::collective
