#include "strategy/diloco.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <limits>
#include <map>
#include <array>
#include <functional>
#include <mutex>

#include "collective/testing.h"
#include "model/mlm_batch.h"
#include "model/mlm_encoder.h"
#include "model/testing.h"
#include "parallel/shard_layout.h"

namespace nebula::strategy {
namespace {

using model::testing::tiny_model_config;

// A deterministic stream of small MLM batches, different per `stream`.
model::MlmBatcher batches_for(uint64_t stream) {
  model::SpecialIds ids;
  ids.vocab_size = 40;
  std::vector<std::vector<int>> seqs;
  for (int i = 0; i < 24; ++i) {
    std::vector<int> s{2};
    for (int j = 0; j < 3 + i % 7; ++j) s.push_back(5 + static_cast<int>((i * 7 + j * 3 + stream * 5) % 35));
    s.push_back(3);
    seqs.push_back(s);
  }
  return model::MlmBatcher(seqs, ids, 0.3, 4, stream);
}

model::MlmEncoder make_model(uint64_t seed, const ModelConfig& config = tiny_model_config()) {
  static std::mutex mu;  // the default generator is shared by the threads
  std::lock_guard<std::mutex> lock(mu);
  at::manual_seed(seed);
  return model::MlmEncoder(config, 40, 0);
}

DilocoOptions options(int64_t h, size_t sites, size_t site) {
  DilocoOptions o;
  o.inner_steps = h;
  o.num_sites = sites;
  o.site_index = site;
  o.timeout = std::chrono::seconds(60);
  o.heterogeneous = false;  // measured step times differ from run to run; tests pin them
  return o;
}

// The training loop of src/train/worker.cc, reduced to its strategy calls.
// `setup` runs after init(), before the first step (e.g. the worker's set_sharding); `before`
// at the start of every step, after keep_training (the step's round open).
template <typename AfterStep>
void train(Strategy& strategy, model::MlmEncoder& m, model::MlmBatcher& data, int64_t steps, AfterStep after,
           const std::function<void(std::vector<at::Tensor>&)>& setup = {},
           const std::function<void(int64_t)>& before = {}) {
  auto params = m->parameters();
  strategy.init(params);
  if (setup) setup(params);
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2));
  for (int64_t step = 0; strategy.keep_training(step, steps); ++step) {
    if (before) before(step);
    model::MlmBatch b = data.next();
    at::Tensor loss = m->loss(b.ids, b.labels);
    opt.zero_grad();
    strategy.before_backward(static_cast<double>(b.predicted));
    loss.backward();
    strategy.sync_gradients(params, static_cast<double>(b.predicted));
    opt.step();
    strategy.after_step(step);
    after(step);
  }
  strategy.finish();
}

// llm.c style: the degenerate case equals the plain computation. One site, H = 1, outer
// lr 1, no momentum: θ_global − 1·(θ_global − θ_local) = θ_local, so DiLoCo is plain AdamW.
TEST(Diloco, OneSiteH1OuterLr1NoMomentumEqualsPlainTraining) {
  model::MlmEncoder reference = make_model(7);
  model::MlmBatcher ref_data = batches_for(1);
  {
    auto params = reference->parameters();
    torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2));
    for (int i = 0; i < 6; ++i) {
      model::MlmBatch b = ref_data.next();
      opt.zero_grad();
      reference->loss(b.ids, b.labels).backward();
      opt.step();
    }
  }
  collective::testing::run_cluster({1}, [&](collective::testing::Rank& r) {
    model::MlmEncoder m = make_model(7);
    model::MlmBatcher data = batches_for(1);
    DilocoOptions o = options(1, 1, 0);
    o.outer_lr = 1.0;
    o.outer_momentum = 0.0;
    DilocoStrategy s(*r.hierarchy, o);
    int64_t steps = 0;
    train(s, m, data, 6, [&](int64_t) { ++steps; });
    EXPECT_EQ(steps, 6);
    EXPECT_EQ(s.outer_steps(), 6);
    // Not bit-equal: θ_g − (θ_g − θ_l) is θ_l within an ulp, and AdamW divides by √v, which
    // grows such differences for parameters whose gradients are near zero. The updates
    // themselves are ~lr = 1e-2 per step.
    auto ours = m->parameters(), theirs = reference->parameters();
    for (size_t i = 0; i < ours.size(); ++i)
      EXPECT_TRUE(at::allclose(ours[i], theirs[i], 1e-4, 1e-4))
          << "param " << i << " max diff " << (ours[i] - theirs[i]).abs().max().item<float>();
  });
}

// Evaluation mid-round sees θ_global (what every site agrees on), and training goes on from
// the local replica afterwards, unchanged. One site, H = 4: after 2 inner steps the replica
// has moved, θ_global has not.
TEST(Diloco, WithGlobalWeightsShowsThetaGlobalAndRestoresTheReplica) {
  collective::testing::run_cluster({1}, [&](collective::testing::Rank& r) {
    model::MlmEncoder m = make_model(3);
    model::MlmBatcher data = batches_for(2);
    DilocoStrategy s(*r.hierarchy, options(4, 1, 0));
    auto params = m->parameters();
    std::vector<at::Tensor> start;
    for (auto& p : params) start.push_back(p.detach().clone());
    int64_t step = 0;
    train(s, m, data, 4, [&](int64_t i) {
      step = i;
      if (i != 1) return;
      std::vector<at::Tensor> local;
      for (auto& p : params) local.push_back(p.detach().clone());
      bool moved = false;
      for (size_t k = 0; k < params.size(); ++k) moved = moved || !at::equal(local[k], start[k]);
      ASSERT_TRUE(moved);
      s.with_global_weights([&] {
        for (size_t k = 0; k < params.size(); ++k) EXPECT_TRUE(at::equal(params[k], start[k])) << "param " << k;
      });
      for (size_t k = 0; k < params.size(); ++k) EXPECT_TRUE(at::equal(params[k], local[k])) << "param " << k;
      EXPECT_THROW(s.with_global_weights([] { throw Error("evaluation failed"); }), Error);
      for (size_t k = 0; k < params.size(); ++k) EXPECT_TRUE(at::equal(params[k], local[k])) << "param " << k;
    });
    EXPECT_EQ(step, 3);
  });
}

