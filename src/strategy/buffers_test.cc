// Model buffers (Strategy::set_buffers): BatchNorm's running statistics and its counter end
// equal on every worker of every site, at the values the strategy's averaging implies.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <map>
#include <mutex>

#include "collective/testing.h"
#include "strategy/diloco.h"
#include "strategy/sync.h"

namespace nebula::strategy {
namespace {

constexpr int64_t kFeatures = 3;
constexpr double kMomentum = 0.1;  // BatchNorm1d's default

// Worker `rank`'s batch at `step`: 4 + rank rows (so the workers' weights differ), values that
// differ by rank and step.
std::vector<std::vector<double>> batch_of(int rank, int64_t step) {
  std::vector<std::vector<double>> rows(static_cast<size_t>(4 + rank), std::vector<double>(kFeatures));
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t c = 0; c < kFeatures; ++c)
      rows[i][static_cast<size_t>(c)] =
          std::sin(7.0 * rank + 3.0 * static_cast<double>(step) + 1.3 * static_cast<double>(i) + static_cast<double>(c)) +
          0.5 * rank;
  return rows;
}

std::vector<double> column_means(const std::vector<std::vector<double>>& rows) {
  std::vector<double> m(kFeatures, 0.0);
  for (const auto& r : rows)
    for (size_t c = 0; c < m.size(); ++c) m[c] += r[c] / static_cast<double>(rows.size());
  return m;
}

struct Buffers {
  std::vector<at::Tensor> values;  // running_mean, running_var, num_batches_tracked
};

// Trains BatchNorm1d → Linear on `sites` with `make` strategy for `steps` steps (SGD, MSE to the
// rows' sums); returns every worker's buffers by global rank. The batch normalization comes
// first, so its running mean is a function of the data alone.
std::map<int, Buffers> train(const std::vector<int>& sites, int64_t steps,
                             const std::function<std::unique_ptr<Strategy>(collective::testing::Rank&)>& make) {
  std::mutex mu;
  std::map<int, Buffers> out;
  collective::testing::run_cluster(sites, [&](collective::testing::Rank& r) {
    torch::nn::Sequential model(nullptr);
    {
      std::lock_guard<std::mutex> lock(mu);  // the default generator is shared by the threads
      at::manual_seed(100 + r.global_rank);  // init() makes the weights equal
      model = torch::nn::Sequential(torch::nn::BatchNorm1d(kFeatures), torch::nn::Linear(kFeatures, 1));
    }
    std::unique_ptr<Strategy> strategy = make(r);
    auto params = model->parameters();
    strategy->set_buffers(model->buffers());
    strategy->init(params);
    torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05));
    for (int64_t step = 0; strategy->keep_training(step, steps); ++step) {
      const auto rows = batch_of(r.global_rank, step);
      at::Tensor x = at::empty({static_cast<int64_t>(rows.size()), kFeatures}, at::kFloat);
      for (size_t i = 0; i < rows.size(); ++i)
        for (int64_t c = 0; c < kFeatures; ++c)
          x[static_cast<int64_t>(i)][c] = static_cast<float>(rows[i][static_cast<size_t>(c)]);
      at::Tensor loss = (model->forward(x).squeeze(1) - x.sum(1)).pow(2).mean();
      const double weight = static_cast<double>(rows.size());
      opt.zero_grad();
      strategy->before_backward(weight);
      loss.backward();
      strategy->sync_gradients(params, weight);
      opt.step();
      strategy->after_step(step);
    }
    strategy->finish();
    std::lock_guard<std::mutex> lock(mu);
    for (auto& b : model->buffers()) out[r.global_rank].values.push_back(b.detach().clone());
  });
  return out;
}

void expect_all_equal(const std::map<int, Buffers>& got, size_t workers) {
  ASSERT_EQ(got.size(), workers);
  const auto& first = got.begin()->second.values;
  ASSERT_EQ(first.size(), 3u);
  for (const auto& [rank, b] : got)
    for (size_t i = 0; i < first.size(); ++i)
      EXPECT_TRUE(at::equal(b.values[i], first[i])) << "rank " << rank << " buffer " << i << ": " << b.values[i]
                                                    << " vs rank 0's " << first[i];
}

void expect_running_mean(const Buffers& got, const std::vector<double>& expected) {
  for (int64_t c = 0; c < kFeatures; ++c)
    EXPECT_NEAR(got.values[0][c].item<double>(), expected[static_cast<size_t>(c)], 1e-5) << "feature " << c;
}

