#include "parallel/inner_optimizer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <mutex>
#include <thread>

#include "collective/testing.h"
#include "nebula/error.h"
#include "util/temp_dir.h"

namespace nebula::parallel {
namespace {

using namespace std::chrono_literals;

// The same values on every thread (no shared generator): 47 elements (a multiple of none of
// 2, 3, 4), with a 0- and a 1-element tensor among them.
std::vector<at::Tensor> make_params() {
  return {at::cos(at::arange(35, at::kFloat).mul(1.3)).view({5, 7}).set_requires_grad(true),
          at::zeros({0}).set_requires_grad(true), at::full({1}, 0.25f).set_requires_grad(true),
          at::cos(at::arange(11, at::kFloat).mul(0.7)).set_requires_grad(true)};
}

// The gradients of step `s` (the same on every worker: as after the strategy's averaging),
// written into the existing .grad as backward does, or (`replace`) as new tensors, as a
// caller's own loop might.
void set_grads(std::vector<at::Tensor>& params, int s, bool replace = false) {
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor g = at::sin(at::arange(params[i].numel(), at::kFloat).add(static_cast<double>(s * 7 + static_cast<int>(i))))
                       .reshape(params[i].sizes());
    if (params[i].grad().defined() && !replace)
      params[i].mutable_grad().copy_(g);
    else
      params[i].mutable_grad() = g.clone();
  }
}

// Step `s`'s gradients made by a backward (as a training step makes them): d/dp Σ p · g = g.
void backward_with_grads(std::vector<at::Tensor>& params, int s) {
  at::Tensor loss = at::zeros({});
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor g = at::sin(at::arange(params[i].numel(), at::kFloat).add(static_cast<double>(s * 7 + static_cast<int>(i))))
                             .reshape(params[i].sizes());
    loss = loss + (params[i] * g).sum();
  }
  loss.backward();
}

// One step as the worker runs it: the gradients of step `s`, then the optimizer. ZeRO-2: made
// by a backward, which the buckets reduce-scatter as it runs (rank 0's weighted 1, everyone
// else's 0, so the site's sum is step s's gradients).
void step_site(InnerOptimizer& o, collective::SiteGroup& site, std::vector<at::Tensor>& params, int s,
               bool replace = false) {
  o.zero_grad();
  if (o.gradients_sharded()) {
    o.before_backward(site.rank() == 0 ? 1.0 : 0.0);
    backward_with_grads(params, s);
    o.end_backward();
    for (const auto& p : params) EXPECT_FALSE(p.grad().defined()) << "ZeRO-2 left a .grad";
  } else {
    set_grads(params, s, replace);
  }
  o.step();
}