// Two sites of one worker each run DiLoCo (H = h, `rounds` rounds; outer lr, μ and Nesterov as
// given) with plain SGD as the inner optimizer on known gradients: params[i] -= inner_lr ·
// gradient(site, step, i) over the flat parameter vector, the site's step weight `weight[site]`.
// Returns each site's final flat parameters; every site took `rounds` outer steps.
std::vector<at::Tensor> two_sites_of_sgd(int64_t h, int64_t rounds, double inner_lr, double outer_lr, double mu,
                                         bool nesterov, const std::function<std::vector<at::Tensor>(size_t)>& params_of,
                                         const std::function<double(size_t, int64_t, size_t)>& gradient,
                                         const std::array<double, 2>& weight) {
  std::mutex mu_finals;
  std::vector<at::Tensor> finals(2);
  collective::testing::run_cluster({1, 1}, [&](collective::testing::Rank& r) {
    std::vector<at::Tensor> params = params_of(r.site);
    DilocoOptions o = options(h, 2, r.site);
    o.outer_lr = outer_lr;
    o.outer_momentum = mu;
    o.nesterov = nesterov;
    DilocoStrategy s(*r.hierarchy, o);
    s.init(params);
    for (int64_t step = 0; s.keep_training(step, rounds * h); ++step) {
      s.sync_gradients(params, weight[r.site]);  // one worker per site: only the weight counts
      size_t i = 0;
      for (auto& p : params) {
        float* v = p.data_ptr<float>();
        for (int64_t k = 0; k < p.numel(); ++k, ++i) v[k] -= static_cast<float>(inner_lr * gradient(r.site, step, i));
      }
      s.after_step(step);
    }
    s.finish();
    EXPECT_EQ(s.outer_steps(), rounds);
    std::lock_guard<std::mutex> lock(mu_finals);
    finals[r.site] = flatten(params);
  });
  return finals;
}

// The outer step with momentum against the recurrence of diloco.h, written out here in plain
// doubles. Two sites whose inner optimizer is plain SGD on known per-site gradients (so θ_local
// at each send is known), site weights 1 and 3 per step, μ = 0.9, outer lr 0.7, 4 rounds of
// H = 2; Nesterov on and off:
//   Δ̄ = Σ_s W_s (θ_global − θ_local,s) / Σ_s W_s      (W_s = the site's weight since its last send)
//   m ← μ m + Δ̄     θ_global ← θ_global − lr (Δ̄ + μ m)  (Nesterov)  or  θ_global − lr m
//   θ_local ← θ_global
TEST(Diloco, OuterMomentumMatchesTheRecurrence) {
  const int64_t h = 2, rounds = 4;
  const double inner_lr = 0.1, mu = 0.9, outer_lr = 0.7;
  const double site_weight[2] = {1.0, 3.0};
  const std::vector<double> theta0 = {0.5, -1.0, 2.0, 0.25, 3.0, -0.5};  // a 2×2 and a 2-vector
  auto gradient = [](size_t site, int64_t step, size_t i) {
    return (site == 0 ? 1.0 : -0.5) * (1.0 + 0.5 * static_cast<double>(step)) * (static_cast<double>(i) - 1.5) +
           (site == 0 ? 0.2 : 0.7);
  };
  std::map<bool, std::vector<double>> expected_of;
  for (bool nesterov : {true, false}) {
    std::vector<double> global = theta0, m(theta0.size(), 0.0);
    for (int64_t round = 0; round < rounds; ++round) {
      std::vector<double> mean(theta0.size(), 0.0);
      for (size_t s = 0; s < 2; ++s) {
        std::vector<double> local = global;
        for (int64_t k = 0; k < h; ++k)
          for (size_t i = 0; i < local.size(); ++i) local[i] -= inner_lr * gradient(s, round * h + k, i);
        for (size_t i = 0; i < local.size(); ++i)
          mean[i] += site_weight[s] * static_cast<double>(h) * (global[i] - local[i]);
      }
      for (size_t i = 0; i < global.size(); ++i) {
        mean[i] /= (site_weight[0] + site_weight[1]) * static_cast<double>(h);
        m[i] = mu * m[i] + mean[i];
        global[i] -= outer_lr * (nesterov ? mean[i] + mu * m[i] : m[i]);
      }
    }
    expected_of[nesterov] = global;

    auto params_of = [&](size_t site) {
      std::vector<float> start(theta0.begin(), theta0.end());
      if (site == 1)
        for (float& v : start) v += 5;  // init() makes every replica global rank 0's
      return std::vector<at::Tensor>{at::tensor(std::vector<float>(start.begin(), start.begin() + 4)).view({2, 2}),
                                     at::tensor(std::vector<float>(start.begin() + 4, start.end()))};
    };
    const std::vector<at::Tensor> finals = two_sites_of_sgd(h, rounds, inner_lr, outer_lr, mu, nesterov, params_of,
                                                            gradient, {site_weight[0], site_weight[1]});
    for (size_t site = 0; site < 2; ++site) {
      ASSERT_EQ(finals[site].numel(), static_cast<int64_t>(global.size()));
      for (size_t i = 0; i < global.size(); ++i)  // float32 arithmetic on values of size ~10
        EXPECT_NEAR(finals[site][static_cast<int64_t>(i)].item<float>(), global[i], 2e-5 * std::max(1.0, std::fabs(global[i])))
            << (nesterov ? "nesterov" : "plain momentum") << ", site " << site << ", value " << i;
    }
  }
  // The two variants end far apart, so the comparison above tells them apart.
  double apart = 0;
  for (size_t i = 0; i < theta0.size(); ++i) apart = std::max(apart, std::fabs(expected_of[true][i] - expected_of[false][i]));
  EXPECT_GT(apart, 0.1);
}

