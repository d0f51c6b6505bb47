// Seq2Seq: masks (causal, padding), loading a pre-trained encoder, the decoders (beam 1 is
// greedy; beam search never scores below greedy on these models), and learning a toy task.
#include "model/seq2seq.h"
#include "model/testing.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <random>
#include <set>
#include <string>

#include "model/seq2seq_batch.h"
#include "nebula/error.h"

namespace nebula::model {
namespace {

constexpr int64_t kVocab = 20;

SpecialIds special_ids(int64_t vocab = kVocab) {
  SpecialIds ids;
  ids.vocab_size = vocab;
  return ids;
}

using testing::tiny_model_config;  // dim 16, 1 layer, 2 heads, ffn 32, max_len 12

// Every parameter moved well off its initial value (embeddings start at 0.02 scale, which would
// make every output distribution nearly uniform and every test below weak).
void randomize(torch::nn::Module& m, double scale) {
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.add_(at::randn_like(p) * scale);
}

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// BOS, `len` random ordinary tokens, EOS.
std::vector<int> random_sentence(std::mt19937& rng, int len, const SpecialIds& ids) {
  std::vector<int> s{static_cast<int>(ids.bos)};
  std::uniform_int_distribution<int> tok(static_cast<int>(ids.first_ordinary), static_cast<int>(ids.vocab_size - 1));
  for (int i = 0; i < len; ++i) s.push_back(tok(rng));
  s.push_back(static_cast<int>(ids.eos));
  return s;
}

at::Tensor padded(const std::vector<std::vector<int>>& rows, int64_t pad) {
  size_t len = 0;
  for (const auto& r : rows) len = std::max(len, r.size());
  at::Tensor t = at::full({static_cast<int64_t>(rows.size()), static_cast<int64_t>(len)}, pad, at::kLong);
  for (size_t i = 0; i < rows.size(); ++i)
    for (size_t j = 0; j < rows[i].size(); ++j) t[i][j] = rows[i][j];
  return t;
}

// The decoders' objective, computed independently by teacher forcing `y` (no BOS/EOS) on `src`
// alone: Σ log p / ((5 + n) / 6)^alpha over y and, if y is shorter than max_len (it stopped at
// EOS), the EOS.
double hypothesis_score(Seq2Seq& model, const std::vector<int>& src, const std::vector<int>& y, int64_t max_len,
                        double alpha, const SpecialIds& ids) {
  std::vector<int> targets = y;
  if (static_cast<int64_t>(y.size()) < max_len) targets.push_back(static_cast<int>(ids.eos));
  std::vector<int> in{static_cast<int>(ids.bos)};
  in.insert(in.end(), targets.begin(), targets.end() - 1);
  at::NoGradGuard no_grad;
  at::Tensor logp = model->forward(padded({src}, ids.pad), padded({in}, ids.pad))[0].to(at::kDouble).log_softmax(-1);
  double sum = 0;
  for (size_t t = 0; t < targets.size(); ++t) sum += logp[t][targets[t]].item<double>();
  return sum / std::pow((5.0 + static_cast<double>(targets.size())) / 6.0, alpha);
}

TEST(Seq2Seq, DecoderPositionSeesNoLaterTarget) {
  at::manual_seed(1);
  SpecialIds ids = special_ids();
  Seq2Seq model(tiny_model_config(), /*decoder_layers=*/2, kVocab, ids);
  randomize(*model, 0.3);
  std::mt19937 rng(1);
  at::Tensor src = padded({random_sentence(rng, 5, ids), random_sentence(rng, 3, ids)}, ids.pad);
  at::Tensor tgt = padded({random_sentence(rng, 5, ids), random_sentence(rng, 5, ids)}, ids.pad).narrow(1, 0, 6);
  at::NoGradGuard no_grad;
  const at::Tensor before = model->forward(src, tgt);
  for (int64_t t = 1; t < tgt.size(1); ++t) {
    at::Tensor changed = tgt.clone();
    changed.select(1, t).fill_(ids.first_ordinary + (tgt[0][t].item<int64_t>() - ids.first_ordinary + 7) %
                                                         (kVocab - ids.first_ordinary));
    ASSERT_FALSE(at::equal(changed, tgt));
    const at::Tensor after = model->forward(src, changed);
    EXPECT_LT(max_diff(before.narrow(1, 0, t), after.narrow(1, 0, t)), 1e-6) << "position < " << t << " changed";
    EXPECT_GT(max_diff(before.select(1, t), after.select(1, t)), 1e-3) << "position " << t << " did not change";
  }
}

TEST(Seq2Seq, PaddedBatchGivesTheLogitsOfEachSentenceAlone) {
  at::manual_seed(2);
  SpecialIds ids = special_ids();
  Seq2Seq model(tiny_model_config(), 2, kVocab, ids);
  randomize(*model, 0.3);
  std::mt19937 rng(2);
  // Short and long on both sides, in both combinations, so that src and tgt padding both occur.
  std::vector<std::vector<int>> src{random_sentence(rng, 2, ids), random_sentence(rng, 8, ids),
                                    random_sentence(rng, 5, ids)};
  std::vector<std::vector<int>> tgt{random_sentence(rng, 7, ids), random_sentence(rng, 2, ids),
                                    random_sentence(rng, 4, ids)};
  auto ptrs = [](const std::vector<std::vector<int>>& v, std::vector<size_t> which) {
    std::vector<const std::vector<int>*> out;
    for (size_t i : which) out.push_back(&v[i]);
    return out;
  };
  at::NoGradGuard no_grad;
  Seq2SeqBatch all = make_seq2seq_batch(ptrs(src, {0, 1, 2}), ptrs(tgt, {0, 1, 2}), ids);
  const at::Tensor logits = model->forward(all.src, all.tgt_in);
  for (size_t i = 0; i < src.size(); ++i) {
    Seq2SeqBatch one = make_seq2seq_batch(ptrs(src, {i}), ptrs(tgt, {i}), ids);
    const at::Tensor alone = model->forward(one.src, one.tgt_in)[0];
    EXPECT_LT(max_diff(logits[i].narrow(0, 0, alone.size(0)), alone), 1e-5) << "sentence " << i;
  }
}

TEST(Seq2Seq, LossIsMeanCrossEntropyOverLabels) {
  at::manual_seed(3);
  SpecialIds ids = special_ids();
  Seq2Seq model(tiny_model_config(), 1, kVocab, ids);
  randomize(*model, 0.3);
  std::mt19937 rng(3);
  std::vector<std::vector<int>> src{random_sentence(rng, 3, ids), random_sentence(rng, 6, ids)};
  std::vector<std::vector<int>> tgt{random_sentence(rng, 6, ids), random_sentence(rng, 2, ids)};
  Seq2SeqBatch b = make_seq2seq_batch({&src[0], &src[1]}, {&tgt[0], &tgt[1]}, ids);
  at::NoGradGuard no_grad;
  const at::Tensor logp = model->forward(b.src, b.tgt_in).to(at::kDouble).log_softmax(-1);
  double nll = 0, uniform = 0;
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t t = 0; t < b.tgt_out.size(1); ++t) {
      const int64_t label = b.tgt_out[i][t].item<int64_t>();
      if (label == kIgnoreIndex) continue;
      nll -= logp[i][t][label].item<double>();
      uniform -= logp[i][t].mean().item<double>();
    }
  nll /= static_cast<double>(b.target_tokens);
  uniform /= static_cast<double>(b.target_tokens);
  EXPECT_NEAR(model->loss(b.src, b.tgt_in, b.tgt_out).item<double>(), nll, 1e-5);
  EXPECT_NEAR(model->loss(b.src, b.tgt_in, b.tgt_out, 0.1).item<double>(), 0.9 * nll + 0.1 * uniform, 1e-5);
  // The loss projects only the labelled positions: forward()'s rows there, in order.
  const at::Tensor rows = model->target_logits(b.src, b.tgt_in, b.tgt_out);
  ASSERT_EQ(rows.size(0), b.target_tokens);
  EXPECT_TRUE(at::allclose(rows, model->forward(b.src, b.tgt_in).index({b.tgt_out.ne(kIgnoreIndex)}), 1e-5, 1e-6));
}

TEST(Seq2Seq, InitEncoderFromCopiesAPretrainedEncoder) {
  const ModelConfig c = tiny_model_config();
  SpecialIds ids = special_ids();
  at::manual_seed(4);
  MlmEncoder pretrained(c, kVocab, ids.pad);
  randomize(*pretrained, 0.3);
  Seq2Seq model(c, 1, kVocab, ids);
  std::mt19937 rng(4);
  const at::Tensor src = padded({random_sentence(rng, 6, ids), random_sentence(rng, 2, ids)}, ids.pad);
  at::NoGradGuard no_grad;
  ASSERT_FALSE(at::allclose(model->encode(src), pretrained->encode(src)));
  model->init_encoder_from(*pretrained);
  EXPECT_TRUE(at::equal(model->encode(src), pretrained->encode(src)));
  // Copied, not shared: training the pre-trained model further does not move ours.
  const at::Tensor ours = model->encode(src);
  randomize(*pretrained, 0.1);
  EXPECT_TRUE(at::equal(model->encode(src), ours));
  // One embedding matrix in the whole model: the decoder's input and output are tied to it.
  int vocab_by_dim = 0;
  for (const auto& p : model->named_parameters())
    vocab_by_dim += p.value().sizes() == at::IntArrayRef({kVocab, c.dim});
  EXPECT_EQ(vocab_by_dim, 1);
}

TEST(Seq2Seq, InitEncoderFromRejectsOtherDimsNamingTheParameter) {
  const ModelConfig c = tiny_model_config();
  SpecialIds ids = special_ids();
  Seq2Seq model(c, 1, kVocab, ids);
  const at::Tensor tokens_before = model->encoder()->token_embedding()->weight.clone();
  auto expect_config_error = [&](const ModelConfig& other, int64_t vocab, const std::string& name) {
    MlmEncoder pretrained(other, vocab, ids.pad);
    try {
      model->init_encoder_from(*pretrained);
      ADD_FAILURE() << "no ConfigError for " << name;
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'" + name + "'"), std::string::npos) << what;
      EXPECT_NE(what.find("[model]"), std::string::npos) << what;
    }
  };
  ModelConfig wider_ffn = c;
  wider_ffn.ffn = 48;
  expect_config_error(wider_ffn, kVocab, "layers.0.linear1.weight");
  ModelConfig deeper = c;
  deeper.layers = 2;
  expect_config_error(deeper, kVocab, "layers.1.q.weight");
  expect_config_error(c, kVocab + 1, "tokens.weight");
  // Nothing was written before the mismatch was found (tokens.weight matched in the first two).
  EXPECT_TRUE(at::equal(model->encoder()->token_embedding()->weight, tokens_before));
}

TEST(Seq2Seq, BeamSearchScoresAsDefinedBeamOfOneIsGreedyWiderBeamsNotWorse) {
  const ModelConfig c = tiny_model_config();
  SpecialIds ids = special_ids();
  constexpr int64_t kMaxLen = 8;
  int improved = 0, stopped_at_eos = 0, sentences = 0;
  std::set<size_t> lengths;
  for (int seed = 0; seed < 4; ++seed) {
    at::manual_seed(100 + seed);
    Seq2Seq model(c, 1, kVocab, ids);
    randomize(*model, 0.5);
    {  // Make EOS likelier, so that hypotheses of several lengths compete.
      at::NoGradGuard no_grad;
      model->encoder()->token_embedding()->weight[ids.eos].mul_(2.0);
    }
    std::mt19937 rng(seed);
    std::vector<std::vector<int>> src;
    for (int i = 0; i < 6; ++i) src.push_back(random_sentence(rng, 2 + i, ids));
    const at::Tensor batch = padded(src, ids.pad);
    const auto greedy = model->greedy(batch, kMaxLen);
    EXPECT_EQ(model->beam_search(batch, 1, kMaxLen, 0.6), greedy) << "seed " << seed;
    for (double alpha : {0.0, 1.0}) {
      const auto nbest = model->beam_search_nbest(batch, 4, kMaxLen, alpha);
      const auto beam = model->beam_search(batch, 4, kMaxLen, alpha);
      ASSERT_EQ(nbest.size(), src.size());
      for (size_t i = 0; i < src.size(); ++i) {
        const double g = hypothesis_score(model, src[i], greedy[i], kMaxLen, alpha, ids);
        const double b = hypothesis_score(model, src[i], beam[i], kMaxLen, alpha, ids);
        EXPECT_GE(b, g - 1e-6) << "seed " << seed << " alpha " << alpha << " sentence " << i;
        improved += b > g + 1e-6;
        stopped_at_eos += static_cast<int64_t>(beam[i].size()) < kMaxLen;
        ++sentences;
        // Every finished hypothesis carries its score as computed here, best first; the best is
        // what beam_search returns.
        ASSERT_FALSE(nbest[i].empty());
        EXPECT_EQ(nbest[i][0].tokens, beam[i]);
        for (size_t h = 0; h < nbest[i].size(); ++h) {
          const auto& hyp = nbest[i][h];
          EXPECT_EQ(hyp.eos, static_cast<int64_t>(hyp.tokens.size()) < kMaxLen);
          EXPECT_NEAR(hyp.score, hypothesis_score(model, src[i], hyp.tokens, kMaxLen, alpha, ids), 1e-4)
              << "seed " << seed << " alpha " << alpha << " sentence " << i << " hypothesis " << h;
          if (h > 0) {
            EXPECT_GE(nbest[i][h - 1].score, hyp.score);
          }
          lengths.insert(hyp.tokens.size());
        }
      }
    }
  }
  // The test means something only if the search found better hypotheses and ended at EOS.
  EXPECT_GT(improved, 0) << "of " << sentences;
  EXPECT_GE(lengths.size(), 3u) << "finished hypotheses of too few lengths to test the length penalty";
  EXPECT_GT(stopped_at_eos, 0) << "of " << sentences;
  EXPECT_LT(stopped_at_eos, sentences);
}

TEST(Seq2Seq, DecodingRestoresTrainModeAndChecksMaxLen) {
  at::manual_seed(5);
  SpecialIds ids = special_ids();
  Seq2Seq model(tiny_model_config(), 1, kVocab, ids);
  std::mt19937 rng(5);
  const at::Tensor src = padded({random_sentence(rng, 3, ids)}, ids.pad);
  model->train();
  model->greedy(src, 4);
  EXPECT_TRUE(model->is_training());
  EXPECT_TRUE(model->decoder_layers()[0]->is_training());
  model->eval();
  model->beam_search(src, 2, 4);
  EXPECT_FALSE(model->is_training());
  EXPECT_THROW(model->greedy(src, model->max_len()), Error);  // max_len − 1 at most
  EXPECT_THROW(model->beam_search(src, 2, 0), Error);
  EXPECT_THROW(model->beam_search(src, 0, 4), Error);
  EXPECT_NO_THROW(model->beam_search(src, 2, model->max_len() - 1));
}

// A tiny model learns to reverse six short sequences: the loss goes below 0.1 and both
// decoders reproduce every target exactly.
TEST(Seq2Seq, LearnsToReverseSequences) {
  at::manual_seed(0);
  ModelConfig c;
  c.dim = 32;
  c.layers = 1;
  c.heads = 2;
  c.ffn = 64;
  c.max_len = 10;
  c.dropout = 0;
  SpecialIds ids = special_ids(16);
  std::mt19937 rng(6);
  std::vector<Seq2SeqBatcher::Pair> pairs;
  for (int len = 3; len <= 8; ++len) {
    std::vector<int> src = random_sentence(rng, len, ids);
    std::vector<int> tgt(src.rbegin(), src.rend());
    std::swap(tgt.front(), tgt.back());  // BOS reversed(…) EOS
    pairs.emplace_back(src, tgt);
  }
  Seq2Seq model(c, /*decoder_layers=*/1, ids.vocab_size, ids);
  Seq2SeqBatcher batcher(pairs, ids, /*batch_size=*/6, /*seed=*/1);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(5e-3));
  for (int step = 0; step < 300; ++step) {
    Seq2SeqBatch b = batcher.next();
    at::Tensor loss = model->loss(b.src, b.tgt_in, b.tgt_out);
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  std::vector<size_t> all{0, 1, 2, 3, 4, 5};
  Seq2SeqBatch b = batcher.make(all);
  const double loss = model->loss(b.src, b.tgt_in, b.tgt_out).item<double>();
  EXPECT_LT(loss, 0.1);
  const int64_t max_len = c.max_len - 1;
  const auto greedy = model->greedy(b.src, max_len);
  const auto beam = model->beam_search(b.src, 3, max_len);
  for (size_t i = 0; i < pairs.size(); ++i) {
    const std::vector<int> expected(pairs[i].second.begin() + 1, pairs[i].second.end() - 1);
    EXPECT_EQ(greedy[i], expected) << "pair " << i << ", loss " << loss;
    EXPECT_EQ(beam[i], expected) << "pair " << i << ", loss " << loss;
  }
}

TEST(Seq2SeqBatch, ShiftsTargetsAndPads) {
  SpecialIds ids = special_ids();
  const std::vector<int> s0{2, 7, 8, 3}, s1{2, 9, 3}, t0{2, 10, 11, 12, 3}, t1{2, 13, 3};
  Seq2SeqBatch b = make_seq2seq_batch({&s0, &s1}, {&t0, &t1}, ids);
  const int64_t I = kIgnoreIndex;
  auto rows = [](std::vector<int64_t> v) { return at::tensor(v, at::kLong).view({2, -1}); };
  EXPECT_TRUE(at::equal(b.src, rows({2, 7, 8, 3, 2, 9, 3, 0})));
  EXPECT_TRUE(at::equal(b.tgt_in, rows({2, 10, 11, 12, 2, 13, 0, 0})));
  EXPECT_TRUE(at::equal(b.tgt_out, rows({10, 11, 12, 3, 13, 3, I, I})));
  EXPECT_EQ(b.target_tokens, 6);
  const std::vector<int> no_bos{10, 3}, no_eos{2, 10};
  EXPECT_THROW(make_seq2seq_batch({&s0}, {&no_bos}, ids), Error);
  EXPECT_THROW(make_seq2seq_batch({&s0}, {&no_eos}, ids), Error);
  EXPECT_THROW(make_seq2seq_batch({&s0, &s1}, {&t0}, ids), Error);
}

TEST(Seq2SeqBatch, BatcherShufflesWholePassesDeterministically) {
  SpecialIds ids = special_ids();
  std::vector<Seq2SeqBatcher::Pair> pairs;
  for (int i = 0; i < 5; ++i) pairs.push_back({{2, 5 + i, 3}, {2, 10 + i, 3}});
  Seq2SeqBatcher a(pairs, ids, 5, 9), b(pairs, ids, 5, 9);
  for (int pass = 0; pass < 3; ++pass) {
    Seq2SeqBatch x = a.next(), y = b.next();
    EXPECT_TRUE(at::equal(x.src, y.src));
    EXPECT_TRUE(at::equal(x.tgt_out, y.tgt_out));
    // One pass holds every pair once, each source with its own target.
    EXPECT_EQ(std::get<0>(at::_unique(x.src.select(1, 1))).numel(), 5);
    EXPECT_TRUE(at::equal(x.tgt_in.select(1, 1), x.src.select(1, 1) + 5));
  }
}

}  // namespace
}  // namespace nebula::model
