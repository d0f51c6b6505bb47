#include "collective/hierarchical.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <atomic>
#include <cmath>
#include <mutex>
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

TEST(Hierarchical, BroadcastFromFirstCopiesGlobalRankZero) {
  testing::run_cluster({2, 2}, [&](testing::Rank& r) {
    at::Tensor t = data_of(r.global_rank, 333);
    r.hierarchy->broadcast_from_first(t);
    EXPECT_TRUE(at::equal(t, data_of(0, 333)));
    CommStats s = r.hierarchy->stats();
    if (r.local_rank == 0) {
      EXPECT_GT(s.wan_bytes_sent, 333u * 4);  // the gateway sent its site's sum over the WAN
    } else {
      EXPECT_EQ(s.wan_bytes_sent, 0u);
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
