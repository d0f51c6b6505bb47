#include "parallel/full_shard.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <c10/core/CPUAllocator.h>
#include <torch/cuda.h>

#include <cmath>
#include <cstdio>
#include <map>
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
  std::vector<torch::nn::Module*> layers;  // the Transformer layers
  std::vector<torch::nn::Module*> units;   // what ZeRO-3 gathers: embeddings, layers, norms
  int64_t tied_numel = 0;                  // the token embedding's values
  int extra_calls = 0;                     // its uses in a step beyond the first (tied)
};

at::Tensor tokens(int rank, int step, int salt, int64_t rows, int64_t cols) {
  at::Tensor t = at::arange(rows * cols, at::kLong).mul(7 + salt).add(rank * 31 + step * 17 + salt).remainder(kVocab - 5).add(5);
  return t.view({rows, cols});
}

// `sink`: installed while the model is built (ZeRO-3's PieceKeeper), or null.
Net make_net(const std::string& kind, model::BuildSink* sink = nullptr) {
  static std::mutex seed_lock;  // LibTorch's default generator is the process's: one thread at a time
  std::lock_guard<std::mutex> lock(seed_lock);
  model::SinkScope building(sink);
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
    net.units = m->units();
    net.tied_numel = m->token_embedding()->weight.numel();
    net.extra_calls = 1;  // the output projection
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
    net.units = m->units();
    net.tied_numel = m->encoder()->token_embedding()->weight.numel();
    net.extra_calls = 2;  // the decoder's input and the output projection
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
// The gather spy: what a ZeRO-3 worker held at each point of its steps.
struct Held {
  int64_t rest = 0, largest_layer = 0;  // the units' sizes
  std::vector<int64_t> after_forward, after_backward, after_step, peak_in_step;
  std::vector<int64_t> param_values_after_step;  // Σ numel of the parameters after each step
  std::vector<uint64_t> site_bytes;  // SiteGroup::bytes_sent over each step's forward and backward
  int64_t prefetch_hits = 0, layer_gathers = 0;  // gathers a prefetch served, of all layer gathers
  int64_t values_after_build = -1;  // "full+built": the parameters' values right after the model was built
};

// `shard`: "none", "optimizer", "gradients", "full", "full+recompute", "full+prefetch" or
// "full+built" (the model built under a PieceKeeper: each layer cut as soon as it is built).
// `device`: where the model trains (built on the CPU and moved there, as a GPU site's task does).
Trained train(const std::string& kind, const std::string& shard, collective::SiteGroup& site, int steps,
              Held* held = nullptr, at::Device device = at::kCPU) {
  std::unique_ptr<PieceKeeper> keeper;
  if (shard == "full+built") keeper = std::make_unique<PieceKeeper>(site.size(), site.rank(), device);
  Net net = make_net(kind, keeper.get());
  net.module->to(device);
  std::vector<at::Tensor> params = net.module->parameters();
  if (keeper && held) {
    held->values_after_build = 0;
    for (const auto& p : params) held->values_after_build += static_cast<int64_t>(p.storage().nbytes() / sizeof(float));
  }
  std::unique_ptr<FullShard> full;
  if (shard.rfind("full", 0) == 0 && site.size() > 1) {
    if (held) {  // the units' sizes, while the parameters are whole
      for (const auto& p : params) held->rest += p.numel();
      for (const auto* layer : net.units) {
        int64_t n = 0;
        for (const auto& p : layer->parameters()) n += p.numel();
        held->largest_layer = std::max(held->largest_layer, n);
        held->rest -= n;
      }
    }
    const bool prefetch = shard == "full+prefetch";
    full = std::make_unique<FullShard>(params, net.units, site, FullShardOptions{shard == "full+recompute", prefetch},
                                       prefetch ? site.fork("prefetch") : nullptr, keeper.get());
    keeper.reset();
    net.set_gather(full.get());
  }
  InnerOptimizer o(params, 1e-2, 0.05, full ? "full" : shard, site, full.get());
  const double weight = site.rank() + 1;
  const double total = site.size() * (site.size() + 1) / 2.0;
  Trained out;
  for (int s = 0; s < steps; ++s) {
    auto site_bytes = [&] { return site.bytes_sent() + (full ? full->prefetch_bytes_sent() : 0); };
    const uint64_t bytes_before = site_bytes();
    if (full) {
      full->reset_peak();
      full->begin_step();
    }
    at::Tensor loss = net.loss(site.rank(), s);
    if (full && held) held->after_forward.push_back(full->held_numel());
    o.zero_grad();
    o.before_backward(weight);  // ZeRO-2's buckets and ZeRO-3's layers reduce-scatter as backward runs
    loss.backward();
    o.end_backward();
    if (full && held) {
      held->after_backward.push_back(full->held_numel());
      held->peak_in_step.push_back(full->peak_held_numel());
      held->site_bytes.push_back(site_bytes() - bytes_before);
    }
    at::NoGradGuard no_grad;
    at::Tensor average;
    if (o.gradients_sharded()) {  // ZeRO-2 and ZeRO-3: this worker's S values of Σ w · g
      for (const auto& p : params) EXPECT_FALSE(p.grad().defined()) << "a .grad after a sharded backward";
      o.flat_grad().div_(total);
      at::Tensor shards = at::empty({o.state_numel() * site.size()}, o.flat_grad().options());
      site.all_gather(o.flat_grad(), shards);
      const ShardLayout layout = o.layout();
      average = at::empty({o.total_numel()}, shards.options());  // each worker's pieces where they lie
      for (int q = 0; q < site.size(); ++q)
        for (const ShardRun& r : layout.runs(q, 0, o.total_numel()))
          average.narrow(0, r.flat, r.len).copy_(shards.narrow(0, q * layout.shard_numel() + r.local, r.len));
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
    if (full && held) {
      held->prefetch_hits = full->prefetch_hits();
      held->layer_gathers += 2 * static_cast<int64_t>(net.units.size() + net.extra_calls);  // each call: forward and backward
      held->after_step.push_back(full->held_numel());
      int64_t values = 0;
      for (const auto& p : params) values += p.numel();
      held->param_values_after_step.push_back(values);
    }
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

// GPU sites shard too: ZeRO-1 with the flat parameters, gradients and shard on the GPU trains as
// the same workers on the CPU do, the site's collectives carried through host copies; within a
// tenth of one AdamW step (lr) of the CPU's weights (the GPU's kernels sum in their own order).
// Only the modes whose collectives run outside backward: the workers here are threads of one
// process, and a process's autograd engine runs all of one GPU's backward work on one thread, so
// ZeRO-2's and ZeRO-3's reduce-scatters inside backward would wait there for each other (seen on
// an H200: a 30 s Gloo timeout). Deployed, every worker is a process of its own:
// EndToEnd.ShardedGpuSitesTrainAsCpuSites runs ZeRO-2 and ZeRO-3 on the GPU so. Runs where
// LibTorch has CUDA and a GPU (bench/gpu_check.sh); skipped elsewhere.
TEST(FullShard, OnTheGpuTrainsAsOnTheCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device for LibTorch here";
  collective::testing::run_site("zero-gpu", 2, [&](collective::SiteGroup& site) {
    for (const std::string shard : {"none", "optimizer"}) {
      SCOPED_TRACE(str_cat(shard, ", rank ", site.rank()));
      const Trained cpu = train("mlm", shard, site, 3);
      Trained gpu;
      try {
        gpu = train("mlm", shard, site, 3, nullptr, at::Device(at::kCUDA, 0));
      } catch (const std::exception& e) {  // said at once: the peer then sees only a closed connection
        std::fprintf(stderr, "shard = %s, rank %d on the GPU: %s\n", shard.c_str(), site.rank(), e.what());
        throw;
      }
      EXPECT_TRUE(gpu.weights.device().is_cuda());
      EXPECT_TRUE(at::allclose(gpu.first_gradient.cpu(), cpu.first_gradient, 1e-4, 1e-6))
          << "the first step's average gradient differs by up to "
          << (gpu.first_gradient.cpu() - cpu.first_gradient).abs().max().item<float>();
      EXPECT_LT((gpu.weights.cpu() - cpu.weights).abs().max().item<double>(), 1e-3);
      EXPECT_FALSE(at::equal(cpu.weights, train("mlm", "none", site, 0).weights)) << "no training happened";
    }
  });
}

// ZeRO-3 against ZeRO-2 and the whole model, for both built-in models on 2 to 4 workers (their
// parameter counts divisible by none of 2, 3, 4), with and without recompute. The site's average
// gradient of a step equals the whole model's (summed in another order: within float rounding).
// The MLM encoder's weights after 4 steps: with 2 workers bit-identical to ZeRO-2's (the same
// products, and a + b is b + a; the tied token embedding's two uses added up before its one
// reduce-scatter, as autograd adds them); with 3 or 4 the ring sums each unit's piece starting
// from another worker than ZeRO-2's one contiguous shard does, and AdamW turns the rounding of a
// gradient that nearly cancels into a step of its own, so the weights are within a tenth of one
// step (lr) of ZeRO-2's. Recompute on and off sum in the same order: bit-identical. (The
// seq2seq's token embedding is used three times, tied: autograd adds its three gradients in
// another order around ZeRO-3's layers, so its gradient alone is compared.)
// Prefetch (the next layer's gather on a second group while a layer runs) changes nothing either,
// nor building the model under a PieceKeeper (each unit cut as soon as it is built and its
// values final: after the build no parameter holds values).
// The gather spy: the embeddings and norms are units like the layers (the rest is empty for
// these models), so after forward, after backward and after the step nothing is gathered, no
// parameter holds values between steps, and at no moment more than one unit is (with prefetch:
// and the one ahead).
TEST(FullShard, TrainsAsZeroTwoAndAsTheWholeModel) {
  for (const std::string kind : {"mlm", "seq2seq"}) {
    int64_t numel = 0;
    for (const auto& p : make_net(kind).module->parameters()) numel += p.numel();
    for (int workers = 2; workers <= 4; ++workers) {
      SCOPED_TRACE(str_cat(kind, ", ", workers, " workers, ", numel, " parameters"));
      EXPECT_NE(numel % workers, 0);
      collective::testing::run_site(str_cat("zero3-", kind, "-", workers), workers, [&](collective::SiteGroup& site) {
        const int steps = kind == "mlm" ? 4 : 1;
        Held held, held_recompute, held_prefetch;
        const Trained none = train(kind, "none", site, steps);
        const Trained two = train(kind, "gradients", site, steps);
        const Trained three = train(kind, "full", site, steps, &held);
        const Trained recomputed = train(kind, "full+recompute", site, steps, &held_recompute);
        const Trained prefetched = train(kind, "full+prefetch", site, steps, &held_prefetch);
        Held held_built;
        const Trained built = train(kind, "full+built", site, steps, &held_built);
        // Built unit by unit, no unit is whole once built (the rest would be, until cut: there is
        // none), and the pieces kept are the ones cut from the whole model: the same training.
        EXPECT_EQ(held_built.rest, 0);
        EXPECT_EQ(held_built.values_after_build, 0) << "rank " << site.rank();
        EXPECT_TRUE(at::equal(three.weights, built.weights)) << "rank " << site.rank() << ": built in pieces, other weights";
        EXPECT_GT(none.first_gradient.abs().max().item<float>(), 1e-3);
        EXPECT_TRUE(at::allclose(three.first_gradient, none.first_gradient, 1e-4, 1e-7))
            << "rank " << site.rank() << ": the first step's average gradient differs by up to "
            << (three.first_gradient - none.first_gradient).abs().max().item<float>();
        EXPECT_TRUE(at::equal(three.weights, recomputed.weights)) << "rank " << site.rank() << ": recompute changes the weights";
        EXPECT_TRUE(at::equal(three.weights, prefetched.weights)) << "rank " << site.rank() << ": prefetch changes the weights";
        if (kind == "mlm") {
          if (workers == 2)
            EXPECT_TRUE(at::equal(three.weights, two.weights))
                << "rank " << site.rank() << ": ZeRO-3 ends " << max_relative(three.weights, two.weights)
                << " (relative) from ZeRO-2";
          else
            EXPECT_LT((three.weights - two.weights).abs().max().item<double>(), 1e-3)
                << "rank " << site.rank() << ": ZeRO-3 ends more than a tenth of a step from ZeRO-2";
        }
        // Every layer gather but the first forward's and the first backward's of a step came from
        // a prefetch (the first step's forward has no last step to predict from).
        EXPECT_EQ(held_prefetch.prefetch_hits,
                  held_prefetch.layer_gathers - 2 * steps - static_cast<int64_t>(make_net(kind).units.size() + make_net(kind).extra_calls) + 1)
            << "rank " << site.rank();
        EXPECT_EQ(held.prefetch_hits, 0);
        for (const Held* h : {&held, &held_recompute, &held_prefetch, &held_built})
          for (int s = 0; s < steps; ++s) {
            EXPECT_EQ(h->after_forward[s], h->rest) << "step " << s << ": gathered after forward";
            EXPECT_EQ(h->after_backward[s], 0) << "step " << s << ": gathered after backward";
            EXPECT_EQ(h->after_step[s], 0) << "step " << s << ": gathered after the step";
            EXPECT_EQ(h->param_values_after_step[s], 0) << "a parameter keeps its values outside a gather";
            // One layer at once, and with prefetch the one ahead too.
            const int64_t layers_at_once = h == &held_prefetch ? 2 : 1;
            EXPECT_LE(h->peak_in_step[s], h->rest + layers_at_once * h->largest_layer) << "step " << s << ": too many layers at once";
            EXPECT_GT(h->peak_in_step[s], h->rest);
            // The site traffic of a step: every unit gathered twice (forward, backward) per use
            // and reduce-scattered once, the rest gathered once for the step and
            // reduce-scattered: each (N - 1)/N of its float32 bytes per worker, within the
            // pieces' rounding.
            const Net shape = make_net(kind);
            const double units = static_cast<double>(numel - h->rest);
            const double extra_gathers = 2.0 * shape.extra_calls * static_cast<double>(shape.tied_numel);
            const double expected =
                (workers - 1.0) / workers * (3 * units + extra_gathers + 2.0 * static_cast<double>(h->rest)) * 4;
            EXPECT_NEAR(static_cast<double>(h->site_bytes[s]), expected, 0.05 * expected) << "step " << s;
          }
      });
    }
  }
}

// The ring's critical path: in each step of a ring every rank sends one part, and the step
// lasts as long as the largest of them. With each layer cut evenly over the workers (the
// layout), the largest parts of a layer's all-gather and reduce-scatter sum to (N - 1)/N of the
// layer (within 5 %: ceil(n/N) pieces); the same layer cut from one flat vector, as ZeRO-3
// was laid out before, lies in one or two workers' shards and its parts travel hop by hop.
TEST(FullShard, EveryWorkerSendsItsNthOfEveryLayerInEveryRingStep) {
  for (int workers = 2; workers <= 4; ++workers) {
    collective::testing::run_site(str_cat("zero3-ring-", workers), workers, [&](collective::SiteGroup& site) {
      Net net = make_net("mlm");
      std::vector<at::Tensor> params = net.module->parameters();
      // Each layer's range of the flat vector, while the parameters are whole.
      std::map<const c10::TensorImpl*, int64_t> start;
      int64_t total = 0;
      for (const auto& p : params) {
        start[p.unsafeGetTensorImpl()] = total;
        total += p.numel();
      }
      std::vector<std::pair<int64_t, int64_t>> ranges;  // begin, values
      for (const auto* layer : net.layers) {
        int64_t begin = total, n = 0;
        for (const auto& p : layer->parameters()) {
          begin = std::min(begin, start.at(p.unsafeGetTensorImpl()));
          n += p.numel();
        }
        ranges.emplace_back(begin, n);
      }
      const ShardLayout contiguous = ShardLayout::contiguous(total, workers);
      FullShard full(params, net.layers, site);
      // Every rank's bytes per step of its last ring, summed over the site so all ranks see all.
      auto critical_path = [&] {
        const std::vector<int64_t>& mine = site.last_ring_steps();
        EXPECT_EQ(mine.size(), static_cast<size_t>(workers - 1));
        at::Tensor all = at::zeros({workers, workers - 1}, at::kDouble);
        for (size_t k = 0; k < mine.size(); ++k) all[site.rank()][static_cast<int64_t>(k)] = static_cast<double>(mine[k]);
        site.allreduce_sum(all);
        return all.amax(0).sum().item<double>();
      };
      for (size_t l = 0; l < net.layers.size(); ++l) {
        const auto [begin, layer_values] = ranges[l];
        full.gather(l);
        const double gather = critical_path();
        full.release(l);
        std::vector<at::Tensor> grads(full.unit_params(l).size());  // none: nothing to add
        full.reduce_gradients(l, grads);
        const double reduce = critical_path();
        const double even = static_cast<double>(workers - 1) / workers * static_cast<double>(layer_values) * sizeof(float);
        EXPECT_LE(gather, 1.05 * even) << "layer " << l << " of " << layer_values << " values, " << workers << " workers";
        EXPECT_LE(reduce, 1.05 * even) << "layer " << l;
        EXPECT_GE(gather, 0.95 * even) << "layer " << l;
        // The same layer's all-gather cut by one flat vector's shards.
        {
          const int64_t n = layer_values;
          at::Tensor buffer = at::zeros({n}, at::kFloat);
          site.all_gather_parts(buffer, contiguous.counts(begin, n));
          const double flat = critical_path();
          if (site.rank() == 0)
            std::printf("%d workers, layer %zu (%ld values): ring critical path %.0f bytes cut by layer, %.0f cut from one "
                        "flat vector, (N-1)/N of the layer = %.0f\n",
                        workers, l, n, gather, flat, even);
          EXPECT_GE(flat, even) << "no cut beats an even one";
        }
      }
    });
  }
}

// with_full_model: what fn writes into the parameters becomes the shards (a checkpoint's
// weights); root-only, only the gateway holds them; with_rest runs the model layer by layer
// without autograd (validation), with_rest_to_root on the gateway only (its evaluation); a layer
// the model did not declare is an error.
TEST(FullShard, WholeModelGathersAndLayerByLayerValidation) {
  collective::testing::run_site("zero3-full-model", 3, [&](collective::SiteGroup& site) {
    Net net = make_net("mlm");
    std::vector<at::Tensor> params = net.module->parameters();
    std::vector<at::Tensor> expected;
    for (const auto& p : params) expected.push_back(p.detach().clone().add_(1));
    FullShard full(params, net.units, site);
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
        EXPECT_EQ(params[0].numel(), 0) << "the token embedding is a unit: gathered only where it runs";
        layered = net.loss(site.rank(), 0);
      });
    }
    EXPECT_TRUE(at::equal(whole, layered)) << whole.item<float>() << " vs " << layered.item<float>();
    for (const auto& p : params) EXPECT_EQ(p.numel(), 0);
    // The gateway's evaluation (with_rest_to_root): fn runs on rank 0 alone, every layer gathered
    // to it as it runs, the others serving; the gateway holds at most the rest and one unit.
    int64_t largest_unit = 0, in_units = 0;
    for (torch::nn::Module* u : net.units) {
      int64_t n = 0;
      for (const auto& p : u->parameters()) n += p.numel();
      largest_unit = std::max(largest_unit, n);
      in_units += n;
    }
    at::Tensor on_root;
    int runs = 0;
    full.reset_peak();
    {
      at::NoGradGuard no_grad;
      full.with_full_model([&] { whole = net.loss(0, 1); });
      full.with_rest_to_root([&] {
        ++runs;
        on_root = net.loss(0, 1);
        on_root = net.loss(0, 1);  // twice: the others serve every gather until fn ends
      });
    }
    EXPECT_EQ(runs, site.rank() == 0 ? 1 : 0) << "fn runs on the gateway only";
    if (site.rank() == 0) EXPECT_TRUE(at::equal(whole, on_root)) << whole.item<float>() << " vs " << on_root.item<float>();
    full.reset_peak();
    full.with_rest_to_root([&] { net.loss(0, 1); });
    EXPECT_LE(full.peak_held_numel(), site.rank() == 0 ? full.total_numel() - in_units + largest_unit : 0)
        << "rank " << site.rank() << ": the rest and one unit at most, on the gateway only";
    if (site.rank() == 0) EXPECT_GE(full.peak_held_numel(), largest_unit) << "every unit ran on the gateway";
    for (const auto& p : params) EXPECT_EQ(p.numel(), 0);
    torch::nn::Linear stranger(2, 2);
    EXPECT_THROW(full.run(*stranger, {at::zeros({1, 2})}, [&](const std::vector<at::Tensor>& in) { return in[0]; }),
                 Error);
  });
}

TEST(UnitBlocks, KeepsFreedBlocksForTheNextTakeOfTheirSizeUpToItsCapacity) {
  c10::Allocator& cpu = *c10::GetCPUAllocator();
  UnitBlocks blocks(2);
  c10::DataPtr a = blocks.take(cpu, 4096);
  void* const a_bytes = a.get();
  blocks.keep(std::move(a), 4096);
  EXPECT_EQ(blocks.kept_bytes(), 4096u);
  c10::DataPtr other = blocks.take(cpu, 8192);  // another size: from the allocator
  EXPECT_NE(other.get(), a_bytes);
  EXPECT_EQ(blocks.kept_bytes(), 4096u);
  c10::DataPtr again = blocks.take(cpu, 4096);  // the same size: the kept block
  EXPECT_EQ(again.get(), a_bytes);
  EXPECT_EQ(blocks.kept_bytes(), 0u);
  blocks.keep(std::move(again), 4096);
  blocks.keep(std::move(other), 8192);
  blocks.keep(cpu.allocate(1024), 1024);  // a third: the oldest (4096) goes back to the allocator
  EXPECT_EQ(blocks.kept_bytes(), 8192u + 1024u);
  blocks.keep(cpu.allocate(0), 0);  // nothing to keep
  EXPECT_EQ(blocks.kept_bytes(), 8192u + 1024u);
  UnitBlocks none(0);
  none.keep(cpu.allocate(64), 64);
  EXPECT_EQ(none.kept_bytes(), 0u);
}

// A step gathers and frees every layer twice: a layer's gather reuses the bytes the last layer
// of its size freed (UnitBlocks) instead of asking the heap.
TEST(FullShard, LayersOfOneSizeReuseOneBlock) {
  collective::testing::run_site("zero3-blocks", 2, [&](collective::SiteGroup& site) {
    Net net = make_net("mlm");
    std::vector<at::Tensor> params = net.module->parameters();
    FullShard full(params, net.units, site);
    std::vector<size_t> layer_units;  // units that are Transformer layers (all of one size)
    for (size_t u = 0; u < net.units.size(); ++u)
      for (torch::nn::Module* l : net.layers)
        if (net.units[u] == l) layer_units.push_back(u);
    ASSERT_GE(layer_units.size(), 2u);
    full.gather(layer_units[0]);
    const void* first = full.unit_params(layer_units[0]).front().data_ptr();
    full.release(layer_units[0]);
    full.gather(layer_units[1]);
    EXPECT_EQ(full.unit_params(layer_units[1]).front().data_ptr(), first);
    full.release(layer_units[1]);
  });
}

}  // namespace
}  // namespace nebula::parallel