// sync: every step the buffers are averaged over every worker, weighted like the gradients;
// the running mean is then the EMA of the weighted mean of the workers' batch means.
TEST(Buffers, SyncAveragesThemOverEveryWorkerEveryStep) {
  const std::vector<int> sites{2, 1};
  const int64_t steps = 5;
  auto got = train(sites, steps, [](collective::testing::Rank& r) {
    return std::make_unique<SyncStrategy>(*r.hierarchy, nullptr, 4ull << 20, std::chrono::seconds(60));
  });
  expect_all_equal(got, 3);
  std::vector<double> mean(kFeatures, 0.0);
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<double> step_mean(kFeatures, 0.0);
    double total = 0;
    for (int rank = 0; rank < 3; ++rank) {
      const auto rows = batch_of(rank, step);
      const auto m = column_means(rows);
      for (size_t c = 0; c < m.size(); ++c) step_mean[c] += static_cast<double>(rows.size()) * m[c];
      total += static_cast<double>(rows.size());
    }
    for (size_t c = 0; c < mean.size(); ++c) mean[c] = (1 - kMomentum) * mean[c] + kMomentum * step_mean[c] / total;
  }
  expect_running_mean(got.at(0), mean);
  EXPECT_EQ(got.at(0).values[2].item<int64_t>(), steps);  // num_batches_tracked
}

// diloco: inside a site every step (weighted by the workers' weights), over the sites at the
// end of every round (weighted by the sites' weights over the round).
TEST(Buffers, DilocoAveragesThemInsideTheSiteEveryStepAndOverSitesEveryRound) {
  const std::vector<int> sites{2, 1};
  const int64_t h = 3, steps = 6;
  auto got = train(sites, steps, [&](collective::testing::Rank& r) {
    DilocoOptions o;
    o.inner_steps = h;
    o.num_sites = sites.size();
    o.site_index = r.site;
    o.timeout = std::chrono::seconds(60);
    o.heterogeneous = false;
    return std::make_unique<DilocoStrategy>(*r.hierarchy, o);
  });
  expect_all_equal(got, 3);
  const std::vector<std::vector<int>> ranks_of_site = {{0, 1}, {2}};
  std::vector<double> global(kFeatures, 0.0);
  for (int64_t round = 0; round < steps / h; ++round) {
    std::vector<double> sum(kFeatures, 0.0);
    double total = 0;
    for (const auto& ranks : ranks_of_site) {
      std::vector<double> site_mean = global;
      double site_weight = 0;
      for (int64_t k = 0; k < h; ++k) {
        std::vector<double> step_mean(kFeatures, 0.0);
        double w = 0;
        for (int rank : ranks) {
          const auto rows = batch_of(rank, round * h + k);
          const auto m = column_means(rows);
          for (size_t c = 0; c < m.size(); ++c) step_mean[c] += static_cast<double>(rows.size()) * m[c];
          w += static_cast<double>(rows.size());
        }
        for (size_t c = 0; c < site_mean.size(); ++c)
          site_mean[c] = (1 - kMomentum) * site_mean[c] + kMomentum * step_mean[c] / w;
        site_weight += w;
      }
      for (size_t c = 0; c < sum.size(); ++c) sum[c] += site_weight * site_mean[c];
      total += site_weight;
    }
    for (size_t c = 0; c < global.size(); ++c) global[c] = sum[c] / total;
  }
  expect_running_mean(got.at(0), global);
  EXPECT_EQ(got.at(0).values[2].item<int64_t>(), steps);
}

// streaming with a delay: the buffers travel with the round's last fragment; the run ends on a
// merge with no progress in flight, so every worker ends equal.
TEST(Buffers, StreamingWithDelayEndsWithEqualBuffers) {
  const std::vector<int> sites{2, 1};
  auto got = train(sites, 8, [&](collective::testing::Rank& r) {
    DilocoOptions o;
    o.name = "streaming";
    o.inner_steps = 4;
    o.fragments = 2;
    o.delay = 1;
    o.num_sites = sites.size();
    o.site_index = r.site;
    o.timeout = std::chrono::seconds(60);
    o.heterogeneous = false;
    return std::make_unique<DilocoStrategy>(*r.hierarchy, o);
  });
  expect_all_equal(got, 3);
  EXPECT_EQ(got.at(0).values[2].item<int64_t>(), 8);
}

// Without the strategy's averaging the workers' buffers differ (their data differ): the checks
// above are not satisfied by construction.
TEST(Buffers, DifferWithoutAveraging) {
  auto got = train({2, 1}, 3, [](collective::testing::Rank& r) {
    struct ParamsOnly : SyncStrategy {
      using SyncStrategy::SyncStrategy;
      void init(const std::vector<at::Tensor>& params) override {
        buffers_.clear();
        SyncStrategy::init(params);
      }
    };
    return std::make_unique<ParamsOnly>(*r.hierarchy, nullptr, 4ull << 20, std::chrono::seconds(60));
  });
  EXPECT_FALSE(at::equal(got.at(0).values[0], got.at(2).values[0]));
}

}  // namespace
}  // namespace nebula::strategy
