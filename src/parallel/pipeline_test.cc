#include "parallel/pipeline.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <stdexcept>

#include "collective/testing.h"
#include "model/mlm_encoder.h"
#include "model/peft.h"
#include "model/testing.h"
#include "parallel/encoder_stage.h"
#include "parallel/generator_state.h"

namespace nebula::parallel {
namespace {

TEST(Pipeline, GridRanksStagesOutermost) {
  const SiteGrid g{3, 2};  // data 3 × pipeline 2
  EXPECT_EQ(g.workers(), 6);
  EXPECT_EQ(g.stage(4), 1);
  EXPECT_EQ(g.replica(4), 1);
  EXPECT_EQ(g.rank(1, 2), 5);
  EXPECT_EQ(g.data_ranks(1), (std::vector<int>{3, 4, 5}));
}

TEST(Pipeline, BalanceStagesByParameterCount) {
  // Equal layers, no extras: equal stages.
  EXPECT_EQ(balance_stages({5, 5, 5, 5}, 0, 0, 2), (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(balance_stages({5, 5, 5, 5}, 0, 0, 4), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  // Large embeddings on the first stage: it runs fewer layers.
  EXPECT_EQ(balance_stages({5, 5, 5, 5, 5, 5}, 10, 0, 2), (std::vector<int64_t>{0, 2, 6}));
  // A large head on the last: it runs fewer.
  EXPECT_EQ(balance_stages({5, 5, 5, 5, 5, 5}, 0, 10, 2), (std::vector<int64_t>{0, 4, 6}));
  // Every stage at least one layer, however large the embeddings.
  EXPECT_EQ(balance_stages({1, 1, 1}, 1000, 0, 3), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(balance_stages({7}, 3, 3, 1), (std::vector<int64_t>{0, 1}));
  EXPECT_THROW(balance_stages({1, 1}, 0, 0, 3), std::invalid_argument);
  EXPECT_THROW(balance_stages({1, 1}, 0, 0, 0), std::invalid_argument);
}

TEST(Pipeline, OneFOneBRunsEveryMicroBatchOnceAndBoundsWhatIsAlive) {
  for (int P : {1, 2, 3, 4})
    for (int M : {1, 2, 3, 4, 8})
      for (int s = 0; s < P; ++s) {
        const std::vector<PipeOp> ops = one_f_one_b(P, M, s);
        ASSERT_EQ(ops.size(), static_cast<size_t>(2 * M));
        std::map<int, int> forwarded, backwarded;
        int alive = 0, most = 0, next_forward = 0, next_backward = 0;
        for (const PipeOp& op : ops) {
          if (op.kind == PipeOp::kForward) {
            EXPECT_EQ(op.micro, next_forward++) << "forwards in order";
            most = std::max(most, ++alive);
          } else {
            EXPECT_EQ(op.micro, next_backward++) << "backwards in order";
            EXPECT_LT(op.micro, next_forward) << "a backward after its forward";
            --alive;
          }
        }
        EXPECT_EQ(next_forward, M);
        EXPECT_EQ(next_backward, M);
        EXPECT_EQ(most, std::min(P - s, M)) << "P " << P << " M " << M << " stage " << s;
      }
}

TEST(Pipeline, SimulatedScheduleHasTheFormulasBubble) {
  for (int P : {1, 2, 4})
    for (int M : {1, 4, 8}) {
      EXPECT_NEAR(simulated_bubble(P, M, 1.0, 1.0), bubble_fraction(P, M), 1e-12) << P << " " << M;
      EXPECT_NEAR(simulated_bubble(P, M, 1.0, 2.0), bubble_fraction(P, M), 1e-12) << P << " " << M;
    }
  EXPECT_DOUBLE_EQ(bubble_fraction(4, 4), 3.0 / 7.0);
}

// The encoder of the equivalence tests: 4 layers, no dropout, built from one seed (under `sink`
// when given).
model::MlmEncoder make_encoder(model::BuildSink* sink = nullptr) {
  static std::mutex seed_lock;  // LibTorch's default generator is the process's
  std::lock_guard<std::mutex> lock(seed_lock);
  model::SinkScope building(sink);
  at::manual_seed(11);
  ModelConfig c = model::testing::tiny_model_config();
  c.layers = 4;
  c.dim = 12;
  c.heads = 2;
  c.ffn = 20;
  c.dropout = 0;
  return model::MlmEncoder(c, 41, 0);
}

// Replica r's batch: 6 rows of varied length (padding 0), every third token predicted.
std::pair<at::Tensor, at::Tensor> batch_of(int replica) {
  at::Tensor ids = at::arange(6 * 10, at::kLong).mul(7).add(3 + replica * 5).remainder(36).add(5).view({6, 10});
  for (int64_t r = 0; r < 6; ++r) ids[r].narrow(0, 10 - r, r).fill_(0);  // row r: r pads at the end
  at::Tensor labels = at::where(at::arange(60, at::kLong).view({6, 10}).remainder(3).eq(0).logical_and(ids.ne(0)), ids,
                                at::full({6, 10}, model::kIgnoreIndex, at::kLong));
  return {ids, labels};
}

// Every parameter's gradient by name after one loss.backward() on the whole model.
std::map<std::string, at::Tensor> reference_grads(int replica) {
  model::MlmEncoder m = make_encoder();
  auto [ids, labels] = batch_of(replica);
  m->loss(ids, labels).backward();
  std::map<std::string, at::Tensor> out;
  for (const auto& item : m->named_parameters()) out[item.key()] = item.value().grad().clone();
  return out;
}

// P stages × D replicas with M micro-batches: each trainable parameter's gradient on the stage
// that trains it equals the whole model's on the replica's batch, and the loss the batch's;
// with `recompute` too (the stages but the last keep no activations between forward and backward).
void expect_pipeline_equals_one_worker(int P, int D, int M, bool recompute = false) {
  std::vector<std::map<std::string, at::Tensor>> want;
  std::vector<double> want_loss;
  for (int d = 0; d < D; ++d) {
    want.push_back(reference_grads(d));
    model::MlmEncoder m = make_encoder();
    auto [ids, labels] = batch_of(d);
    want_loss.push_back(m->loss(ids, labels).item<double>());
  }
  std::mutex mu;
  std::map<std::string, int> trained;  // name → how many workers train it
  // Built before the workers start: a recomputing stage sets the process's generator, and one
  // replica's stages run while another replica's could still be building from the seed.
  std::vector<model::MlmEncoder> models;
  for (int r = 0; r < P * D; ++r) models.push_back(make_encoder());
  collective::testing::run_site("pipe", P * D, [&](collective::SiteGroup& group) {
    const SiteGrid grid{D, P};
    model::MlmEncoder m = models[static_cast<size_t>(group.rank())];
    Pipeline pipeline(group, grid, M, recompute);
    EXPECT_EQ(pipeline.recomputes(), recompute && !pipeline.last());
    EncoderStage stage(*m, pipeline);
    const std::vector<at::Tensor> mine = stage.trainable();
    auto [ids, labels] = batch_of(grid.replica(group.rank()));
    for (int step = 0; step < 2; ++step) {  // twice: nothing may carry over (the tied copy's gradient)
      for (const auto& p : m->parameters()) p.mutable_grad() = at::Tensor();
      stage.set_batch(ids, labels);
      const double loss = pipeline.run(stage);
      EXPECT_NEAR(loss, want_loss[static_cast<size_t>(grid.replica(group.rank()))], 1e-6);
    }
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& item : m->named_parameters()) {
      const at::Tensor& p = item.value();
      const bool is_mine = std::any_of(mine.begin(), mine.end(), [&](const at::Tensor& t) { return t.is_same(p); });
      if (!is_mine) {
        if (item.key() != "tokens.weight") {
          EXPECT_EQ(p.numel(), 0) << item.key() << " held by stage " << pipeline.stage();
        }
        continue;
      }
      ++trained[item.key()];
      const at::Tensor& w = want[static_cast<size_t>(grid.replica(group.rank()))].at(item.key());
      ASSERT_TRUE(p.grad().defined()) << item.key();
      const double err = (p.grad() - w).norm().item<double>(), scale = w.norm().item<double>();
      EXPECT_LE(err, 1e-5 * scale + 1e-9) << item.key() << " on stage " << pipeline.stage() << " (P " << P << ", D "
                                          << D << ", M " << M << ")";
    }
  });
  for (const auto& [name, want_grad] : want[0]) EXPECT_EQ(trained[name], D) << name << ": trained by one stage per replica";
}

TEST(Pipeline, TwoStagesEqualOneWorker) { expect_pipeline_equals_one_worker(2, 1, 4); }
TEST(Pipeline, ThreeStagesEqualOneWorker) { expect_pipeline_equals_one_worker(3, 1, 3); }
TEST(Pipeline, FourStagesEqualOneWorker) { expect_pipeline_equals_one_worker(4, 1, 6); }
TEST(Pipeline, MoreStagesThanMicroBatches) { expect_pipeline_equals_one_worker(4, 1, 2); }
TEST(Pipeline, TwoStagesTimesTwoReplicas) { expect_pipeline_equals_one_worker(2, 2, 3); }
TEST(Pipeline, RecomputedStagesEqualOneWorker) {
  expect_pipeline_equals_one_worker(3, 1, 4, true);
  expect_pipeline_equals_one_worker(2, 2, 3, true);
}

// Two stages of one weight each; the first drops half its outputs (dropout in training), the
// last draws nothing (the threads of run_site share the process's generator).
class DropoutStages : public StageModel {
 public:
  explicit DropoutStages(bool first) : w_(at::linspace(0.5, 1.5, 8).view({2, 4}).requires_grad_(true)), first_(first) {}
  std::vector<at::Tensor> forward(int micro, const std::vector<at::Tensor>& inputs) override {
    ++forwards;
    if (first_) {
      const at::Tensor x = at::arange(12, at::kFloat).view({3, 4}).add(micro);
      return {at::dropout(x.matmul(w_.t()), 0.5, /*train=*/true)};
    }
    return {inputs.at(0).matmul(w_).pow(2).sum()};
  }
  at::Tensor w_;
  bool first_;
  int forwards = 0;
};

// With recompute the first stage runs each forward twice, the second time with the first run's
// dropout masks: the same gradients as without, and the generator where it would be.
TEST(Pipeline, RecomputeDrawsTheSameDropoutMasks) {
  struct Run {
    at::Tensor grad, generator_after;
    double loss = 0;
    int forwards = 0;
  };
  auto run = [](bool recompute) {
    Run out;
    collective::testing::run_site(recompute ? "recompute" : "keep", 2, [&](collective::SiteGroup& group) {
      Pipeline pipeline(group, SiteGrid{1, 2}, 3, recompute);
      DropoutStages stage(pipeline.first());
      if (pipeline.first()) at::manual_seed(7);
      const double loss = pipeline.run(stage);
      if (!pipeline.first()) return;
      out = {stage.w_.grad().clone(), generator_state(at::kCPU), loss, stage.forwards};
    });
    return out;
  };
  const Run kept = run(false), recomputed = run(true);
  EXPECT_EQ(kept.forwards, 3);
  EXPECT_EQ(recomputed.forwards, 6);
  EXPECT_GT(kept.grad.abs().sum().item<double>(), 0);
  EXPECT_TRUE(at::equal(kept.grad, recomputed.grad)) << kept.grad << recomputed.grad;
  EXPECT_DOUBLE_EQ(kept.loss, recomputed.loss);
  EXPECT_TRUE(at::equal(kept.generator_after, recomputed.generator_after));
}

// Built under encoder_keeper, a worker never holds another stage's layer, and trains as a model
// built whole and cut afterwards: the same gradients, the same whole-model sizes.
TEST(Pipeline, BuiltStageByStageEqualsBuiltWholeThenCut) {
  const model::MlmEncoder whole = make_encoder();
  collective::testing::run_site("keeper", 2, [&](collective::SiteGroup& group) {
    const SiteGrid grid{1, 2};
    Pipeline cut_pipeline(group, grid, 2);
    model::MlmEncoder a = make_encoder();
    EncoderStage cut(*a, cut_pipeline);
    std::unique_ptr<StageKeeper> keeper = encoder_keeper(whole->config(), 41, 2, grid.stage(group.rank()));
    model::MlmEncoder b = make_encoder(keeper.get());
    Pipeline kept_pipeline(group, grid, 2);
    EncoderStage kept(*b, kept_pipeline, keeper.get());
    EXPECT_EQ(kept.begin(), cut.begin());
    EXPECT_EQ(kept.end(), cut.end());
    EXPECT_EQ(kept.staged().whole_numel(false), model::numel(whole->parameters()));
    EXPECT_EQ(kept.staged().whole_numel(true), cut.staged().whole_numel(true));
    const auto want = a->named_parameters();
    for (const auto& item : b->named_parameters())
      EXPECT_TRUE(at::equal(item.value(), want[item.key()])) << item.key() << " on stage " << grid.stage(group.rank());
    auto [ids, labels] = batch_of(0);
    for (auto* stage : {&cut, &kept}) stage->set_batch(ids, labels);
    EXPECT_DOUBLE_EQ(cut_pipeline.run(cut), kept_pipeline.run(kept));
    for (const auto& item : b->named_parameters()) {
      if (item.value().grad().defined()) {
        EXPECT_TRUE(at::equal(item.value().grad(), want[item.key()].grad())) << item.key();
      }
    }
  });
}

TEST(Pipeline, WholeModelLentToTheFirstStagesForAWhile) {
  const model::MlmEncoder whole = make_encoder();
  for (int replicas : {1, 2})
    collective::testing::run_site("whole", 4, [&](collective::SiteGroup& group) {
      const SiteGrid grid{2, 2};
      model::MlmEncoder m = make_encoder();
      Pipeline pipeline(group, grid, 2);
      EncoderStage stage(*m, pipeline);
      int64_t held = 0;
      for (const auto& p : m->parameters()) held += p.numel();
      bool ran = false;
      stage.staged().with_whole(group, grid, replicas, [&] {
        ran = true;
        const auto want = whole->named_parameters();
        for (const auto& item : m->named_parameters()) EXPECT_TRUE(at::equal(item.value(), want[item.key()])) << item.key();
      });
      EXPECT_EQ(ran, grid.stage(group.rank()) == 0 && grid.replica(group.rank()) < replicas) << group.rank();
      int64_t after = 0;
      for (const auto& p : m->parameters()) after += p.numel();
      EXPECT_EQ(after, held) << "lent, then let go again";
      EXPECT_LT(held, model::numel(whole->parameters())) << "a stage holds part of the model";
    });
}

}  // namespace
}  // namespace nebula::parallel