// The arithmetic itself, bit for bit: two sites of equal weight running the same inner steps
// (so the sites' mean Δ̄ is each site's Δ exactly), against the outer step written out with the
// same float32 tensor operations in the same order. A change in the order of the outer step's
// operations (or in what Δ is taken of) changes the last bits and fails this test, which the
// tolerance of OuterMomentumMatchesTheRecurrence would let pass.
TEST(Diloco, OuterStepsEqualTheReferenceBitForBit) {
  const int64_t h = 2, rounds = 3;
  const double inner_lr = 0.1, mu = 0.9, outer_lr = 0.7;
  std::vector<float> theta0;  // a [16, 8] matrix and a 37-vector
  for (int i = 0; i < 16 * 8 + 37; ++i) theta0.push_back(static_cast<float>(2.0 * std::cos(1.3 * i)));
  auto gradient = [](int64_t step, size_t i) {
    return std::sin(0.3 * static_cast<double>(step) + 0.7 * static_cast<double>(i)) + 0.1;
  };
  auto inner_step = [&](at::Tensor& t, int64_t step) {  // what the sites do below, on one flat tensor
    float* v = t.data_ptr<float>();
    for (int64_t i = 0; i < t.numel(); ++i) v[i] -= static_cast<float>(inner_lr * gradient(step, static_cast<size_t>(i)));
  };
  for (bool nesterov : {true, false}) {
    at::Tensor global = at::tensor(theta0), m = at::zeros({static_cast<int64_t>(theta0.size())});
    for (int64_t round = 0; round < rounds; ++round) {
      at::Tensor local = global.clone();
      for (int64_t k = 0; k < h; ++k) inner_step(local, round * h + k);
      at::Tensor delta = global.clone().sub_(local);
      m.mul_(mu).add_(delta);
      global.sub_(nesterov ? delta.add_(m * mu) : m, outer_lr);
    }
    auto params_of = [&](size_t) {
      return std::vector<at::Tensor>{at::tensor(std::vector<float>(theta0.begin(), theta0.begin() + 128)).view({16, 8}),
                                     at::tensor(std::vector<float>(theta0.begin() + 128, theta0.end()))};
    };
    const std::vector<at::Tensor> finals = two_sites_of_sgd(
        h, rounds, inner_lr, outer_lr, mu, nesterov, params_of,
        [&](size_t, int64_t step, size_t i) { return gradient(step, i); }, {1.0, 1.0});
    for (size_t site = 0; site < 2; ++site)
      EXPECT_TRUE(at::equal(finals[site], global))
          << (nesterov ? "nesterov" : "plain momentum") << ", site " << site << ": max difference "
          << (finals[site] - global).abs().max().item<float>();
  }
}

// Two sites (one with two workers), different data and different initial weights: right
// after every merge, every worker of every site holds bit-identical values of the merged
// fragment (with one fragment: the whole model), and training moved them. With and without a
// lossy codec.
void check_identical_after_outer_steps(const std::string& codec, int64_t fragments,
                                       const ModelConfig& config = tiny_model_config()) {
  const std::vector<int> sites{2, 1};
  const int64_t h = 3, steps = 9;
  std::mutex mu;
  std::map<std::pair<int64_t, int>, std::vector<at::Tensor>> merged;  // (outer step, global rank)
  collective::testing::run_cluster(sites, [&](collective::testing::Rank& r) {
    model::MlmEncoder m = make_model(100 + r.global_rank, config);
    model::MlmBatcher data = batches_for(10 + r.global_rank);
    DilocoOptions o = options(h, sites.size(), r.site);
    o.codec = codec;
    o.fragments = fragments;
    DilocoStrategy s(*r.hierarchy, o);
    int64_t seen = 0;
    train(s, m, data, steps, [&](int64_t) {
      for (; seen < s.outer_steps(); ++seen) {  // fragments merge in order, one per slot here
        auto [offset, numel] = s.fragment_range(static_cast<size_t>(seen % fragments));
        at::Tensor values = flatten(m->parameters()).narrow(0, offset, numel).clone();
        std::lock_guard<std::mutex> lock(mu);
        merged[{seen + 1, r.global_rank}] = {values};
      }
    });
    EXPECT_EQ(s.rounds(), steps / h);
    EXPECT_EQ(s.outer_steps(), steps / h * fragments);
  });
  const int64_t outer = steps / h * fragments;
  ASSERT_EQ(merged.size(), static_cast<size_t>(outer * 3));
  for (int64_t k = 1; k <= outer; ++k) {
    const auto& first = merged.at({k, 0});
    for (int g = 1; g < 3; ++g) {
      const auto& other = merged.at({k, g});
      for (size_t i = 0; i < first.size(); ++i)
        EXPECT_TRUE(at::equal(first[i], other[i])) << "outer step " << k << " rank " << g << " tensor " << i;
    }
  }
  // The same fragment one round later: training moved it.
  bool moved = false;
  const auto& a = merged.at({1, 0});
  const auto& b = merged.at({1 + fragments, 0});
  for (size_t i = 0; i < a.size(); ++i) moved |= !at::equal(a[i], b[i]);
  EXPECT_TRUE(moved) << "the outer steps changed nothing";
}

TEST(Diloco, TwoSitesHoldIdenticalWeightsAfterEveryOuterStep) { check_identical_after_outer_steps("none", 1); }
TEST(Diloco, IdenticalWeightsWithInt4Codec) { check_identical_after_outer_steps("int4", 1); }
TEST(Diloco, IdenticalWeightsWithSparseOuterUpdates) { check_identical_after_outer_steps("topk", 1); }
TEST(Streaming, FragmentsWithoutDelayAlsoEndRoundsIdentical) { check_identical_after_outer_steps("int8", 3); }

// Fragments are ranges of the flat parameter vector of n/F values each (up to half a row of
// a tensor a cut falls in), not whole tensors: in the MLM encoder of examples/mlm.toml the token
// embedding alone is 48 % of the model (64,000 of 133,120 values). They tile the vector in order.
TEST(Streaming, FragmentsHoldEqualSharesOfTheModel) {
  ModelConfig mlm_example;  // examples/mlm.toml
  mlm_example.dim = 64;
  mlm_example.layers = 2;
  mlm_example.heads = 4;
  mlm_example.ffn = 128;
  for (auto [config, vocab] : {std::pair{mlm_example, int64_t{1000}}, std::pair{ModelConfig{}, int64_t{8000}},
                               std::pair{tiny_model_config(), int64_t{40}}}) {
    for (int64_t fragments : {2, 3, 4}) {
      collective::testing::run_cluster({1}, [&](collective::testing::Rank& r) {
        model::MlmEncoder m = model::MlmEncoder(config, vocab, 0);
        DilocoOptions o = options(4, 1, 0);
        o.name = "streaming";
        o.fragments = fragments;
        DilocoStrategy s(*r.hierarchy, o);
        s.init(m->parameters());
        int64_t n = 0, largest = 0;
        for (auto& p : m->parameters()) n += p.numel(), largest = std::max(largest, p.numel());
        ASSERT_EQ(s.num_fragments(), static_cast<size_t>(fragments));
        int64_t next = 0;
        for (size_t j = 0; j < s.num_fragments(); ++j) {
          auto [offset, numel] = s.fragment_range(j);
          EXPECT_EQ(offset, next) << "fragment " << j;
          next = offset + numel;
          const double share = static_cast<double>(numel) / (static_cast<double>(n) / static_cast<double>(fragments));
          EXPECT_NEAR(share, 1.0, 0.1) << "fragment " << j << " of " << fragments << ": " << numel << " of " << n
                                       << " values (vocab " << vocab << ")";
        }
        EXPECT_EQ(next, n);
        // Whole tensors could not do it: one tensor is above a fragment's share + 10 %.
        if (vocab == 1000 && fragments >= 3) {
          EXPECT_GT(largest, 1.1 * static_cast<double>(n) / static_cast<double>(fragments));
        }
      });
    }
  }
}

