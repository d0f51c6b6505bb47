#include "parallel/full_shard.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "collective/testing.h"
#include "model/mlm_encoder.h"
#include "model/seq2seq.h"
#include "model/testing.h"
#include "parallel/inner_optimizer.h"

namespace nebula::parallel {
namespace {

constexpr int64_t kVocab = 53;

// A built-in model of either kind, built from one seed on every thread, with its loss on the
// batch of (rank, step): deterministic token ids, the same on every run.
struct Net {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(int rank, int step)> loss;
  std::function<void(model::LayerGather*)> set_gather;
  std::vector<torch::nn::Module*> layers;
};

at::Tensor tokens(int rank, int step, int salt, int64_t rows, int64_t cols) {
  at::Tensor t = at::arange(rows * cols, at::kLong).mul(7 + salt).add(rank * 31 + step * 17 + salt).remainder(kVocab - 5).add(5);
  return t.view({rows, cols});
}

Net make_net(const std::string& kind) {
  static std::mutex seed_lock;  // LibTorch's default generator is the process's: one thread at a time
  std::lock_guard<std::mutex> lock(seed_lock);
  at::manual_seed(5);
  ModelConfig c = model::testing::tiny_model_config();
  c.layers = 2;
  c.dim = 15;  // no tensor's size a multiple of 2, 3 or 4 workers
  c.heads = 3;
  c.ffn = 29;
  Net net;
  if (kind == "mlm") {
    model::MlmEncoder m(c, kVocab, 0);
    net.module = m.ptr();
    for (const auto& l : m->layers()) net.layers.push_back(l.ptr().get());
    net.set_gather = [m](model::LayerGather* g) mutable { m->set_layer_gather(g); };
    net.loss = [m](int rank, int step) mutable {
      at::Tensor ids = tokens(rank, step, 0, 3, 9);
      at::Tensor labels = at::where(at::arange(27, at::kLong).view({3, 9}).remainder(3).eq(0), ids,
                                    at::full({3, 9}, model::kIgnoreIndex, at::kLong));
      return m->loss(ids, labels);
    };
  } else {
    model::SpecialIds ids;
    ids.vocab_size = kVocab;
    model::Seq2Seq m(c, 2, kVocab, ids);
    net.module = m.ptr();
    for (const auto& l : m->encoder()->layers()) net.layers.push_back(l.ptr().get());
    for (const auto& l : m->decoder_layers()) net.layers.push_back(l.ptr().get());
    net.set_gather = [m](model::LayerGather* g) mutable { m->set_layer_gather(g); };
    net.loss = [m](int rank, int step) mutable {
      return m->loss(tokens(rank, step, 1, 2, 7), tokens(rank, step, 2, 2, 6), tokens(rank, step, 3, 2, 6));
    };
  }
  return net;
}

// K steps of one site's data parallel training, every worker on its own batches with weight
// rank + 1, as the worker and DilocoStrategy run them: shard = "none" (weighted all-reduce),
// "gradients" (ZeRO-2: weighted reduce-scatter) or "full" (ZeRO-3). Returns the final weights
// and the site's average gradient of the first step, flattened (sharded: gathered).
struct Trained {
  at::Tensor weights, first_gradient;
};
Trained train(const std::string& kind, const std::string& shard, collective::SiteGroup& site, int steps,
              std::vector<int64_t>* held = nullptr) {
  Net net = make_net(kind);
  std::vector<at::Tensor> params = net.module->parameters();
  std::unique_ptr<FullShard> full;
  if (shard == "full" && site.size() > 1) {
    full = std::make_unique<FullShard>(params, net.layers, site);
    net.set_gather(full.get());
    if (held)
      for (const auto& p : params) held->push_back(p.numel());
  }
  InnerOptimizer o(params, 1e-2, 0.05, shard, site, full.get());
  const double weight = site.rank() + 1;
  const double total = site.size() * (site.size() + 1) / 2.0;
  Trained out;
  for (int s = 0; s < steps; ++s) {
    if (full) full->begin_step();
    at::Tensor loss = net.loss(site.rank(), s);
    o.zero_grad();
    if (full) full->set_grad_weight(weight);
    loss.backward();
    if (full) full->end_backward();
    at::NoGradGuard no_grad;
    at::Tensor average;
    if (full) {
      o.flat_grad().div_(total);
      average = at::empty({o.state_numel() * site.size()});
      site.all_gather(o.flat_grad(), average);
    } else if (o.gradients_sharded()) {
      at::Tensor flat = o.flat_grad();
      flat.mul_(weight);
      const int64_t n = flat.numel() / site.size();
      at::Tensor mine = flat.narrow(0, site.rank() * n, n);
      site.reduce_scatter_sum(flat, mine);
      mine.div_(total);
      average = at::empty_like(flat);
      site.all_gather(mine, average);
    } else {
      std::vector<at::Tensor> g;
      for (const auto& p : params) g.push_back(p.grad().reshape({-1}).mul(weight));
      average = at::cat(g);
      site.allreduce_sum(average);
      average.div_(total);
      int64_t at = 0;
      for (auto& p : params) {
        p.mutable_grad().copy_(average.narrow(0, at, p.numel()).view_as(p));
        at += p.numel();
      }
    }
    if (s == 0) out.first_gradient = average.narrow(0, 0, o.total_numel()).clone();
    o.step();
  }
  auto flat = [&] {
    std::vector<at::Tensor> v;
    for (const auto& p : params) v.push_back(p.detach().reshape({-1}));
    out.weights = at::cat(v);
  };
  if (full)
    full->with_full_model(flat);
  else
    flat();
  return out;
}

double max_relative(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().div(at::maximum(at::maximum(a.abs(), b.abs()), at::full_like(a, 1e-3))).max().item<double>();
}

// ZeRO-3 against ZeRO-2 and the whole model, for both built-in models on 2 to 4 workers (their
// parameter counts divisible by none of 2, 3, 4). The site's average gradient of a step equals
// the whole model's (summed in another order: within float rounding). The MLM encoder's
// weights after 4 steps are bit-identical to ZeRO-2's: the same products, summed in the same
// ring order, each layer recomputed with autograd giving the gradients backward gave. (The
// seq2seq's token embedding is used three times, tied: autograd adds its three gradients in
// another order around ZeRO-3's layers. Rounding apart is all weights can be then, and AdamW
// turns a rounding-sized gradient into an lr-sized step, so its gradient alone is compared.)
// Between steps no worker holds a parameter's values.
TEST(FullShard, TrainsAsZeroTwoAndAsTheWholeModel) {
  for (const std::string kind : {"mlm", "seq2seq"}) {
    int64_t numel = 0;
    for (const auto& p : make_net(kind).module->parameters()) numel += p.numel();
    for (int workers = 2; workers <= 4; ++workers) {
      SCOPED_TRACE(str_cat(kind, ", ", workers, " workers, ", numel, " parameters"));
      EXPECT_NE(numel % workers, 0);
      collective::testing::run_site(str_cat("zero3-", kind, "-", workers), workers, [&](collective::SiteGroup& site) {
        const int steps = kind == "mlm" ? 4 : 1;
        std::vector<int64_t> held;
        const Trained none = train(kind, "none", site, steps);
        const Trained two = train(kind, "gradients", site, steps);
        const Trained three = train(kind, "full", site, steps, &held);
        EXPECT_GT(none.first_gradient.abs().max().item<float>(), 1e-3);
        EXPECT_TRUE(at::allclose(three.first_gradient, none.first_gradient, 1e-4, 1e-7))
            << "rank " << site.rank() << ": the first step's average gradient differs by up to "
            << (three.first_gradient - none.first_gradient).abs().max().item<float>();
        if (kind == "mlm") {
          EXPECT_TRUE(at::equal(three.weights, two.weights))
              << "rank " << site.rank() << ": ZeRO-3 ends " << max_relative(three.weights, two.weights)
              << " (relative) from ZeRO-2";
        }
        for (int64_t n : held) EXPECT_EQ(n, 0) << "a parameter keeps its values outside a gather";
      });
    }
  }
}

// with_full_model: what fn writes into the parameters becomes the shards (a checkpoint's
// weights); root-only, only the gateway holds them; with_rest runs the model layer by layer
// without autograd (validation); a layer the model did not declare is an error.
TEST(FullShard, WholeModelGathersAndLayerByLayerValidation) {
  collective::testing::run_site("zero3-full-model", 3, [&](collective::SiteGroup& site) {
    Net net = make_net("mlm");
    std::vector<at::Tensor> params = net.module->parameters();
    std::vector<at::Tensor> expected;
    for (const auto& p : params) expected.push_back(p.detach().clone().add_(1));
    FullShard full(params, net.layers, site);
    EXPECT_EQ(full.shard_numel() * 3 - full.total_numel() < 3, true);
    full.with_full_model([&] {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) params[i].add_(1);
    });
    for (const auto& p : params) EXPECT_EQ(p.numel(), 0);
    full.with_full_model([&] {
      for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i], expected[i])) << "parameter " << i;
    });
    // Only the gateway holds the model in a root-only gather; a no-grad forward layer by layer
    // (with_rest, every worker) gives what the whole model gives.
    full.with_full_model([&] {
      for (const auto& p : params) EXPECT_EQ(p.numel() > 0, site.rank() == 0);
    }, /*root_only=*/true);
    net.set_gather(&full);
    at::Tensor whole, layered;
    {
      at::NoGradGuard no_grad;
      full.with_full_model([&] { whole = net.loss(site.rank(), 0); });
      full.with_rest([&] {
        EXPECT_GT(params[0].numel(), 0) << "the token embedding is outside the layers";
        layered = net.loss(site.rank(), 0);
      });
    }
    EXPECT_TRUE(at::equal(whole, layered)) << whole.item<float>() << " vs " << layered.item<float>();
    for (const auto& p : params) EXPECT_EQ(p.numel(), 0);
    torch::nn::Linear stranger(2, 2);
    EXPECT_THROW(full.run(*stranger, {at::zeros({1, 2})}, [&](const std::vector<at::Tensor>& in) { return in[0]; }),
                 Error);
  });
}

}  // namespace
}  // namespace nebula::parallel
