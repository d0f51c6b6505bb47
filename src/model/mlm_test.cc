#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/optim/adamw.h>

#include <cmath>

#include "model/mlm_batch.h"
#include "model/mlm_encoder.h"
#include "model/xlingual.h"
#include "nebula/error.h"

namespace nebula::model {
namespace {

std::vector<std::vector<int>> toy_sequences(int n, int vocab) {
  // Sentences of a tiny language with structure: token k is always followed by k+1.
  std::vector<std::vector<int>> seqs;
  std::mt19937 rng(7);
  for (int i = 0; i < n; ++i) {
    std::vector<int> s{2};
    int start = 5 + static_cast<int>(rng() % (vocab - 15));
    for (int j = 0; j < 8; ++j) s.push_back(start + j);
    s.push_back(3);
    seqs.push_back(s);
  }
  return seqs;
}

// A one-layer, 16-wide encoder for the probes' and losses' tests.
ModelConfig tiny_config() {
  ModelConfig c;
  c.dim = 16;
  c.layers = 1;
  c.heads = 2;
  c.ffn = 32;
  c.max_len = 16;
  return c;
}

TEST(MlmBatcher, MasksAsSpecifiedAndIsDeterministic) {
  SpecialIds ids;
  ids.vocab_size = 50;
  MlmBatcher a(toy_sequences(64, 50), ids, 0.15, 8, 42), b(toy_sequences(64, 50), ids, 0.15, 8, 42);
  for (int step = 0; step < 20; ++step) {
    MlmBatch x = a.next(), y = b.next();
    EXPECT_TRUE(at::equal(x.ids, y.ids));
    EXPECT_TRUE(at::equal(x.labels, y.labels));
    EXPECT_EQ(x.tokens, 8 * 10);
    EXPECT_GE(x.predicted, 8);  // at least one per sentence
    EXPECT_EQ(x.predicted, x.labels.ne(kIgnoreIndex).sum().item<int64_t>());
    // BOS/EOS are never chosen.
    EXPECT_TRUE(x.labels.select(1, 0).eq(kIgnoreIndex).all().item<bool>());
    EXPECT_TRUE(x.labels.select(1, 9).eq(kIgnoreIndex).all().item<bool>());
  }
}

// A batcher restored from a saved state (mid-pass, 70 examples: the pass wraps) makes the same
// batches, masks included, as the one it was saved from; a state of another corpus is refused.
TEST(MlmBatcher, RestoredStateContinuesExactly) {
  SpecialIds ids;
  ids.vocab_size = 50;
  MlmBatcher a(toy_sequences(70, 50), ids, 0.15, 8, 42), b(toy_sequences(70, 50), ids, 0.15, 8, 7);
  for (int i = 0; i < 11; ++i) a.next();
  b.restore(a.state());
  for (int step = 0; step < 20; ++step) {
    MlmBatch x = a.next(), y = b.next();
    ASSERT_TRUE(at::equal(x.ids, y.ids)) << step;
    ASSERT_TRUE(at::equal(x.labels, y.labels)) << step;
  }
  MlmBatcher other(toy_sequences(60, 50), ids, 0.15, 8, 42);
  EXPECT_THROW(other.restore(a.state()), DataError);
  BatcherState bad = a.state();
  bad.order[0] = bad.order[1];  // not a permutation
  EXPECT_THROW(b.restore(bad), DataError);
  bad = a.state();
  bad.rng = "not a generator";
  EXPECT_THROW(b.restore(bad), DataError);
}

// The toy language's encoder (vocabulary of 60), from seed 0.
MlmEncoder toy_encoder(const SpecialIds& ids) {
  at::manual_seed(0);
  ModelConfig c;
  c.dim = 32;
  c.layers = 1;
  c.heads = 2;
  c.ffn = 64;
  c.max_len = 16;
  return MlmEncoder(c, ids.vocab_size, ids.pad);
}

TEST(MlmEncoder, LearnsAToyLanguage) {
  SpecialIds ids;
  ids.vocab_size = 60;
  MlmEncoder model = toy_encoder(ids);
  MlmBatcher batcher(toy_sequences(256, 60), ids, 0.15, 16, 1);
  const auto held_out = toy_sequences(64, 60);
  const Accuracy before = mlm_accuracy(*model, held_out, ids, 0.15, 9);
  EXPECT_EQ(before.total, mlm_accuracy(*model, held_out, ids, 0.15, 9).total);  // the same masks
  EXPECT_EQ(before.correct, mlm_accuracy(*model, held_out, ids, 0.15, 9).correct);
  EXPECT_TRUE(model->is_training());  // restored after evaluating
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3));
  double first = 0, last = 0;
  for (int step = 0; step < 400; ++step) {
    MlmBatch b = batcher.next();
    at::Tensor loss = model->loss(b.ids, b.labels);
    opt.zero_grad();
    loss.backward();
    opt.step();
    if (step < 10) first += loss.item<double>() / 10;
    if (step >= 390) last += loss.item<double>() / 10;
  }
  // Chance is ln(60) ≈ 4.1; the structure makes masked tokens predictable from neighbours.
  EXPECT_GT(first, 3.0);
  EXPECT_LT(last, first * 0.5) << "first " << first << " last " << last;
  // Held-out accuracy on masked tokens: chance is 1/55; the learnt rule predicts most.
  const Accuracy after = mlm_accuracy(*model, held_out, ids, 0.15, 9);
  EXPECT_GE(before.total, 64);
  EXPECT_LT(before.value(), 0.2);
  EXPECT_GT(after.value(), 0.5) << after.correct << "/" << after.total;
}

