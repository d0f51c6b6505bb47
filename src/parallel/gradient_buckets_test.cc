#include "parallel/gradient_buckets.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "collective/testing.h"
#include "nebula/error.h"
#include "parallel/shard_layout.h"

namespace nebula::parallel {
namespace {

// A chain of 6 layers (weight and bias each, 24 · 24 + 24 values; 3,600 in all, divisible by none
// of 7, 11), the same on every worker; a loss of the worker's own input, so every worker's
// gradients differ. `skip`: layer 2 is not run (its parameters get no gradient).
struct Chain {
  std::vector<at::Tensor> params;
  Chain() {
    for (int l = 0; l < 6; ++l) {
      params.push_back(at::cos(at::arange(24 * 24, at::kFloat).mul(0.01 * (l + 1))).view({24, 24}).div(8).set_requires_grad(true));
      params.push_back(at::sin(at::arange(24, at::kFloat).mul(0.3 * (l + 1))).div(4).set_requires_grad(true));
    }
  }
  int64_t numel() const {
    int64_t n = 0;
    for (const auto& p : params) n += p.numel();
    return n;
  }
  at::Tensor loss(int rank, bool skip = false) const {
    at::Tensor x = at::sin(at::arange(3 * 24, at::kFloat).mul(0.1 * (rank + 1))).view({3, 24});
    for (size_t l = 0; l < 6; ++l) {
      if (skip && l == 2) continue;
      x = at::tanh(at::addmm(params[2 * l + 1], x, params[2 * l]));
    }
    return x.pow(2).sum();
  }
};

at::Tensor flat_grads(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> g;
  for (const auto& p : params) g.push_back(p.grad().defined() ? p.grad().reshape({-1}) : at::zeros({p.numel()}));
  return at::cat(g);
}

// This worker's shard of the sum over the site of `flat`, by one reduce-scatter of the whole.
at::Tensor reduce_scattered(collective::SiteGroup& site, const at::Tensor& flat) {
  const int64_t shard = shard_numel(flat.numel(), site.size());
  at::Tensor whole = at::zeros({shard * site.size()});
  whole.narrow(0, 0, flat.numel()).copy_(flat);
  at::Tensor out = at::zeros({shard});
  site.reduce_scatter_sum(whole, out);
  return out;
}

// Over 2 to 4 workers, with buckets of one layer, of about two layers and one of the whole chain,
// weights rank + 1: after backward every worker's shard holds exactly what one reduce-scatter of
// the whole weighted gradient leaves there (the same sums in the same order: bit for bit), no
// parameter holds a .grad, every bucket went from a hook while backward ran and no more than two
// buckets' values were held at once — never the whole gradient. A layer backward
// does not reach counts as 0. A backward outside arm()/finish() is left alone (its .grad as
// usual), and once the buckets are gone their hooks are too.
TEST(GradientBuckets, ReduceScatterAsBackwardRunsExactlyAsOneWholeReduceScatter) {
  for (int workers = 2; workers <= 4; ++workers) {
    for (const uint64_t bucket_bytes : {uint64_t{600 * 4}, uint64_t{1300 * 4}, uint64_t{1} << 20}) {
      for (const bool skip : {false, true}) {
        SCOPED_TRACE(str_cat(workers, " workers, buckets of ", bucket_bytes, " bytes", skip ? ", layer 2 skipped" : ""));
        collective::testing::run_site(str_cat("buckets-", workers, "-", bucket_bytes, skip), workers,
                                      [&](collective::SiteGroup& site) {
          const double weight = site.rank() + 1;
          const int64_t total = Chain().numel();
          const int64_t shard = shard_numel(total, site.size());
          // The reference: the whole weighted gradient, reduce-scattered at once.
          Chain ref;
          ref.loss(site.rank(), skip).backward();
          const at::Tensor want = reduce_scattered(site, flat_grads(ref.params).mul(weight));

          Chain net;
          at::Tensor mine = at::zeros({shard});
          {
            GradientBuckets buckets(net.params, site, mine, bucket_bytes);
            const size_t expect_buckets = bucket_bytes == 600 * 4 ? 6 : bucket_bytes == 1300 * 4 ? 3 : 1;
            EXPECT_EQ(buckets.buckets(), expect_buckets);
            buckets.arm(weight);
            net.loss(site.rank(), skip).backward();
            buckets.finish();
            EXPECT_TRUE(at::equal(mine, want)) << "rank " << site.rank() << ": differs by up to "
                                               << (mine - want).abs().max().item<float>();
            for (const auto& p : net.params) EXPECT_FALSE(p.grad().defined()) << "a .grad left after the buckets";
            if (buckets.buckets() > 1) {
              if (!skip) {
                EXPECT_LE(buckets.peak_held_numel(), 2 * 1300) << "rank " << site.rank();
                EXPECT_EQ(buckets.sent_in_backward(), static_cast<int64_t>(buckets.buckets()));
              } else {  // layer 2's bucket waits for finish(), and the ones after it with it
                EXPECT_LT(buckets.peak_held_numel(), total) << "rank " << site.rank();
                EXPECT_GE(buckets.sent_in_backward(), 1);
              }
            }
            EXPECT_EQ(buckets.held_numel(), 0);

            // Not armed: backward fills .grad as usual, and nothing is sent.
            mine.zero_();
            net.loss(site.rank(), skip).backward();
            EXPECT_TRUE(at::equal(flat_grads(net.params), flat_grads(ref.params)));
            EXPECT_EQ(mine.abs().sum().item<float>(), 0.0f);
            for (auto& p : net.params) p.mutable_grad() = at::Tensor();
          }
          // The buckets are gone: so are their hooks (nothing reads freed state), .grad as usual.
          net.loss(site.rank(), skip).backward();
          EXPECT_TRUE(at::equal(flat_grads(net.params), flat_grads(ref.params)));
        });
      }
    }
  }
}

// A pipeline stage's micro-batches accumulate into .grad with the buckets disarmed; handed over
// after the last (take_accumulated), the shard holds what one reduce-scatter of weight · the
// summed gradient leaves there, bit for bit, and no .grad is left.
TEST(GradientBuckets, AccumulatedGradientsHandedOverAfterwards) {
  collective::testing::run_site("buckets-accumulated", 3, [&](collective::SiteGroup& site) {
    const double weight = site.rank() + 1;
    const int64_t total = Chain().numel(), shard = shard_numel(total, site.size());
    Chain ref;
    ref.loss(site.rank()).backward();
    ref.loss(site.rank() + 5).backward();  // a second micro-batch, accumulated
    const at::Tensor want = reduce_scattered(site, flat_grads(ref.params).mul(weight));

    Chain net;
    at::Tensor mine = at::zeros({shard});
    GradientBuckets buckets(net.params, site, mine, 1300 * 4);
    net.loss(site.rank()).backward();
    net.loss(site.rank() + 5).backward();
    buckets.take_accumulated(weight);
    EXPECT_TRUE(at::equal(mine, want)) << "rank " << site.rank() << ": differs by up to "
                                       << (mine - want).abs().max().item<float>();
    for (const auto& p : net.params) EXPECT_FALSE(p.grad().defined()) << "a .grad left after the buckets";
    EXPECT_FALSE(buckets.armed());
  });
}

TEST(GradientBuckets, RefusesAShardOfTheWrongSize) {
  collective::testing::run_site("buckets-bad", 2, [&](collective::SiteGroup& site) {
    Chain net;
    try {
      GradientBuckets b(net.params, site, at::zeros({net.numel()}), 1024);
      ADD_FAILURE() << "a whole-sized shard was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("want 1800"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace nebula::parallel