// ZeRO-1 and ZeRO-2 over 1 to 4 workers end every step with the parameters of one AdamW over
// all of them; each worker holds the moments of ceil(47 / N) elements; a checkpoint of the
// shards resumes exactly, and one taken with another sharding is refused, naming the setting.
// ZeRO-2 (step_site): each shard of flat_grad() holds exactly the reference's gradients.
void check_sharded_adamw(const int kWorkers, const std::string& mode, uint64_t bucket_bytes = 4u << 20) {
  SCOPED_TRACE(str_cat(kWorkers, " workers, shard = ", mode, ", buckets of ", bucket_bytes, " bytes"));
  auto sharded_step = [&](InnerOptimizer& o, collective::SiteGroup& site, std::vector<at::Tensor>& params, int s) {
    step_site(o, site, params, s, mode == "optimizer" && s % 2 == 1);
  };
  constexpr int kSteps = 5;
  std::vector<at::Tensor> reference = make_params();
  {
    collective::testing::StorePort solo_port;
    collective::SiteGroup solo = collective::testing::join_group("solo", 0, 1, 30s, solo_port);
    InnerOptimizer whole(reference, 1e-2, 0.1, "none", solo);
    EXPECT_FALSE(whole.sharded());
    EXPECT_EQ(whole.state_numel(), 47);
    for (int s = 0; s < kSteps + 1; ++s) {
      whole.zero_grad();
      set_grads(reference, s);
      whole.step();
    }
  }
  collective::testing::run_site(str_cat("zero-", mode, "-", kWorkers), kWorkers, [&](collective::SiteGroup& site) {
    const int r = site.rank();
    std::vector<at::Tensor> params = make_params();
    Checkpoint k;
    {
      InnerOptimizer sharded(params, 1e-2, 0.1, mode, site, nullptr, bucket_bytes);
      EXPECT_EQ(sharded.sharded(), kWorkers > 1);
      EXPECT_EQ(sharded.gradients_sharded(), kWorkers > 1 && mode == "gradients");
      EXPECT_EQ(sharded.state_numel(), (47 + kWorkers - 1) / kWorkers);
      for (int s = 0; s < kSteps; ++s) sharded_step(sharded, site, params, s);
      sharded.save(k);
    }
    InnerOptimizer resumed(params, 1e-2, 0.1, mode, site, nullptr, bucket_bytes);
    resumed.load(k);
    sharded_step(resumed, site, params, kSteps);
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_TRUE(at::allclose(params[i], reference[i], 1e-5, 1e-6))
          << "rank " << r << " parameter " << i << ": max diff " << (params[i] - reference[i]).abs().max().item<float>();

    if (kWorkers > 1) {
      Checkpoint whole_state;
      whole_state.state["optim"] = {{"steps", {1, 1, 1, 1}}};  // as written by shard = "none" (no "shard" entry)
      try {
        resumed.load(whole_state);
        ADD_FAILURE() << "a checkpoint of another sharding was loaded";
      } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("parallel.shard"), std::string::npos) << e.what();
      }
    }
  });
}

// The schedule's values at known steps: warmup from lr/W to lr, then cosine or linear decay
// to lr_floor·lr at the last step, or lr throughout.
TEST(LrSchedule, WarmupThenDecayToTheFloorAtTheLastStep) {
  ModelConfig m;
  m.lr = 1e-3;
  m.warmup_steps = 10;
  m.lr_floor = 0.1;
  m.lr_schedule = "cosine";
  EXPECT_DOUBLE_EQ(scheduled_lr(m, 0, 110), 1e-4);
  EXPECT_DOUBLE_EQ(scheduled_lr(m, 4, 110), 5e-4);
  EXPECT_DOUBLE_EQ(scheduled_lr(m, 9, 110), 1e-3);
  EXPECT_DOUBLE_EQ(scheduled_lr(m, 10, 110), 1e-3);                          // decay starts at the peak
  EXPECT_NEAR(scheduled_lr(m, 59, 110), 1e-3 * (0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 49 / 99.0))), 1e-15);
  EXPECT_NEAR(scheduled_lr(m, 109, 110), 1e-4, 1e-15);                      // the floor at the last step
  EXPECT_NEAR(scheduled_lr(m, 500, 110), 1e-4, 1e-15);                      // and after it (diloco's drain)
  m.lr_schedule = "linear";
  EXPECT_NEAR(scheduled_lr(m, 10 + 33, 110), 1e-3 * (1 - 0.9 / 3), 1e-15);
  EXPECT_NEAR(scheduled_lr(m, 109, 110), 1e-4, 1e-15);
  m.lr_schedule = "constant";
  EXPECT_DOUBLE_EQ(scheduled_lr(m, 3, 110), 4e-4);
  EXPECT_DOUBLE_EQ(scheduled_lr(m, 109, 110), 1e-3);
  m.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(scheduled_lr(m, 0, 110), 1e-3);
  EXPECT_THROW(scheduled_lr(m, -1, 110), Error);
}