// PowerSGD encodes tensor by tensor: with fragments that cut tensors, each piece of a fragment
// is a row block of its tensor (a matrix still), and training keeps every replica identical.
// The model is wide enough (dim 128) that a cut falls inside a matrix PowerSGD sends at low
// rank (at least 4096 values, powersgd_low_rank): the attention's input projection, [384, 128].
TEST(Streaming, PerTensorCodecOnSplitTensorsKeepsReplicasIdentical) {
  ModelConfig wide = tiny_model_config();
  wide.dim = 128;
  wide.ffn = 256;
  wide.heads = 4;
  {
    model::MlmEncoder m = make_model(1, wide);
    bool split_low_rank = false;
    collective::testing::run_cluster({1}, [&](collective::testing::Rank& r) {
      DilocoOptions o = options(3, 1, 0);
      o.fragments = 3;
      DilocoStrategy s(*r.hierarchy, o);
      s.init(m->parameters());
      int64_t start = 0;
      for (auto& p : m->parameters()) {
        for (size_t j = 1; j < s.num_fragments(); ++j) {
          const int64_t cut = s.fragment_range(j).first;
          split_low_rank |= cut > start && cut < start + p.numel() && p.dim() == 2 && p.numel() >= 4096;
        }
        start += p.numel();
      }
    });
    ASSERT_TRUE(split_low_rank) << "no cut falls inside a low-rank matrix: the test would not test that";
  }
  check_identical_after_outer_steps("powersgd", 3, wide);
}

// Streaming with a delay: each fragment is merged `delay` steps after it was sent, the inner
// progress made meanwhile is kept, and every fragment is synchronized once per round.
TEST(Streaming, DelayedMergesKeepInnerProgressAndCountEveryFragment) {
  const std::vector<int> sites{1, 1};
  std::mutex mu;
  std::vector<std::vector<at::Tensor>> finals(2);
  collective::testing::run_cluster(sites, [&](collective::testing::Rank& r) {
    model::MlmEncoder m = make_model(5);
    model::MlmBatcher data = batches_for(20 + r.global_rank);
    DilocoOptions o = options(4, 2, r.site);
    o.name = "streaming";
    o.fragments = 2;
    o.delay = 1;
    DilocoStrategy s(*r.hierarchy, o);
    int64_t steps = 0;
    train(s, m, data, 12, [&](int64_t) { ++steps; });
    EXPECT_EQ(steps, 12);
    EXPECT_EQ(s.rounds(), 3);
    EXPECT_EQ(s.outer_steps(), 6);
    std::lock_guard<std::mutex> lock(mu);
    for (auto& p : m->parameters()) {
      EXPECT_TRUE(at::isfinite(p).all().item<bool>());
      finals[r.global_rank].push_back(p.detach().clone());
    }
  });
  // The sites ran different data; the last fragment is merged with no progress in flight, the
  // first one after a step of local progress, so the sites differ there and agree elsewhere.
  bool some_equal = false, some_different = false;
  for (size_t i = 0; i < finals[0].size(); ++i) {
    if (at::equal(finals[0][i], finals[1][i])) some_equal = true;
    else some_different = true;
  }
  EXPECT_TRUE(some_equal);
  EXPECT_TRUE(some_different);
}

// ZeRO's sharded outer state ([parallel] shard != "none"): each worker keeps only its part of
// θ_global and the outer momentum (and of θ_local at a send), the gateway gathers the parts for
// the WAN and scatters the mean back, the site all-gathers the parameters. The same arithmetic
// elementwise: every worker's weights after every step, and θ_global as with_global_weights
// shows it, equal the unsharded run's bit for bit, on sites of 3 and 2 workers (whose parts
// differ, so the global-weight hash checked at every merge must combine the parts' CRCs into
// one value independent of the workers).
// `staging` > 0: the whole runs exchange once per round, the sharded ones (and a third,
// unsharded run) in staging's fragments sent together: the same weights again.
void check_sharded_outer_state(int64_t fragments, int64_t delay, const std::string& codec,
                               const std::vector<int>& sites = {3, 2}, uint64_t staging = 0) {
  SCOPED_TRACE(str_cat(fragments, " fragments, delay ", delay, ", codec ", codec, ", ", sites[0], " + ", sites[1],
                       " workers, staging ", staging));
  const int64_t h = 4, steps = 12;
  using Trace = std::map<std::pair<int, int64_t>, at::Tensor>;  // (global rank, step) -> flat weights
  auto run = [&](bool sharded, uint64_t staged, Trace& trace, Trace& global) {
    std::mutex mu;
    collective::testing::run_cluster(sites, [&](collective::testing::Rank& r) {
      model::MlmEncoder m = make_model(100 + r.global_rank);
      model::MlmBatcher data = batches_for(10 + r.global_rank);
      DilocoOptions o = options(h, sites.size(), r.site);
      o.name = fragments > 1 ? "streaming" : "diloco";
      o.fragments = fragments;
      o.delay = delay;
      o.codec = codec;
      o.staging_bytes = staged;
      DilocoStrategy s(*r.hierarchy, o);
      collective::SiteGroup& site = r.hierarchy->site();
      auto shard = [&](std::vector<at::Tensor>& params) {  // the parameters' storage as InnerOptimizer makes it
        if (!sharded || site.size() == 1) return;
        at::NoGradGuard no_grad;
        int64_t total = 0;
        for (const auto& p : params) total += p.numel();
        const int64_t n = site.size(), part = (total + n - 1) / n;
        at::Tensor flat = at::zeros({part * n});
        int64_t offset = 0;
        for (auto& p : params) {
          at::Tensor view = flat.narrow(0, offset, p.numel()).view(p.sizes());
          view.copy_(p);
          p.set_data(view);
          offset += p.numel();
        }
        s.set_sharding({flat, at::Tensor()});
        EXPECT_THROW(s.set_sharding({flat, at::Tensor()}), Error);  // once
      };
      std::vector<at::Tensor> params = m->parameters();
      train(
          s, m, data, steps,
          [&](int64_t step) {
            at::Tensor now = flatten(params).clone();
            std::lock_guard<std::mutex> lock(mu);
            trace[{r.global_rank, step}] = now;
          },
          shard);
      EXPECT_EQ(s.outer_steps(), steps / h * fragments);
      if (staged > 0) {  // pieces of about `staged` bytes (cut between rows), tiling the model
        const auto limit = static_cast<int64_t>(staged / sizeof(float));
        int64_t total = 0, longest_row = 0, covered = 0;
        for (const auto& p : params) {
          total += p.numel();
          if (p.dim() >= 2) longest_row = std::max(longest_row, p.numel() / p.size(0));
        }
        EXPECT_EQ(s.num_fragments(), static_cast<size_t>((total + limit - 1) / limit));
        for (size_t j = 0; j < s.num_fragments(); ++j) {
          auto [offset, numel] = s.fragment_range(j);
          EXPECT_EQ(offset, covered);
          EXPECT_LE(numel, limit + longest_row) << "fragment " << j;
          covered += numel;
        }
        EXPECT_EQ(covered, total);
      }
      const at::Tensor replica = flatten(params).clone();
      at::Tensor theta;
      s.with_global_weights([&] { theta = flatten(params).clone(); });
      EXPECT_TRUE(at::equal(flatten(params), replica)) << "the replica is put back";
      std::lock_guard<std::mutex> lock(mu);
      global[{r.global_rank, 0}] = theta;
    });
  };
  Trace whole, parts, whole_global, parts_global;
  run(false, 0, whole, whole_global);
  run(true, staging, parts, parts_global);
  auto expect_equal = [&](const Trace& other, const Trace& other_global, const char* what) {
    SCOPED_TRACE(what);
    ASSERT_EQ(whole.size(), other.size());
    for (const auto& [key, values] : whole)
      ASSERT_TRUE(at::equal(values, other.at(key))) << "rank " << key.first << " after step " << key.second;
    for (const auto& [key, values] : whole_global)
      EXPECT_TRUE(at::equal(values, other_global.at(key))) << "θ_global on rank " << key.first;
  };
  expect_equal(parts, parts_global, "sharded");
  if (staging > 0) {
    Trace staged, staged_global;
    run(false, staging, staged, staged_global);
    expect_equal(staged, staged_global, "whole, staged");
  }
  EXPECT_FALSE(at::equal(whole.at({0, 0}), whole.at({0, steps - 1})));  // training moved the weights
}

