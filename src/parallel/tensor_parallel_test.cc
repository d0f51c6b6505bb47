#include "parallel/tensor_parallel.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <mutex>

#include "collective/testing.h"
#include "model/mlm_encoder.h"
#include "model/peft.h"
#include "model/seq2seq.h"
#include "model/testing.h"
#include "parallel/pipeline.h"

namespace nebula::parallel {
namespace {

TEST(TensorParallel, GridRanksTensorSlicesInnermost) {
  const SiteGrid g{2, 2, 3};  // data 2 × pipeline 2 × tensor 3
  EXPECT_EQ(g.workers(), 12);
  EXPECT_EQ(g.rank(1, 1, 2), 11);
  EXPECT_EQ(g.stage(7), 1);
  EXPECT_EQ(g.replica(7), 0);
  EXPECT_EQ(g.tensor_rank(7), 1);
  EXPECT_EQ(g.data_ranks(0, 1), (std::vector<int>{1, 4}));
  EXPECT_EQ(g.tensor_ranks(1, 1), (std::vector<int>{9, 10, 11}));
  const SiteGrid plain{3, 2};  // without tensor slices: the pipeline's grid as it was
  EXPECT_EQ(plain.rank(1, 2), 5);
  EXPECT_EQ(plain.data_ranks(1), (std::vector<int>{3, 4, 5}));
}

TEST(TensorParallel, SlicesCoverTheWholeInOrder) {
  for (int64_t total : {1, 7, 41, 64})
    for (int parts : {1, 2, 3, 4}) {
      if (total < parts) continue;
      int64_t next = 0;
      for (int p = 0; p < parts; ++p) {
        const model::SliceRange r = model::slice_of(total, parts, p);
        EXPECT_EQ(r.begin, next);
        next = r.end;
      }
      EXPECT_EQ(next, total);
    }
}

// A site of slices holds the whole flat vector as SliceLayout says: each worker's runs read, at
// their local positions, the values its slice's parameters hold (cut as slice_parameter cuts
// them); the owned runs of all slices cover the vector once; each slice's replicas split what it
// owns; the whole parameters are every slice's, at its own local positions.
TEST(TensorParallel, SliceLayoutHoldsEveryValueOnceWhereTheSlicesKeepIt) {
  const std::vector<std::vector<int64_t>> shapes{{41, 12}, {12}, {24, 12}, {24}, {12, 24}, {12}, {3, 5}};
  const std::vector<int> dims{0, -1, 0, 0, 1, -1, 1};
  int64_t total = 0;
  for (const auto& s : shapes) total += s[0] * (s.size() > 1 ? s[1] : 1);
  const at::Tensor whole = at::arange(total, at::kFloat);
  for (int64_t slices : {1, 2, 3})
    for (int64_t data : {1, 2}) {
      const SliceLayout layout(shapes, dims, slices, data);
      ASSERT_EQ(layout.total(), total);
      std::vector<at::Tensor> local(static_cast<size_t>(slices));  // each slice's own flat vector
      for (int64_t t = 0; t < slices; ++t) {
        std::vector<at::Tensor> parts;
        int64_t at = 0;
        for (size_t i = 0; i < shapes.size(); ++i) {
          const int64_t n = shapes[i][0] * (shapes[i].size() > 1 ? shapes[i][1] : 1);
          at::Tensor p = whole.narrow(0, at, n).view(shapes[i]);
          if (dims[i] >= 0) {
            const model::SliceRange r = model::slice_of(p.size(dims[i]), static_cast<int>(slices), static_cast<int>(t));
            p = p.narrow(dims[i], r.begin, r.size());
          }
          parts.push_back(p.contiguous().view({-1}));
          at += n;
        }
        local[static_cast<size_t>(t)] = at::cat(parts);
        EXPECT_EQ(layout.held(t), local[static_cast<size_t>(t)].numel());
        // held_runs: the slice's whole local vector, every position once, from the flat vector.
        at::Tensor rebuilt = at::full({layout.held(t)}, -1.0f);
        int64_t covered = 0;
        for (const ShardRun& r : layout.held_runs(t, 0, total)) {
          EXPECT_TRUE(at::equal(rebuilt.narrow(0, r.local, r.len), at::full({r.len}, -1.0f))) << "position held twice";
          rebuilt.narrow(0, r.local, r.len).copy_(whole.narrow(0, r.flat, r.len));
          covered += r.len;
        }
        EXPECT_EQ(covered, layout.held(t));
        EXPECT_TRUE(at::equal(rebuilt, local[static_cast<size_t>(t)])) << slices << " slices, slice " << t;
      }
      EXPECT_EQ(layout.dims(), dims);
      for (const auto& [offset, numel] : {std::pair<int64_t, int64_t>{0, total}, {500, 333}, {777, 1}}) {
        std::vector<int> owners(static_cast<size_t>(numel), 0);
        for (int64_t rank = 0; rank < layout.workers(); ++rank) {
          const int64_t t = layout.slice_of_rank(rank);
          int64_t last = -1;
          for (const ShardRun& r : layout.runs(rank, offset, numel)) {
            EXPECT_GE(r.flat, offset);
            EXPECT_LE(r.flat + r.len, offset + numel);
            EXPECT_GT(r.flat, last) << "runs in flat order";
            last = r.flat;
            EXPECT_TRUE(at::equal(whole.narrow(0, r.flat, r.len), local[static_cast<size_t>(t)].narrow(0, r.local, r.len)))
                << slices << " slices, rank " << rank << ", run at " << r.flat;
            for (int64_t k = 0; k < r.len; ++k) ++owners[static_cast<size_t>(r.flat - offset + k)];
          }
        }
        for (int64_t k = 0; k < numel; ++k) ASSERT_EQ(owners[static_cast<size_t>(k)], 1) << "value " << offset + k;
        for (int64_t t = 0; t < slices; ++t) {  // the whole parameters: the same values at each slice's positions
          int64_t n = 0;
          for (const ShardRun& r : layout.whole_runs(t, offset, numel)) {
            EXPECT_TRUE(at::equal(whole.narrow(0, r.flat, r.len), local[static_cast<size_t>(t)].narrow(0, r.local, r.len)));
            n += r.len;
          }
          int64_t expected = 0;
          for (const ShardRun& r : layout.whole_runs(0, offset, numel)) expected += r.len;
          EXPECT_EQ(n, expected);
        }
      }
    }
  EXPECT_THROW(SliceLayout({{4}}, {1}, 2, 1), std::invalid_argument);  // columns of a 1-D parameter
  EXPECT_THROW(SliceLayout({{4}}, {0, 0}, 2, 1), std::invalid_argument);
  EXPECT_THROW(SliceLayout({{4}}, {0}, 0, 1), std::invalid_argument);
}

// The encoder of the equivalence tests: 2 layers, no dropout, one seed; `heads` heads and an
// MLP of `ffn`, over a vocabulary of 41 (not a multiple of 2 or 3: uneven vocabulary slices).
model::MlmEncoder make_encoder(int64_t heads, int64_t ffn) {
  static std::mutex seed_lock;  // LibTorch's default generator is the process's
  std::lock_guard<std::mutex> lock(seed_lock);
  at::manual_seed(5);
  ModelConfig c = model::testing::tiny_model_config();
  c.layers = 2;
  c.dim = 12;
  c.heads = heads;
  c.ffn = ffn;
  c.dropout = 0;
  return model::MlmEncoder(c, 41, 0);
}

std::pair<at::Tensor, at::Tensor> batch() {
  at::Tensor ids = at::arange(5 * 9, at::kLong).mul(7).add(3).remainder(36).add(5).view({5, 9});
  for (int64_t r = 0; r < 5; ++r) ids[r].narrow(0, 9 - r, r).fill_(0);  // row r: r pads at the end
  at::Tensor labels = at::where(at::arange(45, at::kLong).view({5, 9}).remainder(3).eq(0).logical_and(ids.ne(0)), ids,
                                at::full({5, 9}, model::kIgnoreIndex, at::kLong));
  return {ids, labels};
}

double relative(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).norm().item<double>() / std::max(want.norm().item<double>(), 1e-12);
}

// T workers, each with its slices: the loss is the whole model's, each slice's gradient the
// whole gradient's slice, each whole parameter's gradient the whole one's; lent whole, the
// model gives the whole model's logits, and its slices afterwards.
void expect_tensor_parallel_equals_one_worker(int T, int64_t heads, int64_t ffn) {
  model::MlmEncoder reference = make_encoder(heads, ffn);
  auto [ids, labels] = batch();
  const double want_loss = reference->loss(ids, labels).item<double>();
  reference->loss(ids, labels).backward();
  const auto want = reference->named_parameters();
  at::Tensor want_logits;
  {
    at::NoGradGuard no_grad;
    want_logits = reference->forward(ids);
  }
  collective::testing::run_site("tensor", T, [&](collective::SiteGroup& site) {
    SiteTensorGroup group(site);
    model::MlmEncoder m = make_encoder(heads, ffn);
    std::vector<model::TensorSlice> slices = m->split_for_tensor(group);
    const auto mine = m->named_parameters();
    int64_t held = 0;
    for (const auto& item : mine) held += item.value().numel();
    EXPECT_LT(held, model::numel(reference->parameters()));
    const at::Tensor loss = m->loss(ids, labels);
    EXPECT_NEAR(loss.item<double>(), want_loss, 1e-6 * std::abs(want_loss));
    loss.backward();
    for (const auto& item : mine) {
      at::Tensor w = want[item.key()].grad();
      for (const model::TensorSlice& s : slices)
        if (s.param.is_same(item.value())) w = w.narrow(s.dim, s.mine.begin, s.mine.size());
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      ASSERT_EQ(item.value().grad().sizes(), w.sizes()) << item.key();
      // A key bias's gradient is zero but for rounding (softmax ignores a shift shared by every
      // key): compared absolutely, the rest relatively.
      const bool key_bias = item.key().size() > 7 && item.key().substr(item.key().size() - 7) == ".k.bias";
      const double err = key_bias ? (item.value().grad() - w).abs().max().item<double>() : relative(item.value().grad(), w);
      EXPECT_LE(err, key_bias ? 1e-6 : 1e-5) << item.key() << " on worker " << group.rank() << " of " << T;
    }
    TensorSplit split(slices, [&](model::TensorGroup* g) { m->set_tensor_group(g); }, group, {0, 0}, {});
    bool ran = false;
    split.with_whole([&] {
      ran = true;
      for (const auto& item : m->named_parameters()) EXPECT_TRUE(at::equal(item.value(), want[item.key()])) << item.key();
      EXPECT_LE(relative(m->forward(ids), want_logits), 1e-6);
    });
    EXPECT_TRUE(ran);
    int64_t after = 0;
    for (const auto& item : m->named_parameters()) after += item.value().numel();
    EXPECT_EQ(after, held) << "lent whole, then sliced again";
    EXPECT_THROW(m->forward(ids), Error) << "the whole vocabulary's logits are not here";
    at::NoGradGuard no_grad;
    EXPECT_NEAR(m->loss(ids, labels).item<double>(), want_loss, 1e-6 * std::abs(want_loss)) << "computing split again";
  });
}

TEST(TensorParallel, TwoSlicesEqualOneWorker) { expect_tensor_parallel_equals_one_worker(2, 2, 20); }
TEST(TensorParallel, ThreeSlicesEqualOneWorker) { expect_tensor_parallel_equals_one_worker(3, 6, 24); }

// The translation model likewise: encoder and decoder slices, the vocabulary tied three ways,
// the loss with label smoothing; lent whole, it decodes as the whole model does.
TEST(TensorParallel, TranslationModelSlicesEqualOneWorker) {
  auto make = [] {
    static std::mutex seed_lock;
    std::lock_guard<std::mutex> lock(seed_lock);
    at::manual_seed(9);
    ModelConfig c = model::testing::tiny_model_config();
    c.layers = 1;
    c.dim = 12;
    c.heads = 2;
    c.ffn = 20;
    c.dropout = 0;
    return model::Seq2Seq(c, 2, 41, model::SpecialIds{});
  };
  const at::Tensor src = at::arange(4 * 7, at::kLong).mul(5).add(1).remainder(36).add(5).view({4, 7});
  const at::Tensor tgt_in = at::cat({at::full({4, 1}, 2, at::kLong), src.narrow(1, 0, 5).flip(1)}, 1);  // BOS, then 5
  at::Tensor tgt_out = at::cat({src.narrow(1, 0, 5).flip(1), at::full({4, 1}, 3, at::kLong)}, 1);       // 5, then EOS
  tgt_out[3].narrow(0, 4, 2).fill_(model::kIgnoreIndex);  // a shorter target
  const double smoothing = 0.1;
  model::Seq2Seq reference = make();
  const at::Tensor want_loss = reference->loss(src, tgt_in, tgt_out, smoothing);
  want_loss.backward();
  const auto want = reference->named_parameters();
  const auto want_tokens = reference->beam_search(src, 2, 5);
  collective::testing::run_site("tensor-s2s", 2, [&](collective::SiteGroup& site) {
    SiteTensorGroup group(site);
    model::Seq2Seq m = make();
    std::vector<model::TensorSlice> slices = m->split_for_tensor(group);
    const at::Tensor loss = m->loss(src, tgt_in, tgt_out, smoothing);
    EXPECT_NEAR(loss.item<double>(), want_loss.item<double>(), 1e-6 * std::abs(want_loss.item<double>()));
    loss.backward();
    for (const auto& item : m->named_parameters()) {
      at::Tensor w = want[item.key()].grad();
      for (const model::TensorSlice& s : slices)
        if (s.param.is_same(item.value())) w = w.narrow(s.dim, s.mine.begin, s.mine.size());
      ASSERT_EQ(item.value().grad().sizes(), w.sizes()) << item.key();
      const bool key_bias = item.key().size() > 6 && item.key().substr(item.key().size() - 6) == "k.bias";
      const double err = key_bias ? (item.value().grad() - w).abs().max().item<double>() : relative(item.value().grad(), w);
      EXPECT_LE(err, key_bias ? 1e-6 : 1e-5) << item.key() << " on worker " << group.rank();
    }
    EXPECT_THROW(m->forward(src, tgt_in), Error) << "the whole vocabulary's logits are not here";
    TensorSplit split(slices, [&](model::TensorGroup* g) { m->set_tensor_group(g); }, group, {0, 0}, {});
    split.with_whole([&] { EXPECT_EQ(m->beam_search(src, 2, 5), want_tokens); });
  });
}

TEST(TensorParallel, HeadsOrMlpNotDividedIsAnError) {
  collective::testing::run_site("tensor-bad", 3, [&](collective::SiteGroup& site) {
    SiteTensorGroup group(site);
    model::MlmEncoder m = make_encoder(2, 24);  // 2 heads over 3 workers
    EXPECT_THROW(m->split_for_tensor(group), Error);
  });
}

}  // namespace
}  // namespace nebula::parallel