// Clipping bounds the gradient the step uses to the norm given (a gradient below it is left
// alone), and set_lr is the step size AdamW takes: its first step moves each value by ~lr.
TEST(InnerOptimizer, ClippingBoundsTheGradientAndSetLrSetsTheStep) {
  collective::testing::StorePort port;
  collective::SiteGroup solo = collective::testing::join_group("clip", 0, 1, 30s, port);
  std::vector<at::Tensor> params = make_params();
  InnerOptimizer o(params, 1e-2, 0.0, "none", solo);
  set_grads(params, 3);
  auto norm = [&] {
    double sq = 0;
    for (const auto& p : params) sq += p.grad().pow(2).sum().item<double>();
    return std::sqrt(sq);
  };
  const double before = norm();
  ASSERT_GT(before, 2.0);
  EXPECT_NEAR(o.clip_grad_norm(1.0), before, 1e-4);
  EXPECT_NEAR(norm(), 1.0, 1e-4);
  EXPECT_NEAR(o.clip_grad_norm(5.0), 1.0, 1e-4);  // below the bound: unchanged
  EXPECT_NEAR(norm(), 1.0, 1e-4);
  EXPECT_THROW(o.clip_grad_norm(0), Error);
  const at::Tensor start = params[0].detach().clone();
  o.set_lr(0.5);
  o.step();
  // AdamW's first step is lr·sign(g) (bias-corrected m/sqrt(v)), so every value moved by 0.5.
  EXPECT_NEAR((params[0].detach() - start).abs().max().item<double>(), 0.5, 1e-3);
}

// ZeRO-2: the norm is the site's (each worker holds the average of its shard only), so every
// worker scales by the same factor and the clipped shards are the whole clipped gradient's.
TEST(InnerOptimizer, ClippingShardedGradientsUsesTheWholeNorm) {
  std::vector<at::Tensor> reference = make_params();
  set_grads(reference, 2);
  double sq = 0;
  for (const auto& p : reference) sq += p.grad().pow(2).sum().item<double>();
  const double whole = std::sqrt(sq);
  collective::testing::run_site("clip-zero2", 3, [&](collective::SiteGroup& site) {
    std::vector<at::Tensor> params = make_params();
    InnerOptimizer o(params, 1e-2, 0.0, "gradients", site);
    o.zero_grad();
    // As after backward and the strategy's average: this worker's shard of the whole gradient.
    std::vector<at::Tensor> flat;
    for (const auto& p : reference) flat.push_back(p.grad().reshape({-1}));
    const int64_t n = o.flat_grad().numel();
    ASSERT_EQ(n, (47 + site.size() - 1) / site.size());
    auto shard_of = [&](at::Tensor whole) {
      return at::constant_pad_nd(whole, {0, n * site.size() - whole.numel()}, 0).narrow(0, site.rank() * n, n);
    };
    o.flat_grad().copy_(shard_of(at::cat(flat)));
    EXPECT_NEAR(o.clip_grad_norm(1.0), whole, 1e-4);
    EXPECT_TRUE(at::allclose(o.flat_grad(), shard_of(at::cat(flat) / (whole + 1e-6)), 1e-5, 1e-6));
  });
}

TEST(InnerOptimizer, ShardedAdamWEqualsTheWholeOneAndResumesFromItsShards) {
  for (int workers = 1; workers <= 4; ++workers) check_sharded_adamw(workers, "optimizer");
}

TEST(InnerOptimizer, ZeroTwoEqualsTheWholeOneAndResumesFromItsShards) {
  for (int workers = 1; workers <= 4; ++workers) {
    check_sharded_adamw(workers, "gradients");        // one bucket
    check_sharded_adamw(workers, "gradients", 24);    // buckets of 6 values: {11}, {0, 1}, {35} from the back
  }
}

