#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <mutex>

#include "collective/testing.h"
#include "model/mlm_batch.h"
#include "model/mlm_encoder.h"
#include "model/testing.h"
#include "strategy/sync.h"

namespace nebula::strategy {
namespace {

using model::testing::tiny_model_config;

model::MlmBatch union_batch(int rows) {
  model::SpecialIds ids;
  ids.vocab_size = 40;
  std::vector<std::vector<int>> seqs;
  for (int i = 0; i < rows; ++i) {
    std::vector<int> s{2};
    for (int j = 0; j < 3 + i % 7; ++j) s.push_back(5 + (i * 7 + j * 3) % 35);
    s.push_back(3);
    seqs.push_back(s);
  }
  model::MlmBatcher b(seqs, ids, 0.3, rows, 5);
  std::vector<const std::vector<int>*> all;
  for (auto& s : seqs) all.push_back(&s);
  return b.make(all);
}

std::vector<at::Tensor> params_of(model::MlmEncoder& m) { return m->parameters(); }

// A sync step on several sites equals one single-process step on the union of their batches
// (same initial weights, same data): the weighted mean of per-worker mean gradients, weighted
// by predicted tokens, is the union batch's mean gradient.
void check_equivalence(const std::vector<int>& sites, bool overlap, uint64_t bucket_bytes = 4ull << 20) {
  int world = 0;
  for (int w : sites) world += w;
  const int rows_per_worker = 3;
  model::MlmBatch all = union_batch(world * rows_per_worker);

  at::manual_seed(11);
  model::MlmEncoder reference(tiny_model_config(), 40, 0);
  std::vector<at::Tensor> initial;
  for (auto& p : params_of(reference)) initial.push_back(p.detach().clone());
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.5));
  ref_opt.zero_grad();
  reference->loss(all.ids, all.labels).backward();
  std::vector<at::Tensor> ref_grads;
  for (auto& p : params_of(reference)) ref_grads.push_back(p.grad().clone());
  ref_opt.step();

  std::mutex mu;
  collective::testing::run_cluster(sites, [&](collective::testing::Rank& r) {
    model::MlmEncoder m(nullptr);
    {
      std::lock_guard<std::mutex> lock(mu);  // the default generator is shared by the threads
      at::manual_seed(100 + r.global_rank);    // different random init everywhere...
      m = model::MlmEncoder(tiny_model_config(), 40, 0);
    }
    if (r.global_rank == 0) {  // ...except global rank 0, which holds the reference's weights
      at::NoGradGuard g;
      auto ps = params_of(m);
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(initial[i]);
    }
    SyncStrategy strategy(*r.hierarchy, nullptr, bucket_bytes);
    strategy.init(params_of(m));
    auto ps = params_of(m);
    for (size_t i = 0; i < ps.size(); ++i) ASSERT_TRUE(at::equal(ps[i], initial[i])) << "init param " << i;

    at::Tensor ids = all.ids.narrow(0, r.global_rank * rows_per_worker, rows_per_worker);
    at::Tensor labels = all.labels.narrow(0, r.global_rank * rows_per_worker, rows_per_worker);
    const double predicted = labels.ne(model::kIgnoreIndex).sum().item<double>();
    torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.5));
    opt.zero_grad();
    if (overlap) strategy.before_backward(predicted);  // buckets go out from the backward hooks
    m->loss(ids, labels).backward();
    if (overlap) {
      // Every bucket was queued from the hooks before backward returned (every parameter gets
      // a gradient here), and with small buckets there are many of them.
      EXPECT_GT(strategy.num_buckets(), 5u);
      EXPECT_EQ(strategy.buckets_queued(), strategy.num_buckets());
    } else {
      EXPECT_EQ(strategy.buckets_queued(), 0u);  // sync_gradients queues them all
    }
    strategy.sync_gradients(ps, predicted);
    for (size_t i = 0; i < ps.size(); ++i)
      EXPECT_TRUE(at::allclose(ps[i].grad(), ref_grads[i], 1e-4, 1e-6))
          << "grad " << i << " max diff " << (ps[i].grad() - ref_grads[i]).abs().max().item<float>();
    opt.step();
    auto ref_params = params_of(reference);
    for (size_t i = 0; i < ps.size(); ++i)
      EXPECT_TRUE(at::allclose(ps[i], ref_params[i], 1e-4, 1e-6)) << "param " << i;
  });
}

TEST(SyncStrategy, TwoSitesEqualOneUnionBatchStep) { check_equivalence({1, 1}, false); }
TEST(SyncStrategy, UnevenSitesEqualOneUnionBatchStep) { check_equivalence({2, 1}, false); }
// The same with gradients sent from autograd hooks while backward runs, in many small buckets
// (1 KiB: most parameters get a bucket of their own), so the overlap path really is taken.
TEST(SyncStrategy, OverlappedSmallBucketsEqualOneUnionBatchStep) { check_equivalence({2, 1}, true, 1024); }

TEST(MakeBuckets, CutsRunsOfAboutTheBucketSize) {
  std::vector<at::Tensor> ts{at::zeros({100}), at::zeros({100}), at::zeros({1000}), at::zeros({10})};
  auto b = make_buckets(ts, 800);  // 400 + 400 bytes fit; 4000 alone; 40 alone after it
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], std::make_pair(size_t{0}, size_t{2}));
  EXPECT_EQ(b[1], std::make_pair(size_t{2}, size_t{3}));
  EXPECT_EQ(b[2], std::make_pair(size_t{3}, size_t{4}));
}

TEST(Flatten, RoundTrip) {
  std::vector<at::Tensor> ts{at::randn({2, 3}), at::randn({0}), at::randn({5})};
  at::Tensor flat = flatten(ts);
  EXPECT_EQ(flat.numel(), 11);
  std::vector<at::Tensor> out{at::zeros({2, 3}), at::zeros({0}), at::zeros({5})};
  unflatten_into(flat, out);
  for (size_t i = 0; i < ts.size(); ++i) EXPECT_TRUE(at::equal(ts[i], out[i]));
}

}  // namespace
}  // namespace nebula::strategy