// ZeRO-2's site step: 3 workers with weights rank + 1, whose gradient values are (rank + 1) ·
// (index + 1). Backward's buckets (parallel/gradient_buckets.h) leave each worker's shard
// holding the site's sum Σ w_r g_r; sync_gradients all-reduces the weights beside it and leaves
// the weighted average Σ w_r g_r / Σ w_r there, exactly (small integers), on that shard only.
TEST(Diloco, ZeroTwoLeavesTheAverageOnTheShard) {
  collective::testing::run_cluster({3}, [&](collective::testing::Rank& r) {
    model::MlmEncoder m = make_model(7);
    std::vector<at::Tensor> params = m->parameters();
    DilocoStrategy s(*r.hierarchy, options(4, 1, 0));
    s.expect_sharding();
    s.init(params);
    collective::SiteGroup& site = r.hierarchy->site();
    int64_t total = 0;
    for (const auto& p : params) total += p.numel();
    const int64_t n = site.size(), part = (total + n - 1) / n;
    at::Tensor flat = at::zeros({part * n}), grads = at::zeros({part});
    const double weight = r.local_rank + 1;
    int64_t offset = 0;
    at::NoGradGuard no_grad;
    for (auto& p : params) {  // as InnerOptimizer lays them out
      flat.narrow(0, offset, p.numel()).copy_(p.reshape({-1}));
      p.set_data(flat.narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
    s.set_sharding({flat, grads});
    const double sum_w = 1 + 2 + 3, sum_w2 = 1 + 4 + 9;  // Σ w_r (r + 1) = Σ w_r²
    const int64_t begin = r.local_rank * part, end = std::min(begin + part, total);
    grads.narrow(0, 0, end - begin).copy_(at::arange(begin + 1, end + 1, at::kFloat).mul(sum_w2));  // the buckets' sum
    s.sync_gradients(params, weight);
    at::Tensor want = at::zeros({part});
    want.narrow(0, 0, end - begin).copy_(at::arange(begin + 1, end + 1, at::kFloat).mul(sum_w2 / sum_w));
    EXPECT_TRUE(at::allclose(grads, want, 1e-6, 0)) << "rank " << r.local_rank << ": "
                                                    << (grads - want).abs().max().item<float>();
    for (const auto& p : params) EXPECT_FALSE(p.grad().defined());
    // A gradient buffer of the whole model is refused: ZeRO-2's gradients are this worker's shard.
    DilocoStrategy t(*r.hierarchy, options(4, 1, 0));
    t.expect_sharding();
    t.init(params);
    EXPECT_THROW(t.set_sharding({flat, at::zeros({part * n})}), Error);
  });
}

TEST(Diloco, ShardedOuterStateEqualsTheWholeBitForBit) {
  check_sharded_outer_state(1, 0, "none");
  check_sharded_outer_state(1, 0, "none", {4, 1});
}
TEST(Diloco, ShardedOuterStateWithALossyCodec) { check_sharded_outer_state(1, 0, "int8"); }
// Gateway mode's bounded staging: the outer step's exchange in ~10 fragments of 4 KiB, sent
// together and merged one after another, changes no weight (the outer step is elementwise).
TEST(Diloco, StagedExchangeEqualsOneExchangeBitForBit) { check_sharded_outer_state(1, 0, "none", {3, 2}, 4096); }
TEST(Streaming, ShardedOuterStateWithFragmentsAndDelay) {
  check_sharded_outer_state(3, 1, "none");
  check_sharded_outer_state(4, 1, "int8", {2, 4});  // fragments smaller than a shard: some parts are empty
}

// ZeRO-3's start (init_from_shard): a site of two workers hands each its shard in the unit
// layout, a site of one its flat vector. Built from one seed, the sites' θ_global agree (the
// two-worker site's CRC is combined from its pieces in flat order, the other's is of the whole)
// and the one-worker site's is its parameters; built from
// two seeds, every worker of both sites stops at once with an error naming the mismatch
// (nothing can be copied: no worker holds the whole model).
TEST(Diloco, ZeroThreeStartsFromTheShardsAndRefusesReplicasThatDiffer) {
  for (const bool same : {true, false}) {
    SCOPED_TRACE(same ? "one seed" : "two seeds");
    collective::testing::run_cluster({2, 1}, [&](collective::testing::Rank& r) {
      model::MlmEncoder m = make_model(same ? 7 : 7 + r.site);
      std::vector<at::Tensor> params = m->parameters();
      std::vector<std::vector<int64_t>> shapes;
      int64_t total = 0;
      for (const auto& p : params) {
        shapes.push_back(p.sizes().vec());
        total += p.numel();
      }
      const std::vector<int64_t> bounds{0, total / 3, total};
      const at::Tensor flat = flatten(params);
      collective::SiteGroup& site = r.hierarchy->site();
      at::Tensor shard = flat;
      if (site.size() > 1) {  // this worker's pieces, as FullShard cuts them
        const parallel::ShardLayout layout(bounds, site.size());
        shard = at::zeros({layout.shard_numel()});
        for (const parallel::ShardRun& run : layout.runs(site.rank(), 0, total))
          shard.narrow(0, run.local, run.len).copy_(flat.narrow(0, run.flat, run.len));
      }
      DilocoStrategy s(*r.hierarchy, options(4, 2, r.site));
      if (site.size() > 1) s.expect_sharding();
      s.set_unit_bounds(bounds);
      if (!same) {
        try {
          s.init_from_shard(params, shapes, shard);
          ADD_FAILURE() << "replicas built from two seeds were accepted";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("initial weights differ between sites"), std::string::npos) << e.what();
        }
        return;
      }
      s.init_from_shard(params, shapes, shard);
      // θ_global is what the parameters held: evaluated with it, the replica is unchanged.
      if (site.size() == 1) {
        at::Tensor theta;
        s.with_global_weights([&] { theta = flatten(params); });
        EXPECT_TRUE(at::equal(theta, flat));
      }
      EXPECT_THROW(s.init_from_shard(params, {}, shard), Error);  // a shape per parameter
    });
  }
}

// Heterogeneous sites: a site three times faster runs three times the inner steps per round
// once the sites have exchanged their step times; both run the same number of rounds.
// The update guard ([6/7]): site 1's weights blow up (×1e6) just before a round ends. Its
// pseudo-gradient is far above strategy.max_update_norm, so both gateways leave it out; the
// round's outer step uses site 0 alone, every worker still holds identical weights after every
// merge, and the run goes on to the end.
TEST(Diloco, OversizeUpdateIsRejectedEverywhereAndTrainingGoesOn) {
  const std::vector<int> sites{1, 1};
  const int64_t h = 3, steps = 9;
  std::mutex mu;
  std::map<int, std::vector<at::Tensor>> final_params;
  std::map<int, int64_t> rejected;
  collective::testing::run_cluster(sites, [&](collective::testing::Rank& r) {
    model::MlmEncoder m = make_model(100 + r.global_rank);
    model::MlmBatcher data = batches_for(10 + r.global_rank);
    DilocoOptions o = options(h, sites.size(), r.site);
    o.max_update_norm = 1000;
    DilocoStrategy s(*r.hierarchy, o);
    train(s, m, data, steps, [&](int64_t step) {
      if (r.site == 1 && step == 3) {  // round 2 ends after step 5
        at::NoGradGuard no_grad;
        for (auto& p : m->parameters()) p.mul_(1e6);
      }
    });
    EXPECT_EQ(s.rounds(), steps / h);
    std::lock_guard<std::mutex> lock(mu);
    rejected[r.global_rank] = s.rejected_updates();
    for (auto& p : m->parameters()) final_params[r.global_rank].push_back(p.detach().clone());
    EXPECT_NE(s.decisions().back().find("rejected on every site"), std::string::npos) << s.decisions().back();
  });
  EXPECT_EQ(rejected[0], 1);
  EXPECT_EQ(rejected[1], 1);
  for (size_t i = 0; i < final_params[0].size(); ++i) {
    EXPECT_TRUE(at::isfinite(final_params[0][i]).all().item<bool>());
    EXPECT_TRUE(at::equal(final_params[0][i], final_params[1][i])) << "param " << i;
    EXPECT_LT(final_params[0][i].abs().max().item<float>(), 100.0f) << "param " << i;
  }
}

// Differential privacy ([6/7]): each round's outer step moves the global weights by the
// sites' mean privatized pseudo-gradient (outer lr 1, no momentum). Clipping alone bounds its
// norm by C; with noise σC per value, its norm is about σC·√n (n values: a chi distribution,
// within 10% for n in the thousands). The ε reported is the Gaussian mechanism's of L2
// sensitivity 2C (any two datasets of the site are neighbours; see DilocoOptions), composed over
// the releases, computed here without the accountant; a resumed strategy reports the same ε.
TEST(Diloco, PrivacyClipsAndNoisesWhatLeavesTheSiteAndCountsEpsilon) {
  for (double sigma : {0.0, 2.0}) {
    const double clip = 1e-3;
    collective::testing::run_cluster({1}, [&](collective::testing::Rank& r) {
      model::MlmEncoder m = make_model(5);
      model::MlmBatcher data = batches_for(3);
      DilocoOptions o = options(2, 1, 0);
      o.outer_lr = 1.0;
      o.outer_momentum = 0.0;
      o.dp_clip = clip;
      o.dp_noise_multiplier = sigma;
      DilocoStrategy s(*r.hierarchy, o);
      std::vector<at::Tensor> before;
      int64_t n = 0;
      for (auto& p : m->parameters()) n += p.numel();
      train(s, m, data, 6, [&](int64_t step) {
        std::vector<at::Tensor> now;
        for (auto& p : m->parameters()) now.push_back(p.detach().reshape({-1}).clone());
        at::Tensor flat = at::cat(now);
        if (step % 2 == 1) {  // a round just merged: the move is the privatized update
          if (!before.empty()) {
            const double moved = (flat - before[0]).norm().item<double>();
            if (sigma == 0)
              EXPECT_LE(moved, clip * 1.0001) << "step " << step;
            else
              EXPECT_NEAR(moved / (sigma * clip * std::sqrt(static_cast<double>(n))), 1.0, 0.1) << "step " << step;
          }
          before = {flat};
        }
      });
      const auto metrics = s.metrics();
      EXPECT_EQ(metrics.at("dp_releases"), 3);
      EXPECT_EQ(metrics.at("dp_clipped"), 3);  // AdamW moves far more than 1e-3 in two steps
      if (sigma == 0) {
        EXPECT_EQ(metrics.count("dp_epsilon"), 0u);  // clipping alone is no guarantee
      } else {
        // T releases of the Gaussian mechanism of sensitivity Δ = 2C and noise σ_abs = σC:
        // RDP ρ(α) = T α Δ² / (2 σ_abs²); ε = min over Opacus' default orders (1.1, 1.2, …,
        // 10.9, 12, …, 63) of ρ(α) + log((α − 1)/α) − (log δ + log α)/(α − 1).
        const double releases = 3, delta = 1e-5, delta_l2 = 2 * clip, sigma_abs = sigma * clip;
        std::vector<double> orders;
        for (int x = 1; x < 100; ++x) orders.push_back(1 + x / 10.0);
        for (int a = 12; a < 64; ++a) orders.push_back(a);
        double expected = std::numeric_limits<double>::infinity();
        for (double a : orders)
          expected = std::min(expected, releases * a * delta_l2 * delta_l2 / (2 * sigma_abs * sigma_abs) +
                                            std::log((a - 1) / a) - (std::log(delta) + std::log(a)) / (a - 1));
        EXPECT_NEAR(metrics.at("dp_epsilon"), expected, 1e-12 * expected);
        // By hand, σ = 2, T = 3, δ = 1e-5: ρ(α) = 3 · α · 4 / (2 · 4) = 1.5 α; the best listed order
        // is 3.6: ρ = 5.4, log(2.6/3.6) = −0.325422, −(log 1e-5 + log 3.6)/2.6 = 3.935381, so
        // ε = 9.009959. (Sensitivity C instead of 2C gave ε = 4.0113, at order 6.1.)
        EXPECT_NEAR(metrics.at("dp_epsilon"), 9.009959, 1e-6);
        // Resume: the releases already spent are added back with the same sensitivity.
        StrategyState saved;
        s.save_state(saved);
        DilocoStrategy resumed(*r.hierarchy, o);
        resumed.init(m->parameters());
        resumed.load_state(saved);
        EXPECT_DOUBLE_EQ(resumed.metrics().at("dp_epsilon"), metrics.at("dp_epsilon"));
      }
    });
  }
}

TEST(Diloco, FasterSiteRunsMoreInnerStepsPerRound) {
  const std::vector<int> sites{1, 1};
  std::mutex mu;
  std::vector<int64_t> local_steps(2), last_round_steps(2), rounds(2);
  collective::testing::run_cluster(sites, [&](collective::testing::Rank& r) {
    model::MlmEncoder m = make_model(5);
    model::MlmBatcher data = batches_for(30 + r.global_rank);
    DilocoOptions o = options(2, 2, r.site);
    o.heterogeneous = true;
    o.assumed_step_seconds = r.site == 0 ? 0.01 : 0.03;  // no wall-clock in tests
    DilocoStrategy s(*r.hierarchy, o);
    int64_t steps = 0;
    train(s, m, data, 8, [&](int64_t) { ++steps; });
    std::lock_guard<std::mutex> lock(mu);
    local_steps[r.site] = steps;
    last_round_steps[r.site] = s.round_inner_steps();
    rounds[r.site] = s.rounds();
    if (r.site == 0) {
      EXPECT_FALSE(s.decisions().empty());
    }
  });
  EXPECT_EQ(rounds[0], 4);
  EXPECT_EQ(rounds[1], 4);
  EXPECT_EQ(last_round_steps[0], 6);
  EXPECT_EQ(last_round_steps[1], 2);
  EXPECT_EQ(local_steps[1], 8);
  EXPECT_EQ(local_steps[0], 2 + 6 * 3);  // round 0 before any measurement, then 3x
}

// FedNova's normalisation: site 0 runs 3x faster (3 H inner steps a round from the first
// measurement on), each site moving its parameters by a fixed vector per step (v0 = (1, 0),
// v1 = (0, 1)) with the same weight per step. Weighted by tokens alone, the fast site's update
// would count 3 x 3 = 9 times the slow one's ((14.5, 2.5) after 4 rounds of H = 2); normalised
// by inner steps, each round moves both coordinates by H / 2: (4, 4).
TEST(Diloco, AFasterSiteDoesNotDominateTheMergedUpdate) {
  const std::vector<int> sites{1, 1};
  std::mutex mu;
  std::vector<std::vector<float>> global(2);
  std::vector<int64_t> local_steps(2);
  for (const bool every_worker : {false, true}) {
    SCOPED_TRACE(every_worker ? "every_worker" : "gateway");
    collective::testing::run_cluster(sites, [&](collective::testing::Rank& r) {
      DilocoOptions o = options(2, 2, r.site);
      o.heterogeneous = true;
      o.assumed_step_seconds = r.site == 0 ? 0.01 : 0.03;  // no wall-clock in tests
      o.outer_lr = 1.0;
      o.outer_momentum = 0.0;
      DilocoStrategy s(*r.hierarchy, o);
      std::vector<at::Tensor> params{at::zeros({2}, at::kFloat)};
      s.init(params);
      int64_t steps = 0;
      for (int64_t step = 0; s.keep_training(step, 8); ++step) {
        s.before_backward(1.0);
        s.sync_gradients(params, 1.0);
        params[0][r.site] += 1.0f;  // v_site
        s.after_step(step);
        ++steps;
      }
      s.finish();
      std::lock_guard<std::mutex> lock(mu);
      global[r.site] = {params[0][0].item<float>(), params[0][1].item<float>()};
      local_steps[r.site] = steps;
    }, std::chrono::seconds(60), every_worker);
    EXPECT_EQ(local_steps[0], 2 + 6 * 3);  // the fast site did run 3x the steps
    EXPECT_EQ(local_steps[1], 8);
    for (int site = 0; site < 2; ++site) {
      EXPECT_FLOAT_EQ(global[site][0], 4.0f) << "site " << site;
      EXPECT_FLOAT_EQ(global[site][1], 4.0f) << "site " << site;
    }
  }
}

// The controller's decisions as applied: with codec = "auto" and H = auto, every site runs each
// round with the same codec and H (step times pinned; the links' bandwidth is measured, so the
// choices themselves may differ from run to run, never between sites), each decision line names
// the codec and H its round ran, and the rounds' H add up to the steps (one outer step each).
TEST(Diloco, EverySiteAppliesTheControllersChoiceInTheSameRound) {
  const std::vector<int> sites{1, 1};
  constexpr int64_t kSteps = 130;
  std::mutex mu;
  std::vector<std::vector<std::pair<std::string, int64_t>>> applied(2);  // per round: codec, H
  std::vector<std::vector<std::string>> decisions(2);
  std::vector<int64_t> outer_steps(2);
  collective::testing::run_cluster(sites, [&](collective::testing::Rank& r) {
    model::MlmEncoder m = make_model(5);
    model::MlmBatcher data = batches_for(30 + r.global_rank);
    DilocoOptions o = options(0, 2, r.site);
    o.codec = "auto";
    o.adaptive = true;
    o.assumed_step_seconds = 0.02;
    o.assumed_bits_per_s = 1e9;  // the links' own estimate may have no sample yet for so small exchanges
    DilocoStrategy s(*r.hierarchy, o);
    std::vector<std::pair<std::string, int64_t>> mine;
    // Right after keep_training the round is open and rounds() is its index.
    train(s, m, data, kSteps, [](int64_t) {}, {}, [&](int64_t) {
      if (s.rounds() == static_cast<int64_t>(mine.size())) mine.emplace_back(s.codec_kind(), s.round_inner_steps());
    });
    std::lock_guard<std::mutex> lock(mu);
    applied[r.site] = mine;
    decisions[r.site] = s.decisions();
    outer_steps[r.site] = s.outer_steps();
  });
  EXPECT_EQ(applied[0], applied[1]);
  EXPECT_EQ(decisions[0], decisions[1]);
  int64_t steps = 0;
  for (const auto& [codec, h] : applied[0]) steps += h;
  EXPECT_EQ(steps, kSteps);
  EXPECT_EQ(outer_steps[0], static_cast<int64_t>(applied[0].size()));
  int64_t controller_lines = 0, measured = 0;
  for (const std::string& line : decisions[0]) {  // "round R: codec C, H N — why"
    if (line.find(": codec ") == std::string::npos) continue;  // "this site runs ..." (heterogeneous)
    ++controller_lines;
    measured += line.find("no measurements yet") == std::string::npos;
    const size_t round = std::stoul(line.substr(6));
    ASSERT_LT(round, applied[0].size()) << line;
    const auto& [codec, h] = applied[0][round];
    EXPECT_NE(line.find(nebula::str_cat("codec ", codec, ", H ")), std::string::npos) << line;
    // The last round may be cut short by the end of training: H is the one named, or less.
    const int64_t named = std::stoll(line.substr(line.find(", H ") + 4));
    EXPECT_TRUE(h == named || (round + 1 == applied[0].size() && h < named)) << line << " ran H " << h;
  }
  // The safe start, then a decision on measurements (round 2: round 0's exchange measured the
  // links, round 1's carried the numbers).
  EXPECT_GE(controller_lines, 2);
  EXPECT_GE(measured, 1);
}

// A fixed setting's merge gap is measured too (the controller acts on it only with
// max_loss_penalty) and reported in metrics(): losses flat at 5.0 within each round and 5.1 over
// the first m = H/4 = 2 steps after every outer step give a gap of exactly +2 % at every round.
TEST(Diloco, AFixedSettingsMergeGapIsInItsMetrics) {
  constexpr int64_t kH = 8, kSteps = 5 * kH;
  std::mutex mu;
  std::vector<std::map<std::string, double>> metrics(2);
  collective::testing::run_cluster({1, 1}, [&](collective::testing::Rank& r) {
    model::MlmEncoder m = make_model(5);
    model::MlmBatcher data = batches_for(40 + r.global_rank);
    DilocoStrategy s(*r.hierarchy, options(kH, 2, r.site));
    // The worker hands a step's loss over before after_step, whose outer step ends a round.
    train(s, m, data, kSteps, [](int64_t) {}, {},
          [&](int64_t step) { s.observe_loss(step >= kH && step % kH < 2 ? 5.1 : 5.0); });
    std::lock_guard<std::mutex> lock(mu);
    metrics[r.site] = s.metrics();
  });
  for (const auto& m : metrics) {
    ASSERT_TRUE(m.count("merge_gap"));
    EXPECT_NEAR(m.at("merge_gap"), 0.02, 1e-9);
    EXPECT_EQ(m.at("merge_gap_rounds"), 4);  // rounds 1 to 4: the last outer step has no steps after it
  }
}

// PEFT-style: only the parameters handed to the strategy cross the WAN, and frozen ones never
// change. Bytes per exchange = the codec's encoding of the trainable values.
TEST(Diloco, OnlyTrainableParametersCrossTheWan) {
  collective::testing::run_cluster({1, 1}, [&](collective::testing::Rank& r) {
    model::MlmEncoder m = make_model(9);
    auto all = m->parameters();
    std::vector<at::Tensor> trainable, frozen_before;
    std::vector<at::Tensor> frozen;
    for (size_t i = 0; i < all.size(); ++i) {
      if (i % 2 == 0) {
        trainable.push_back(all[i]);
      } else {
        all[i].set_requires_grad(false);
        frozen.push_back(all[i]);
        frozen_before.push_back(all[i].detach().clone());
      }
    }
    int64_t trainable_numel = 0;
    for (auto& p : trainable) trainable_numel += p.numel();
    DilocoOptions o = options(2, 2, r.site);
    DilocoStrategy s(*r.hierarchy, o);
    s.init(trainable);
    torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(1e-2));
    model::MlmBatcher data = batches_for(40 + r.global_rank);
    for (int64_t step = 0; s.keep_training(step, 6); ++step) {
      model::MlmBatch b = data.next();
      at::Tensor loss = m->loss(b.ids, b.labels);
      opt.zero_grad();
      loss.backward();
      s.sync_gradients(trainable, static_cast<double>(b.predicted));
      opt.step();
      s.after_step(step);
    }
    s.finish();
    for (size_t i = 0; i < frozen.size(); ++i) EXPECT_TRUE(at::equal(frozen[i], frozen_before[i])) << i;
    auto stats = r.hierarchy->stats();
    // 3 exchanges (rounds) of the trainable values alone, as raw float32, and the initial
    // replica check's count of differing workers (1 value; its CRC is broadcast as bytes, not
    // all-reduced); the replicas were equal already.
    EXPECT_EQ(stats.codec_bytes_in, static_cast<uint64_t>(4 * (3 * trainable_numel + 1)));
    EXPECT_EQ(stats.codec_bytes_out, stats.codec_bytes_in);
  });
}

}  // namespace
}  // namespace nebula::strategy