// Resharding: checkpoints written by one number of workers and shard mode, resumed under
// another (the moments joined, each worker taking its part), step on as the whole AdamW does.
void check_resharded(int from, const std::string& from_mode, int to, const std::string& to_mode) {
  SCOPED_TRACE(str_cat(from, " workers (", from_mode, ") -> ", to, " workers (", to_mode, ")"));
  constexpr int kSteps = 4;
  std::vector<at::Tensor> reference = make_params();
  {
    collective::testing::StorePort port;
    collective::SiteGroup solo = collective::testing::join_group("solo", 0, 1, 30s, port);
    InnerOptimizer whole(reference, 1e-2, 0.1, "none", solo);
    for (int s = 0; s < kSteps + 1; ++s) step_site(whole, solo, reference, s);
  }
  std::mutex mu;
  std::vector<Checkpoint> written(static_cast<size_t>(from));
  std::vector<at::Tensor> at_checkpoint;
  collective::testing::run_site(str_cat("from-", from), from, [&](collective::SiteGroup& site) {
    std::vector<at::Tensor> params = make_params();
    InnerOptimizer o(params, 1e-2, 0.1, from_mode, site);
    for (int s = 0; s < kSteps; ++s) step_site(o, site, params, s);
    Checkpoint k;
    o.save(k);
    std::lock_guard<std::mutex> lock(mu);
    written[static_cast<size_t>(site.rank())] = k;
    if (site.rank() == 0)
      for (const auto& p : params) at_checkpoint.push_back(p.detach().clone());
  });
  std::vector<const Checkpoint*> ranks;
  for (const auto& k : written) ranks.push_back(&k);
  collective::testing::run_site(str_cat("to-", to), to, [&](collective::SiteGroup& site) {
    std::vector<at::Tensor> params = make_params();
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(at_checkpoint[i]);  // the model, as restored
    }
    InnerOptimizer o(params, 1e-2, 0.1, to_mode, site);
    o.load_resharded(ranks);
    step_site(o, site, params, kSteps);
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_TRUE(at::allclose(params[i], reference[i], 1e-5, 1e-6))
          << "rank " << site.rank() << " parameter " << i << ": max diff "
          << (params[i] - reference[i]).abs().max().item<float>();
  });
}

TEST(InnerOptimizer, ReshardedCheckpointsResumeOnAnotherLayout) {
  check_resharded(2, "optimizer", 3, "optimizer");
  check_resharded(3, "optimizer", 2, "gradients");
  check_resharded(4, "gradients", 1, "none");
  check_resharded(2, "none", 4, "optimizer");
  check_resharded(2, "optimizer", 2, "none");
  // The shards of fewer workers than wrote them cannot be joined.
  collective::testing::StorePort port;
  collective::SiteGroup solo = collective::testing::join_group("solo", 0, 1, 30s, port);
  std::vector<Checkpoint> two(2);
  collective::testing::run_site("pair", 2, [&](collective::SiteGroup& site) {
    std::vector<at::Tensor> params = make_params();
    InnerOptimizer o(params, 1e-2, 0.1, "optimizer", site);
    o.zero_grad();
    set_grads(params, 0);
    o.step();
    o.save(two[static_cast<size_t>(site.rank())]);
  });
  InnerOptimizer o(make_params(), 1e-2, 0.1, "none", solo);
  try {
    o.load_resharded({&two[0]});
    ADD_FAILURE() << "one of two shards was taken for the whole";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("cut into 2 shards"), std::string::npos) << e.what();
  }
}