// The probe scores masked tokens only: a model that copies its input must not score the
// positions training's 80/10/10 rule leaves unchanged. Scaled-up tied embeddings make the
// untrained encoder such a copier (its output at a position is closest to its own input).
TEST(MlmEncoder, AccuracyProbeGivesACopyingModelNothingForFree) {
  SpecialIds ids;
  ids.vocab_size = 60;
  MlmEncoder model = toy_encoder(ids);
  {
    at::NoGradGuard no_grad;
    for (auto& p : model->named_parameters())
      if (p.key() == "tokens.weight")
        p.value().mul_(20);
  }
  const auto seqs = toy_sequences(128, 60);
  // It does copy: on unmasked input it predicts most tokens as themselves.
  MlmBatcher batcher(seqs, ids, 0.0, 128, 1);
  std::vector<const std::vector<int>*> all;
  for (const auto& q : seqs) all.push_back(&q);
  MlmBatch plain = batcher.make(all);
  at::NoGradGuard no_grad;
  model->eval();
  at::Tensor real = plain.ids.ge(ids.first_ordinary);
  const double copied = model->forward(plain.ids).argmax(-1).eq(plain.ids).logical_and(real).sum().item<double>() /
                        real.sum().item<double>();
  ASSERT_GT(copied, 0.5) << "the scaled model should copy its input";
  const Accuracy probe = mlm_accuracy(*model, seqs, ids, 0.15, 9);
  EXPECT_LT(probe.value(), 0.03) << probe.correct << "/" << probe.total;  // scored ~10% with unchanged positions
}

TEST(Xlingual, EmbeddingsIgnorePaddingAndIdenticalPairsAreAllRetrieved) {
  at::manual_seed(3);
  MlmEncoder model(tiny_config(), 60, 0);
  std::vector<std::vector<int>> seqs;  // 20 distinct sentences
  for (int i = 0; i < 20; ++i) seqs.push_back({2, 5 + i, 30 + (i * 7) % 25, 5 + (i * 3) % 20, 40 + i % 9, 3});
  seqs[0].resize(4);  // shorter than the rest: padded in the batch
  seqs[0].push_back(3);
  at::Tensor all = sentence_embeddings(*model, seqs, 0);
  at::Tensor alone = sentence_embeddings(*model, {seqs[0]}, 0);
  EXPECT_TRUE(at::allclose(all[0], alone[0], 1e-5, 1e-5));
  EXPECT_NEAR(all.norm(2, {1}).min().item<double>(), 1.0, 1e-5);
  // Sentences retrieved among themselves: every one finds itself (toy sentences are distinct).
  Accuracy self = retrieval_accuracy(*model, seqs, seqs, 0);
  EXPECT_EQ(self.total, 40);
  EXPECT_EQ(self.correct, 40);
  // Against a rotated list, the "translation" of i is at i+1: the truth position never matches.
  auto rotated = seqs;
  std::rotate(rotated.begin(), rotated.begin() + 1, rotated.end());
  EXPECT_EQ(retrieval_accuracy(*model, seqs, rotated, 0).correct, 0);
}

