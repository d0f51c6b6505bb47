#include "collective/hierarchical.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

#include "collective/testing.h"
#include "nebula/error.h"

namespace nebula::collective {
namespace {

struct Case {
  std::vector<int> sites;
  int64_t numel;
};

std::string name(const ::testing::TestParamInfo<Case>& info) {
  std::string s;
  for (int w : info.param.sites) s += std::to_string(w) + "x";
  return "sites_" + s + "_n" + std::to_string(info.param.numel);
}

class HierarchicalAllreduce : public ::testing::TestWithParam<Case> {};

at::Tensor data_of(int global_rank, int64_t numel) {
  static std::mutex mu;  // the default generator is shared by the threads: serialise
  std::lock_guard<std::mutex> lock(mu);
  at::manual_seed(1000 + global_rank);
  return at::randn({numel}, at::kFloat);
}

// The hierarchical sum equals c10d's own allreduce over all ranks of all sites.
TEST_P(HierarchicalAllreduce, SumEqualsFlatC10dAllreduce) {
  const Case c = GetParam();
  testing::StorePort flat_port;  // global rank 0 hosts the flat group's store and publishes its port
  testing::run_cluster(c.sites, [&](testing::Rank& r) {
    at::Tensor mine = data_of(r.global_rank, c.numel);
    at::Tensor ours = mine.clone();
    r.hierarchy->allreduce(ours, {ReduceOp::kSum, 1.0});

    SiteGroup flat = testing::join_group("flat", r.global_rank, r.world_size, std::chrono::seconds(60), flat_port);
    at::Tensor reference = mine.clone();
    flat.allreduce_sum(reference);

    ASSERT_EQ(ours.numel(), c.numel);
    if (c.numel > 0) {
      // Same sum, different association order: float tolerance grows with the world size.
      EXPECT_TRUE(at::allclose(ours, reference, 1e-5, 1e-5))
          << "max diff " << (ours - reference).abs().max().item<float>();
    }
    flat.barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(Topologies, HierarchicalAllreduce,
                         ::testing::Values(Case{{2, 2}, 0}, Case{{2, 2}, 1}, Case{{2, 2}, 1000},
                                           Case{{2, 2}, 1000000}, Case{{1, 1, 1}, 0}, Case{{1, 1, 1}, 1},
                                           Case{{1, 1, 1}, 1000}, Case{{1, 1, 1}, 1000000}),
                         name);

TEST(Hierarchical, WeightedMeanUsesEveryWorkersWeight) {
  // Worker g holds the constant g+1 with weight g+1: mean = Σ (g+1)^2 / Σ (g+1).
  const std::vector<int> sites{2, 1};
  testing::run_cluster(sites, [&](testing::Rank& r) {
    at::Tensor t = at::full({5}, static_cast<float>(r.global_rank + 1));
    r.hierarchy->allreduce(t, {ReduceOp::kWeightedMean, static_cast<double>(r.global_rank + 1)});
    const double expected = (1.0 + 4.0 + 9.0) / (1.0 + 2.0 + 3.0);
    for (int i = 0; i < 5; ++i) EXPECT_NEAR(t[i].item<float>(), expected, 1e-6);
  });
}

TEST(Hierarchical, ResultsAreBitIdenticalAcrossSites) {
  const std::vector<int> sites{1, 2, 1};
  std::mutex mu;
  std::vector<at::Tensor> results;
  testing::run_cluster(sites, [&](testing::Rank& r) {
    at::Tensor t = data_of(r.global_rank, 4097);
    r.hierarchy->allreduce(t, {ReduceOp::kWeightedMean, 0.5 + r.global_rank});
    std::lock_guard<std::mutex> lock(mu);
    results.push_back(t);
  });
  ASSERT_EQ(results.size(), 4u);
  for (const auto& t : results) EXPECT_TRUE(at::equal(t, results[0]));
}

// The training thread reads stats() (metrics, the controller's link estimates) while the
// communication thread runs collectives and adds to the counters: every read is consistent and
// the counts only grow. Before the counters were under a lock this was a data race (the kind
// ThreadSanitizer reports, scripts/check_threads.sh); here it is also checked that the totals
// end right.
TEST(Hierarchical, StatsMayBeReadFromAnotherThreadWhileCollectivesRun) {
  const std::vector<int> sites{1, 1};
  constexpr int kCalls = 20;
  testing::run_cluster(sites, [&](testing::Rank& r) {
    std::atomic<bool> done{false};
    std::string bad;
    auto reader = std::thread([&] {
      uint64_t last_allreduces = 0, last_sent = 0;
      while (!done.load()) {
        const CommStats st = r.hierarchy->stats();
        if (st.allreduces < last_allreduces || st.wan_bytes_sent < last_sent) bad = "a counter went down";
        last_allreduces = st.allreduces;
        last_sent = st.wan_bytes_sent;
        std::this_thread::yield();
      }
    });
    for (int i = 0; i < kCalls; ++i) {
      at::Tensor t = at::full({1000}, static_cast<float>(i));
      r.hierarchy->allreduce(t, {ReduceOp::kWeightedMean, 1.0});
    }
    done = true;
    reader.join();
    EXPECT_EQ(bad, "");
    const CommStats st = r.hierarchy->stats();
    EXPECT_EQ(st.allreduces, static_cast<uint64_t>(kCalls));
    EXPECT_EQ(st.codec_bytes_in, kCalls * 1000 * sizeof(float));
    EXPECT_GT(st.wan_bytes_sent, st.codec_bytes_in);  // headers on top of the float32 payloads
  });
}

// [7/7] GPU sites: a bucket holding CUDA tensors (alone, or next to CPU ones) goes through a
// pinned host buffer and gives exactly what the same bucket on the CPU gives. Runs where
// LibTorch has CUDA and a GPU (bench/gpu_check.sh); skipped elsewhere.
TEST(Hierarchical, CudaTensorsGiveExactlyTheCpuResult) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device for LibTorch here";
  const std::vector<int> sites{2, 1};
  testing::run_cluster(sites, [&](testing::Rank& r) {
    const at::Tensor a = data_of(r.global_rank, 1000), b = data_of(r.global_rank + 10, 77);
    std::vector<at::Tensor> cpu = {a.clone(), b.clone()};
    r.hierarchy->allreduce(cpu, {ReduceOp::kWeightedMean, 1.0 + r.global_rank});
    std::vector<at::Tensor> gpu = {a.to(at::kCUDA), b.clone()};  // a mixed bucket
    r.hierarchy->allreduce(gpu, {ReduceOp::kWeightedMean, 1.0 + r.global_rank});
    EXPECT_TRUE(gpu[0].device().is_cuda());
    EXPECT_TRUE(at::equal(gpu[0].cpu(), cpu[0]));
    EXPECT_TRUE(at::equal(gpu[1], cpu[1]));
  });
}

// With a lossy codec on the inter-site leg the result is close to the exact mean, and still
// bit-identical on every worker of every site (every gateway decodes the same bytes).
TEST(Hierarchical, LossyCodecStaysCloseAndBitIdenticalAcrossSites) {
  auto int8 = codec::make_codec({"int8"});
  std::mutex mu;
  std::vector<at::Tensor> results;
  at::Tensor exact = at::zeros({5000});
  for (int g = 0; g < 4; ++g) exact += data_of(g, 5000) / 4.0;
  testing::run_cluster({1, 2, 1}, [&](testing::Rank& r) {
    at::Tensor t = data_of(r.global_rank, 5000);
    r.hierarchy->allreduce(t, {ReduceOp::kWeightedMean, 1.0, int8.get(), 7});
    CommStats s = r.hierarchy->stats();
    if (r.local_rank == 0) {
      EXPECT_GT(s.codec_bytes_in, 3 * s.codec_bytes_out);  // about 4x smaller
    }
    std::lock_guard<std::mutex> lock(mu);
    results.push_back(t);
  });
  ASSERT_EQ(results.size(), 4u);
  for (const auto& t : results) EXPECT_TRUE(at::equal(t, results[0]));
  // Each site's sum is quantised once: error per element <= Σ_sites scale/2 / Σ weights.
  EXPECT_LT((results[0] - exact).abs().max().item<float>(), 0.05f);
  EXPECT_GT((results[0] - exact).abs().max().item<float>(), 0.0f);  // it really was lossy
}

// A real broadcast ([4/5]): only the first site sends the values; the others' gateways send a
// few header bytes, and a NaN on a receiving worker does not reach anyone (a weighted mean with
// weight 0 turned it into NaN everywhere: 0 × NaN).
TEST(Hierarchical, BroadcastFromFirstCopiesGlobalRankZero) {
  testing::run_cluster({2, 2, 1}, [&](testing::Rank& r) {
    at::Tensor t = data_of(r.global_rank, 333);
    if (r.global_rank == 3) t[7] = NAN;
    r.hierarchy->broadcast_from_first(t);
    EXPECT_TRUE(at::equal(t, data_of(0, 333)));
    CommStats s = r.hierarchy->stats();
    if (r.local_rank != 0) {
      EXPECT_EQ(s.wan_bytes_sent, 0u);
    } else if (r.site == 0) {
      EXPECT_GT(s.wan_bytes_sent, 2u * 333 * 4);  // to each of the two other sites
    } else {
      EXPECT_LT(s.wan_bytes_sent, 2u * 400);  // headers only
    }
  });
}

// Every number a peer sends is checked ([4/5]): a site's weight that is infinite or absurdly
// large is left out of an exchange by every site alike (the update guard's rejection), and
// makes an all-reduce an error on every site, instead of poisoning the mean.
TEST(Hierarchical, APeersWeightOutsideItsBoundsIsRejected) {
  std::mutex mu;
  std::vector<std::vector<Rejection>> rejected(3);
  testing::run_cluster({1, 1, 1}, [&](testing::Rank& r) {
    at::Tensor x = at::full({8}, static_cast<float>(r.site + 1));
    AllreduceOptions o;
    o.weight = r.site == 1 ? INFINITY : r.site == 2 ? 1e30 : 1.0;
    auto work = r.hierarchy->exchange_async({x}, o);
    work->wait(Deadline::after(std::chrono::seconds(30)));
    EXPECT_TRUE(at::equal(x, at::ones({8}))) << "site " << r.site << ": " << x;
    {
      std::lock_guard<std::mutex> lock(mu);
      rejected[r.site] = work->rejected();
    }
    at::Tensor y = at::ones({4});
    EXPECT_THROW(r.hierarchy->allreduce(y, {ReduceOp::kWeightedMean, o.weight}), Error) << "site " << r.site;
  });
  for (size_t s = 0; s < 3; ++s) {
    ASSERT_EQ(rejected[s].size(), 2u) << "site " << s;
    EXPECT_EQ(rejected[s][0].site, 1u);
    EXPECT_NE(rejected[s][0].reason.find("weight inf"), std::string::npos) << rejected[s][0].reason;
    EXPECT_EQ(rejected[s][1].site, 2u);
    EXPECT_NE(rejected[s][1].reason.find("weight 1e+30"), std::string::npos) << rejected[s][1].reason;
  }
}

// all_gather_bytes, the base of the Python backend's exact collectives: every worker gives a
// different number of bytes (0 included, and a worker of each layout giving nothing at all);
// every worker receives every worker's bytes, exactly, in job order. A broadcast (only one
// worker gives bytes) crosses the WAN from the source's site alone: the other gateways send
// only their headers.
TEST(Hierarchical, AllGatherBytesGivesEveryWorkersBytesInJobOrder) {
  for (const std::vector<int>& layout : {std::vector<int>{1}, {2, 1}, {1, 3, 2}}) {
    int world = 0;
    for (int w : layout) world += w;
    auto bytes_of = [](int rank) {
      std::vector<uint8_t> b(static_cast<size_t>(rank == 1 ? 0 : 3 * rank + 1));
      for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(rank * 31 + static_cast<int>(i));
      return b;
    };
    testing::run_cluster(layout, [&](testing::Rank& r) {
      auto all = r.hierarchy->all_gather_bytes(bytes_of(r.global_rank));
      ASSERT_EQ(all.size(), static_cast<size_t>(world));
      for (int g = 0; g < world; ++g) EXPECT_EQ(all[static_cast<size_t>(g)], bytes_of(g)) << "rank " << g;
      // A broadcast from the last rank: 100 kB from its site, nothing of size from the others.
      const uint64_t before = r.hierarchy->stats().wan_bytes_sent;
      const std::vector<uint8_t> big(100000, 7);
      all = r.hierarchy->all_gather_bytes(r.global_rank == world - 1 ? big : std::vector<uint8_t>{});
      EXPECT_EQ(all.back(), big);
      for (int g = 0; g + 1 < world; ++g) EXPECT_TRUE(all[static_cast<size_t>(g)].empty());
      const uint64_t sent = r.hierarchy->stats().wan_bytes_sent - before;
      const bool source_site = r.site + 1 == layout.size();
      if (r.local_rank == 0 && layout.size() > 1) {
        if (source_site) EXPECT_GE(sent, 100000u * (layout.size() - 1));
        else EXPECT_LT(sent, 1000u * (layout.size() - 1)) << "site " << r.site;
      }
    });
  }
}

// site_allreduce (a one-site job's all-reduce, nebula/session.h): the sum and the weighted mean
// over the site's workers, the same floats on every worker.
TEST(Hierarchical, SiteAllreduceSumsAndAveragesOverTheSite) {
  testing::run_cluster({3}, [&](testing::Rank& r) {
    for (int64_t n : {0, 1, 1001}) {
      at::Tensor t = at::full({n}, static_cast<float>(r.local_rank + 1));
      r.hierarchy->site_allreduce(t, {ReduceOp::kSum, 1.0});
      EXPECT_TRUE(at::equal(t, at::full({n}, 6.0f))) << n;
      t = at::full({n}, static_cast<float>(r.local_rank));
      r.hierarchy->site_allreduce(t, {ReduceOp::kWeightedMean, static_cast<double>(r.local_rank + 1)});
      EXPECT_TRUE(at::allclose(t, at::full({n}, 8.0f / 6.0f))) << n;  // (0*1 + 1*2 + 2*3) / 6
    }
  });
}

// The update guard ([6/7]): three sites exchange; one sends a NaN, one an oversize update.
// Every gateway leaves both out, the same way, and says which and why; the mean is the
// remaining site's values alone. Then a round where every contribution is bad: zero.
TEST(Hierarchical, UpdateGuardLeavesOutNonFiniteAndOversizeContributionsOnEverySite) {
  std::mutex mu;
  std::vector<at::Tensor> results(3);
  std::vector<std::vector<Rejection>> rejected(3);
  testing::run_cluster({1, 1, 1}, [&](testing::Rank& r) {
    at::Tensor x = at::full({8}, static_cast<float>(r.site + 1));  // norms 2.8, 5.7, 8.5
    if (r.site == 1) x[3] = NAN;
    if (r.site == 2) x.mul_(100);  // norm 849
    AllreduceOptions o;
    o.weight = 1.0 + static_cast<double>(r.site);
    o.max_norm = 10;
    auto work = r.hierarchy->exchange_async({x}, o);
    work->wait(Deadline::after(std::chrono::seconds(30)));
    at::Tensor all_bad = at::full({4}, INFINITY);
    auto zero = r.hierarchy->exchange_async({all_bad}, o);
    zero->wait(Deadline::after(std::chrono::seconds(30)));
    std::lock_guard<std::mutex> lock(mu);
    results[r.site] = x.clone();
    rejected[r.site] = work->rejected();
    EXPECT_TRUE(at::equal(all_bad, at::zeros({4}))) << all_bad;
    EXPECT_EQ(zero->rejected().size(), 3u);
  });
  for (size_t s = 0; s < 3; ++s) {
    EXPECT_TRUE(at::equal(results[s], at::ones({8}))) << "site " << s << ": " << results[s];
    ASSERT_EQ(rejected[s].size(), 2u) << "site " << s;
    EXPECT_EQ(rejected[s][0].site, 1u);
    EXPECT_NE(rejected[s][0].reason.find("1 NaN"), std::string::npos) << rejected[s][0].reason;
    EXPECT_EQ(rejected[s][1].site, 2u);
    EXPECT_NE(rejected[s][1].reason.find("above the bound 10"), std::string::npos) << rejected[s][1].reason;
  }
}

// wan.mode = "every_worker": each worker exchanges only its cut of the vector, with the workers
// of the other sites whose cuts overlap it, over its own links. Sites of different worker
// counts; sizes 37, 1 and 0. Exact: every worker's part equals the definition computed the way
// the gateway computes it (Σ_s W_s x_s in site order, then / Σ_s W_s), bit for bit. int8: every
// site assembles the same floats, close to the exact mean. Every worker sends bytes.
std::vector<std::vector<int64_t>> zero_cuts(const std::vector<int>& sites, int64_t n) {
  std::vector<std::vector<int64_t>> cuts;
  for (int w : sites) {
    const int64_t shard = (n + w - 1) / w;
    std::vector<int64_t> c;
    for (int q = 0; q <= w; ++q) c.push_back(std::min<int64_t>(q * shard, n));
    cuts.push_back(c);
  }
  return cuts;
}

TEST(Hierarchical, EveryWorkerExchangesItsOwnPartsAsTheGatewayWould) {
  auto int8 = codec::make_codec({"int8"});
  for (const std::vector<int>& sites : {std::vector<int>{2, 3}, std::vector<int>{1, 3, 2}, std::vector<int>{4, 1}})
    for (int64_t n : {int64_t{37}, int64_t{1}, int64_t{0}})
      for (const codec::Codec* codec : std::vector<const codec::Codec*>{nullptr, int8.get()}) {
        SCOPED_TRACE(::testing::Message() << sites.size() << " sites, n " << n << (codec ? ", int8" : ", exact"));
        const auto cuts = zero_cuts(sites, n);
        at::Tensor expected = at::zeros({n});
        double total = 0;
        for (size_t s = 0; s < sites.size(); ++s) {
          expected.add_(data_of(static_cast<int>(s), n), 1.0 + static_cast<double>(s));
          total += 1.0 + static_cast<double>(s);
        }
        expected.div_(total);
        std::mutex mu;
        std::vector<at::Tensor> assembled(sites.size());
        for (size_t s = 0; s < sites.size(); ++s) assembled[s] = at::full({n}, NAN);
        testing::run_cluster(
            sites,
            [&](testing::Rank& r) {
              const int64_t lo = cuts[r.site][static_cast<size_t>(r.local_rank)];
              const int64_t hi = cuts[r.site][static_cast<size_t>(r.local_rank) + 1];
              at::Tensor part = data_of(static_cast<int>(r.site), n).narrow(0, lo, hi - lo).clone();
              AllreduceOptions o;
              o.weight = 1.0 + static_cast<double>(r.site);
              o.codec = codec;
              o.tag = 3;
              if (r.local_rank == 0) o.site_info = {static_cast<double>(r.site) * 10};
              auto work = r.hierarchy->exchange_parts_async(part, cuts, o);
              work->wait(Deadline::after(std::chrono::seconds(30)));
              EXPECT_GT(r.hierarchy->stats().wan_bytes_sent, 0u) << "worker " << r.site << "/" << r.local_rank;
              if (r.local_rank == 0) {
                ASSERT_EQ(work->site_info().size(), sites.size());
                for (size_t t = 0; t < sites.size(); ++t)
                  EXPECT_EQ(work->site_info()[t], std::vector<double>{static_cast<double>(t) * 10});
              }
              std::lock_guard<std::mutex> lock(mu);
              assembled[r.site].narrow(0, lo, hi - lo).copy_(part);
            },
            std::chrono::seconds(60), /*every_worker=*/true);
        for (size_t s = 0; s < sites.size(); ++s) {
          EXPECT_TRUE(at::equal(assembled[s], assembled[0])) << "site " << s << " differs from site 0";
          if (!codec) EXPECT_TRUE(at::equal(assembled[s], expected)) << assembled[s] << expected;
        }
        if (codec && n > 1) EXPECT_LT((assembled[0] - expected).abs().max().item<float>(), 0.05f);
      }
}

// every_worker exchanges of a cluster where worker r of site s sends its part (cuts of n) of
// input(s) with the options options(s): the parts each site ends with, put together, and the
// rejections each worker saw.
struct EveryWorkerOutcome {
  std::vector<at::Tensor> assembled;                        // per site
  std::vector<std::vector<std::vector<Rejection>>> rejected;  // per site, per worker
};
EveryWorkerOutcome exchange_every_worker(const std::vector<int>& sites, int64_t n,
                                         const std::function<at::Tensor(size_t site)>& input,
                                         const std::function<AllreduceOptions(size_t site)>& options) {
  const auto cuts = zero_cuts(sites, n);
  std::mutex mu;
  EveryWorkerOutcome out;
  out.assembled.resize(sites.size());
  for (auto& a : out.assembled) a = at::full({n}, NAN);
  for (int w : sites) out.rejected.emplace_back(static_cast<size_t>(w));
  testing::run_cluster(
      sites,
      [&](testing::Rank& r) {
        const at::Tensor x = input(r.site);
        const int64_t lo = cuts[r.site][static_cast<size_t>(r.local_rank)];
        const int64_t hi = cuts[r.site][static_cast<size_t>(r.local_rank) + 1];
        at::Tensor part = x.narrow(0, lo, hi - lo).clone();
        auto work = r.hierarchy->exchange_parts_async(part, cuts, options(r.site));
        work->wait(Deadline::after(std::chrono::seconds(30)));
        std::lock_guard<std::mutex> lock(mu);
        out.assembled[r.site].narrow(0, lo, hi - lo).copy_(part);
        out.rejected[r.site][static_cast<size_t>(r.local_rank)] = work->rejected();
      },
      std::chrono::seconds(60), /*every_worker=*/true);
  return out;
}

// Every worker of every site assembled ones (the one site left in) and rejected exactly sites
// `first` and `second`, for reasons containing `why_first` and `why_second`.
void expect_two_left_out(const std::vector<int>& sites, const EveryWorkerOutcome& o, size_t first,
                         const std::string& why_first, size_t second, const std::string& why_second) {
  for (size_t s = 0; s < sites.size(); ++s) {
    EXPECT_TRUE(at::equal(o.assembled[s], at::ones({o.assembled[s].numel()}))) << "site " << s << ": " << o.assembled[s];
    for (int q = 0; q < sites[s]; ++q) {
      const auto& rj = o.rejected[s][static_cast<size_t>(q)];
      ASSERT_EQ(rj.size(), 2u) << "worker " << s << "/" << q;
      EXPECT_EQ(rj[0].site, first);
      EXPECT_NE(rj[0].reason.find(why_first), std::string::npos) << rj[0].reason;
      EXPECT_EQ(rj[1].site, second);
      EXPECT_NE(rj[1].reason.find(why_second), std::string::npos) << rj[1].reason;
    }
  }
}

// The update guard decides on a site's whole contribution, though each worker holds a part of
// it: a NaN in one worker's part rejects the whole site on every worker of every site, and so
// does a norm that only the site's parts together exceed.
TEST(Hierarchical, EveryWorkerUpdateGuardDecidesOnTheWholeSite) {
  const std::vector<int> sites{2, 3, 1};
  const auto outcome = exchange_every_worker(
      sites, 30,
      [](size_t site) {
        at::Tensor x = at::full({30}, site == 2 ? 1.0f : 3.0f);  // site 2's norm √30 = 5.5
        if (site == 1) x[2] = NAN;  // in worker 0's part only (cuts of 10)
        // Site 0: each of its two parts has norm 3√15 = 11.6, the site's 3√30 = 16.4.
        return x;
      },
      [](size_t) {
        AllreduceOptions o;
        o.max_norm = 15;
        return o;
      });
  expect_two_left_out(sites, outcome, 0, "above the bound 15", 1, "1 NaN");
}

// With every_worker each worker sends its site's weight on its own links: a weight out of
// bounds is caught there too (the sender's own check refuses only non-finite and negative
// ones), and the site is left out by every worker of every site alike.
TEST(Hierarchical, EveryWorkerPeersWeightOutsideItsBoundsIsRejected) {
  const std::vector<int> sites{2, 1, 2};
  const auto outcome = exchange_every_worker(
      sites, 20, [](size_t site) { return at::full({20}, static_cast<float>(site + 1)); },
      [](size_t site) {
        AllreduceOptions o;
        o.weight = site == 1 ? 1e30 : site == 2 ? 1e20 : 1.0;  // finite, so they pass the sender's own check
        return o;
      });
  expect_two_left_out(sites, outcome, 1, "weight 1e+30", 2, "weight 1e+20");
}

// The holdings of contiguous cuts: one span per worker, an empty cut an empty span.
TEST(Hierarchical, HoldingsOfCutsGiveEachWorkerItsRange) {
  const Holdings h = holdings_of_cuts({{0, 5, 5, 10}, {0, 10}});
  ASSERT_EQ(h.size(), 2u);
  ASSERT_EQ(h[0].size(), 3u);
  ASSERT_EQ(h[1].size(), 1u);
  const std::vector<std::pair<int64_t, int64_t>> expected{{0, 5}, {5, 5}, {5, 10}};
  for (size_t q = 0; q < 3; ++q) {
    ASSERT_EQ(h[0][q].size(), 1u);
    EXPECT_EQ(h[0][q][0].begin, expected[q].first);
    EXPECT_EQ(h[0][q][0].end, expected[q].second);
  }
  ASSERT_EQ(h[1][0].size(), 1u);
  EXPECT_EQ(h[1][0][0].begin, 0);
  EXPECT_EQ(h[1][0][0].end, 10);
}

// With one span per worker (cuts) the segments, the wire bytes and the codec keys are those of
// the contiguous exchange before holdings: segments are a worker's range cut at every site's
// cuts; to each worker of another site one frame (40 header bytes) of 8 + 8 + 4 + 8 per
// site_info value + 1 + 4 bytes, then 8 + 8 + 4 × length per segment it holds too (exact
// codec); codec state keyed by (tag, segment start).
TEST(Hierarchical, EveryWorkerCutsKeepTheirSegmentsWireBytesAndCodecKeys) {
  auto int8 = codec::make_codec({"int8"});
  const std::vector<int> sites{2, 3};
  const int64_t n = 37;
  const auto cuts = zero_cuts(sites, n);  // {0, 19, 37}, {0, 13, 26, 37}
  for (const codec::Codec* codec : std::vector<const codec::Codec*>{nullptr, int8.get()}) {
    SCOPED_TRACE(codec ? "int8" : "exact");
    testing::run_cluster(
        sites,
        [&](testing::Rank& r) {
          const size_t q = static_cast<size_t>(r.local_rank);
          const int64_t lo = cuts[r.site][q], hi = cuts[r.site][q + 1];
          std::vector<int64_t> points{lo, hi};  // the segments, as the contiguous exchange cut them
          for (const auto& c : cuts)
            for (int64_t x : c)
              if (x > lo && x < hi) points.push_back(x);
          std::sort(points.begin(), points.end());
          points.erase(std::unique(points.begin(), points.end()), points.end());
          uint64_t expected_bytes = 0;
          for (size_t t = 0; t < sites.size(); ++t) {
            if (t == r.site) continue;
            for (size_t j = 0; j + 1 < cuts[t].size(); ++j) {
              expected_bytes += 40 + 8 + 8 + 4 + 1 + 4;
              for (size_t k = 0; k + 1 < points.size(); ++k)
                if (points[k] >= cuts[t][j] && points[k] < cuts[t][j + 1])
                  expected_bytes += 8 + 8 + 4 * static_cast<uint64_t>(points[k + 1] - points[k]);
            }
          }
          AllreduceOptions o;
          o.codec = codec;
          o.tag = 11;
          const uint64_t before = r.hierarchy->stats().wan_bytes_sent;
          at::Tensor part = data_of(static_cast<int>(r.site), n).narrow(0, lo, hi - lo).clone();
          r.hierarchy->exchange_parts_async(part, cuts, o)->wait(Deadline::after(std::chrono::seconds(30)));
          if (!codec) {
            EXPECT_EQ(r.hierarchy->stats().wan_bytes_sent - before, expected_bytes)
                << "worker " << r.site << "/" << r.local_rank;
            EXPECT_TRUE(r.hierarchy->codec_states().empty());
          } else {
            std::set<std::pair<uint64_t, size_t>> keys, expected_keys;
            for (const auto& [key, state] : r.hierarchy->codec_states()) keys.insert(key);
            for (size_t k = 0; k + 1 < points.size(); ++k) expected_keys.insert({11, static_cast<size_t>(points[k])});
            EXPECT_EQ(keys, expected_keys) << "worker " << r.site << "/" << r.local_rank;
          }
        },
        std::chrono::seconds(60), /*every_worker=*/true);
  }
}

// FSDP-like holdings: the vector is `units` (their sizes) one after another, and worker q of a
// site of w workers holds piece q of every unit (ZeRO's shard of the unit over w, rounded up,
// so a small unit's last pieces are empty; a site of one worker holds touching spans).
Holdings interleaved_holdings(const std::vector<int>& sites, const std::vector<int64_t>& units) {
  Holdings h;
  for (int w : sites) {
    std::vector<std::vector<Span>> site(static_cast<size_t>(w));
    int64_t offset = 0;
    for (int64_t u : units) {
      const int64_t shard = (u + w - 1) / w;
      for (int q = 0; q < w; ++q)
        site[static_cast<size_t>(q)].push_back(
            {offset + std::min(q * shard, u), offset + std::min((q + 1) * shard, u)});
      offset += u;
    }
    h.push_back(std::move(site));
  }
  return h;
}

// A worker's values of its spans, concatenated in span order; and back into the whole vector.
at::Tensor gather_spans(const at::Tensor& x, const std::vector<Span>& spans) {
  std::vector<at::Tensor> pieces{at::empty({0}, at::kFloat)};
  for (const Span& s : spans) pieces.push_back(x.narrow(0, s.begin, s.end - s.begin));
  return at::cat(pieces).contiguous();
}
void scatter_spans(const at::Tensor& part, const std::vector<Span>& spans, at::Tensor& into) {
  int64_t pos = 0;
  for (const Span& s : spans) {
    into.narrow(0, s.begin, s.end - s.begin).copy_(part.narrow(0, pos, s.end - s.begin));
    pos += s.end - s.begin;
  }
}

// Σ_s W_s x_s / Σ_s W_s with x_s = data_of(s, n), W_s = 1 + s, added in site order as every worker adds.
at::Tensor plain_weighted_mean(size_t num_sites, int64_t n) {
  at::Tensor expected = at::zeros({n});
  double total = 0;
  for (size_t s = 0; s < num_sites; ++s) {
    expected.add_(data_of(static_cast<int>(s), n), 1.0 + static_cast<double>(s));
    total += 1.0 + static_cast<double>(s);
  }
  return expected.div_(total);
}

// Every site's worker `local_rank` exchanges, with holdings holdings_of(site), its spans of
// data_of(site, n) with weight 1 + site: what each site ends with, put together, and each
// worker's WAN bytes sent for it (by site, then local rank).
struct HoldingsOutcome {
  std::vector<at::Tensor> assembled;
  std::vector<std::vector<uint64_t>> bytes_sent;
};
HoldingsOutcome exchange_holdings(const std::vector<int>& sites, int64_t n,
                                  const std::function<Holdings(size_t site)>& holdings_of,
                                  const codec::Codec* codec = nullptr) {
  std::mutex mu;
  HoldingsOutcome out;
  for (int w : sites) {
    out.assembled.push_back(at::full({n}, NAN));
    out.bytes_sent.emplace_back(static_cast<size_t>(w));
  }
  testing::run_cluster(
      sites,
      [&](testing::Rank& r) {
        const Holdings holdings = holdings_of(r.site);
        const std::vector<Span>& mine = holdings[r.site][static_cast<size_t>(r.local_rank)];
        at::Tensor part = gather_spans(data_of(static_cast<int>(r.site), n), mine);
        AllreduceOptions o;
        o.weight = 1.0 + static_cast<double>(r.site);
        o.codec = codec;
        o.tag = 5;
        const uint64_t before = r.hierarchy->stats().wan_bytes_sent;
        r.hierarchy->exchange_parts_async(part, holdings, o)->wait(Deadline::after(std::chrono::seconds(30)));
        std::lock_guard<std::mutex> lock(mu);
        scatter_spans(part, mine, out.assembled[r.site]);
        out.bytes_sent[r.site][static_cast<size_t>(r.local_rank)] = r.hierarchy->stats().wan_bytes_sent - before;
        if (codec) {
          // One codec state per segment, keyed by its start: the values of this worker where
          // the holder changes at some site (as spans normalised would say, however written).
          std::vector<std::vector<size_t>> holder(holdings.size(), std::vector<size_t>(static_cast<size_t>(n)));
          for (size_t t = 0; t < holdings.size(); ++t)
            for (size_t q = 0; q < holdings[t].size(); ++q)
              for (const Span& x : holdings[t][q])
                for (int64_t p = x.begin; p < x.end; ++p) holder[t][static_cast<size_t>(p)] = q;
          std::set<int64_t> starts;
          for (const Span& x : mine)
            for (int64_t p = x.begin; p < x.end; ++p) {
              bool changes = p == 0;
              for (const auto& h : holder)
                changes = changes || h[static_cast<size_t>(p - 1)] != h[static_cast<size_t>(p)];
              if (changes) starts.insert(p);
            }
          std::set<int64_t> keys;
          for (const auto& [key, state] : r.hierarchy->codec_states()) keys.insert(static_cast<int64_t>(key.second));
          EXPECT_EQ(keys, starts) << "worker " << r.site << "/" << r.local_rank;
        }
      },
      std::chrono::seconds(60), /*every_worker=*/true);
  return out;
}

// FSDP-like holdings: each worker holds piece q of every unit, several disjoint spans, on sites
// of different worker counts (a site of one worker holding touching spans). Exact: every site
// ends with the plain weighted mean, bit for bit. int8: every site the same floats, close to it.
TEST(Hierarchical, EveryWorkerExchangesInterleavedHoldings) {
  auto int8 = codec::make_codec({"int8"});
  const std::vector<int64_t> units{9, 4, 11, 1, 6};  // 31 values; the 1-value unit has empty pieces
  const int64_t n = 31;
  for (const std::vector<int>& sites : {std::vector<int>{2, 3}, std::vector<int>{3, 1, 2}})
    for (const codec::Codec* codec : std::vector<const codec::Codec*>{nullptr, int8.get()}) {
      SCOPED_TRACE(::testing::Message() << sites.size() << " sites" << (codec ? ", int8" : ", exact"));
      const Holdings holdings = interleaved_holdings(sites, units);
      const HoldingsOutcome o = exchange_holdings(sites, n, [&](size_t) { return holdings; }, codec);
      const at::Tensor expected = plain_weighted_mean(sites.size(), n);
      for (size_t s = 0; s < sites.size(); ++s) {
        EXPECT_TRUE(at::equal(o.assembled[s], o.assembled[0])) << "site " << s << " differs from site 0";
        if (!codec) {
          EXPECT_TRUE(at::equal(o.assembled[s], expected)) << "site " << s << o.assembled[s] << expected;
        }
      }
      if (codec) {
        const float err = (o.assembled[0] - expected).abs().max().item<float>();
        EXPECT_LT(err, 0.05f);
        EXPECT_GT(err, 0.0f);  // it really was lossy
      }
    }
}

// Sites may write the same holding differently: site 0 with each piece split into touching
// halves and empty spans between, site 1 merged. Both normalise to the same segments: the
// result is the plain weighted mean, and every worker sends exactly the bytes it sends when
// both sites write the holding alike.
TEST(Hierarchical, EveryWorkerHoldingsWrittenDifferentlyAgree) {
  const std::vector<int> sites{2, 3};
  const std::vector<int64_t> units{9, 4, 11};
  const int64_t n = 24;
  const Holdings merged = interleaved_holdings(sites, units);
  Holdings split = merged;
  for (auto& site : split)
    for (auto& spans : site) {
      std::vector<Span> out;
      for (const Span& x : spans) {
        const int64_t mid = x.begin + (x.end - x.begin) / 2;
        out.push_back({x.begin, x.begin});
        out.push_back({x.begin, mid});
        out.push_back({mid, x.end});
      }
      spans = std::move(out);
    }
  const HoldingsOutcome alike = exchange_holdings(sites, n, [&](size_t) { return merged; });
  const HoldingsOutcome mixed = exchange_holdings(sites, n, [&](size_t s) { return s == 0 ? split : merged; });
  const at::Tensor expected = plain_weighted_mean(sites.size(), n);
  for (size_t s = 0; s < sites.size(); ++s) {
    EXPECT_TRUE(at::equal(mixed.assembled[s], expected)) << "site " << s << mixed.assembled[s] << expected;
    EXPECT_TRUE(at::equal(alike.assembled[s], expected)) << "site " << s;
    EXPECT_EQ(mixed.bytes_sent[s], alike.bytes_sent[s]) << "site " << s;
  }
}

// Bad holdings throw from the call, naming the site, the worker and the values; the call queues
// nothing, and a good exchange after them runs as usual.
TEST(Hierarchical, EveryWorkerBadHoldingsThrowWithTheReason) {
  const std::vector<int> sites{2, 1};
  const std::vector<std::vector<Span>> whole{{{0, 10}}};
  const std::vector<std::pair<Holdings, std::string>> cases{
      {{{{{0, 3}, {6, 8}}, {{8, 10}, {3, 6}}}, whole}, "site #0 worker 1: spans out of order, [3, 6) after [8, 10)"},
      {{{{{0, 5}, {4, 6}}, {{6, 10}}}, whole}, "site #0 worker 0: spans [0, 5) and [4, 6) overlap"},
      {{{{{0, 6}}, {{5, 10}}}, whole}, "site #0: worker 1's span [5, 10) overlaps worker 0's [0, 6)"},
      {{{{{0, 4}}, {{5, 10}}}, whole}, "site #0: values [4, 5) are held by no worker"},
      {{{{{0, 5}, {7, 6}}, {{5, 10}}}, whole}, "site #0 worker 0: span #1 [7, 6) ends before it begins"},
      {{{{{0, 5}}, {{5, 10}}}, {{{0, 12}}}}, "site #1's workers hold [0, 12), site #0's [0, 10)"},
      {{{{{0, 5}}, {{5, 10}}}, {{{0, 5}}, {{5, 10}}}}, "holdings for 2 workers of site #1, it has 1"},
      {{{{{0, 5}}, {{5, 10}}}}, "holdings for 1 sites, the job has 2"},
  };
  const Holdings good{{{{0, 2}, {5, 8}}, {{2, 5}, {8, 10}}}, whole};
  testing::run_cluster(
      sites,
      [&](testing::Rank& r) {
        for (const auto& [holdings, why] : cases) {
          try {
            r.hierarchy->exchange_parts_async(at::zeros({5}), holdings, {});
            ADD_FAILURE() << "no error for: " << why;
          } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
          }
        }
        const std::vector<Span>& mine = good[r.site][static_cast<size_t>(r.local_rank)];
        try {  // a part that is not this worker's spans' values
          r.hierarchy->exchange_parts_async(at::zeros({r.site == 0 ? 6 : 11}), good, {});
          ADD_FAILURE() << "no error for a part of the wrong size";
        } catch (const Error& e) {
          const std::string why = str_cat("site #", r.site, " worker ", r.local_rank, "'s part has ",
                                          r.site == 0 ? 6 : 11, " values, its spans hold ", r.site == 0 ? 5 : 10);
          EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
        }
        at::Tensor part = gather_spans(at::full({10}, static_cast<float>(r.site)), mine);
        r.hierarchy->exchange_parts_async(part, good, {})->wait(Deadline::after(std::chrono::seconds(30)));
        EXPECT_TRUE(at::equal(part, at::full({part.numel()}, 0.5f))) << part;
      },
      std::chrono::seconds(60), /*every_worker=*/true);
}

TEST(Hierarchical, MismatchedSizesAreAnErrorNotAHang) {
  EXPECT_THROW(testing::run_cluster({1, 1},
                                    [&](testing::Rank& r) {
                                      at::Tensor t = at::ones({r.site == 0 ? 10 : 11});
                                      r.hierarchy->allreduce(t);
                                    },
                                    std::chrono::seconds(20)),
               Error);
}

}  // namespace
}  // namespace nebula::collective