// Resharding from checkpoint files (as a resumed worker does: its sharded state left in the
// old workers' files) reads of every old worker's moments and parameter shard only the values
// of this worker's own shard, exactly, and never a whole copy; and 2 -> 3 -> 2 workers gives
// back the first two workers' state bit for bit (the resharding only moves values).
TEST(InnerOptimizer, ReshardingFromFilesReadsOnlyEachWorkersPartAndRoundTripsBitForBit) {
  for (const std::string mode : {"optimizer", "gradients"}) {
    SCOPED_TRACE(mode);
    nebula::testing::TempDir dir("reshard");
    auto rank_dir = [&](int workers, int q) { return str_cat(dir.path(), "/", workers, "-", q); };
    auto optim = [](const std::string& name) { return name.rfind("optim/", 0) == 0; };
    std::mutex mu;
    std::vector<Checkpoint> first(2), back(2);
    // `from` workers' files resumed on `to` workers, each saving its state (into `out` too).
    auto reshard = [&](int from, int to, std::vector<Checkpoint>* out) {
      collective::testing::run_site(str_cat("to-", to), to, [&](collective::SiteGroup& site) {
        std::vector<Checkpoint> olds;
        for (int q = 0; q < from; ++q) olds.push_back(*load_latest_checkpoint(rank_dir(from, q), "h", INT64_MAX, optim));
        std::vector<const Checkpoint*> ranks;
        int64_t unread_bytes = 0;
        for (const auto& k : olds) {
          ranks.push_back(&k);
          ASSERT_TRUE(k.unread && k.tensors.empty()) << "the sharded state was loaded";
          for (const auto& [name, e] : k.unread->tensors) unread_bytes += e.numel * 4;
        }
        std::vector<at::Tensor> params = make_params();
        InnerOptimizer o(params, 1e-2, 0.1, mode, site);
        const int64_t before = range_bytes_read();
        o.load_resharded(ranks);
        const int64_t read = range_bytes_read() - before;
        // Its shard's values of the two moments and of the parameters, and nothing else.
        const int64_t mine = o.layout().count(site.rank(), 0, o.total_numel());
        EXPECT_EQ(read, 3 * 4 * mine) << "rank " << site.rank();
        EXPECT_LE(read * to, unread_bytes) << "rank " << site.rank() << " read more than its 1/" << to;
        Checkpoint k;
        k.step = 4;
        o.save(k);
        save_checkpoint(rank_dir(to, site.rank()), k, "h");
        std::lock_guard<std::mutex> lock(mu);
        if (out) (*out)[static_cast<size_t>(site.rank())] = k;
      });
    };
    collective::testing::run_site("from-2", 2, [&](collective::SiteGroup& site) {
      std::vector<at::Tensor> params = make_params();
      InnerOptimizer o(params, 1e-2, 0.1, mode, site);
      for (int s = 0; s < 4; ++s) step_site(o, site, params, s);
      Checkpoint k;
      k.step = 4;
      o.save(k);
      save_checkpoint(rank_dir(2, site.rank()), k, "h");
      std::lock_guard<std::mutex> lock(mu);
      first[static_cast<size_t>(site.rank())] = k;
    });
    reshard(2, 3, nullptr);
    reshard(3, 2, &back);
    for (size_t q = 0; q < 2; ++q)
      for (const char* name : {"optim/0/exp_avg", "optim/0/exp_avg_sq", "optim/0/param"}) {
        ASSERT_TRUE(back[q].tensors.count(name)) << name;
        EXPECT_TRUE(at::equal(back[q].tensors.at(name), first[q].tensors.at(name))) << "rank " << q << " " << name;
      }
  }
}

// An unknown mode is refused naming the key; "full" (ZeRO-3) needs its FullShard exactly when
// the site has more than one worker (on one worker it is the whole optimizer).
TEST(InnerOptimizer, UnknownModesAndZeroThreeWithoutItsShardsAreRefusedNamingTheKey) {
  auto refused = [](const std::function<void()>& make) {
    try {
      make();
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("parallel.shard"), std::string::npos) << e.what();
    }
  };
  collective::testing::StorePort port;
  collective::SiteGroup solo = collective::testing::join_group("solo", 0, 1, 30s, port);
  refused([&] { InnerOptimizer o(make_params(), 1e-3, 0, "zero4", solo); });
  EXPECT_FALSE(InnerOptimizer(make_params(), 1e-3, 0, "full", solo).sharded());
  collective::testing::run_site("zero3-refused", 2, [&](collective::SiteGroup& site) {
    refused([&] { InnerOptimizer o(make_params(), 1e-3, 0, "full", site); });
  });
}

}  // namespace
}  // namespace nebula::parallel