// The loss from masked positions' logits only equals the cross-entropy of forward()'s full
// logits restricted to those positions, value and gradient.
TEST(MlmEncoder, MaskedOnlyLogitsGiveTheFullLogitsLoss) {
  at::manual_seed(5);
  MlmEncoder model(tiny_config(), 50, 0);
  SpecialIds ids;
  ids.vocab_size = 50;
  MlmBatcher batcher(toy_sequences(12, 50), ids, 0.3, 6, 11);
  MlmBatch b = batcher.next();
  const at::Tensor got = model->loss(b.ids, b.labels);
  const at::Tensor logits = model->forward(b.ids);
  const at::Tensor want = at::cross_entropy_loss(logits.reshape({-1, 50}), b.labels.reshape({-1}), {},
                                                 at::Reduction::Mean, kIgnoreIndex);
  EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-5);
  const auto& w = model->token_embedding()->weight;
  const at::Tensor g_got = torch::autograd::grad({got}, {w}, {}, true)[0];
  const at::Tensor g_want = torch::autograd::grad({want}, {w})[0];
  EXPECT_TRUE(at::allclose(g_got, g_want, 1e-5, 1e-6));
  // The pooled embedding: unit rows, the same from embed() as from pool(encode()).
  const at::Tensor e = model->embed(b.ids);
  EXPECT_NEAR(e.norm(2, {1}).min().item<double>(), 1.0, 1e-5);
  EXPECT_TRUE(at::allclose(e, model->pool(model->encode(b.ids), b.ids)));
}

// The translation-ranking loss against a hand computation: two pairs of 2-d unit vectors.
TEST(Xlingual, TranslationRankingLossMatchesAHandComputation) {
  const at::Tensor en = at::tensor({1.0f, 0.0f, 0.0f, 1.0f}).view({2, 2});
  const double c = std::sqrt(0.5);
  const at::Tensor other = at::tensor({1.0f, 0.0f, static_cast<float>(c), static_cast<float>(c)}).view({2, 2});
  // Similarities: [[1, c], [0, c]]; at temperature 0.5 the logits are twice those.
  const double t = 0.5;
  auto lse2 = [](double a, double b) { return std::log(std::exp(a) + std::exp(b)); };
  const double rows = ((lse2(2, 2 * c) - 2) + (lse2(0, 2 * c) - 2 * c)) / 2;  // en → other
  const double cols = ((lse2(2, 0) - 2) + (lse2(2 * c, 2 * c) - 2 * c)) / 2;  // other → en
  EXPECT_NEAR(translation_ranking_loss(en, other, t).item<double>(), (rows + cols) / 2, 1e-6);
  // Perfectly separated pairs at a low temperature: the loss vanishes.
  EXPECT_NEAR(translation_ranking_loss(en, en, 0.01).item<double>(), 0.0, 1e-6);
  EXPECT_THROW(translation_ranking_loss(en, other.narrow(0, 0, 1), t), Error);
  EXPECT_THROW(translation_ranking_loss(en, other, 0), Error);
}

// Pair batches keep each pair together (the English of row i is the translation's pair) and
// repeat exactly from a restored state.
TEST(PairBatcher, KeepsPairsTogetherAndRestoresExactly) {
  std::vector<std::vector<int>> en, other;
  for (int i = 0; i < 10; ++i) {
    en.push_back({2, 10 + i, 3});
    other.push_back(std::vector<int>(static_cast<size_t>(2 + i % 3), 30 + i));  // lengths differ: padded
  }
  PairBatcher a(en, other, 0, 4, 99);
  for (int step = 0; step < 5; ++step) {
    PairBatch b = a.next();
    ASSERT_EQ(b.en.size(0), 4);
    for (int r = 0; r < 4; ++r) EXPECT_EQ(b.other[r][0].item<int64_t>(), b.en[r][1].item<int64_t>() + 20);
  }
  const BatcherState st = a.state();
  PairBatcher b(en, other, 0, 4, 1);
  b.restore(st);
  EXPECT_TRUE(at::equal(a.next().en, b.next().en));
  EXPECT_THROW(PairBatcher({}, {}, 0, 4, 1), Error);
  EXPECT_THROW(PairBatcher(en, {other[0]}, 0, 4, 1), Error);
}

}  // namespace
}  // namespace nebula::model
