#include "model/peft.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <random>

#include "model/mlm_batch.h"
#include "model/seq2seq.h"
#include "model/seq2seq_batch.h"
#include "nebula/error.h"

namespace nebula {
// For gtest's parameter names and messages.
void PrintTo(const PeftConfig& p, std::ostream* os) {
  *os << p.kind << " (rank " << p.rank << ", alpha " << p.alpha << ", adapter_dim " << p.adapter_dim << ")";
}

namespace model {
namespace {

ModelConfig tiny_config() {
  ModelConfig c;
  c.dim = 32;
  c.layers = 2;
  c.heads = 4;
  c.ffn = 48;  // ≠ dim, so that linear1/linear2 shapes matter in the counts
  c.max_len = 16;
  return c;
}

PeftConfig lora(int64_t rank, double alpha = 16) {
  PeftConfig p;
  p.kind = "lora";
  p.rank = rank;
  p.alpha = alpha;
  return p;
}

PeftConfig adapter(int64_t dim) {
  PeftConfig p;
  p.kind = "adapter";
  p.adapter_dim = dim;
  return p;
}

// The toy language of mlm_test.cc, token k always followed by k+stride.
std::vector<std::vector<int>> toy_sequences(int n, int vocab, int stride) {
  std::vector<std::vector<int>> seqs;
  std::mt19937 rng(7);
  for (int i = 0; i < n; ++i) {
    std::vector<int> s{2};
    int start = 5 + static_cast<int>(rng() % (vocab - 5 - 8 * stride));
    for (int j = 0; j < 8; ++j) s.push_back(start + j * stride);
    s.push_back(3);
    seqs.push_back(s);
  }
  return seqs;
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

TEST(LoraLinear, StartsEqualToBaseAndNeverChangesIt) {
  at::manual_seed(1);
  torch::nn::Linear base(12, 20);
  const at::Tensor w0 = base->weight.detach().clone(), b0 = base->bias.detach().clone();
  at::Tensor x = at::randn({5, 12});
  const at::Tensor base_out = base(x).detach();

  LoraLinear lora(base, /*rank=*/3, /*alpha=*/6);
  EXPECT_EQ(lora->a().sizes(), at::IntArrayRef({3, 12}));
  EXPECT_EQ(lora->b().sizes(), at::IntArrayRef({20, 3}));
  EXPECT_DOUBLE_EQ(lora->scale(), 2.0);
  EXPECT_TRUE(at::equal(lora(x), base_out));  // B = 0: exactly the base, not just close
  EXPECT_EQ(lora->parameters().size(), 4u);

  std::vector<at::Tensor> trainable;
  for (auto& p : lora->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  ASSERT_EQ(trainable.size(), 2u);  // lora_A, lora_B
  torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  at::Tensor target = at::randn({5, 20});
  double first = 0, last = 0;
  for (int step = 0; step < 50; ++step) {
    at::Tensor loss = (lora(x) - target).pow(2).mean();
    opt.zero_grad();
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first);
  EXPECT_TRUE(at::equal(base->weight, w0));  // bit-identical
  EXPECT_TRUE(at::equal(base->bias, b0));
  EXPECT_FALSE(base->weight.grad().defined());
  EXPECT_FALSE(base->bias.grad().defined());
  // The output is the closed form base(x) + (alpha/r)·x·Aᵀ·Bᵀ.
  at::NoGradGuard no_grad;
  at::Tensor expected = base_out + at::matmul(at::matmul(x, lora->a().t()), lora->b().t()) * 2.0;
  EXPECT_TRUE(at::allclose(lora(x), expected, 1e-5, 1e-6));
}

TEST(Adapter, StartsAsIdentity) {
  at::manual_seed(2);
  Adapter a(32, 8);
  at::Tensor x = at::randn({4, 6, 32});
  EXPECT_TRUE(at::equal(a(x), x));
  EXPECT_EQ(a->down()->weight.sizes(), at::IntArrayRef({8, 32}));
  EXPECT_EQ(a->up()->weight.sizes(), at::IntArrayRef({32, 8}));
}

// Right after apply_peft the model computes exactly what it computed before.
TEST(Peft, InjectionLeavesTheModelFunctionUnchanged) {
  SpecialIds ids;
  ids.vocab_size = 60;
  at::Tensor input = at::randint(5, 60, {4, 12}, at::kLong);
  input[3].narrow(0, 8, 4).fill_(ids.pad);
  for (const PeftConfig& peft : {lora(4), adapter(8)}) {
    at::manual_seed(3);
    MlmEncoder m(tiny_config(), ids.vocab_size, ids.pad);
    at::NoGradGuard no_grad;
    at::Tensor before = m->forward(input);
    apply_peft(*m, peft);
    EXPECT_TRUE(at::equal(m->forward(input), before)) << peft.kind;
  }
}

TEST(Peft, LoraTrainableCountIsClosedForm) {
  const ModelConfig c = tiny_config();
  MlmEncoder m(c, 60, 0);
  const int64_t all = numel(m->parameters()), r = 4;
  auto params = apply_peft(*m, lora(r));
  // r·(in + out) per Linear: q, k, v, out are dim→dim; linear1 dim→ffn; linear2 ffn→dim.
  const int64_t per_layer = 4 * r * (c.dim + c.dim) + r * (c.dim + c.ffn) + r * (c.ffn + c.dim);
  EXPECT_EQ(numel(params), c.layers * per_layer);
  EXPECT_EQ(params.size(), static_cast<size_t>(c.layers * 6 * 2));
  // Nothing was lost or added to the backbone: all = frozen + trainable.
  EXPECT_EQ(numel(m->parameters()), all + numel(params));
  EXPECT_EQ(numel(m->trainable_parameters()), numel(params));
}

TEST(Peft, AdapterTrainableCountIsClosedForm) {
  const ModelConfig c = tiny_config();
  MlmEncoder m(c, 60, 0);
  const int64_t all = numel(m->parameters()), a = 8;
  auto params = apply_peft(*m, adapter(a));
  // Two adapters per layer, each down (dim·a + a) and up (a·dim + dim).
  EXPECT_EQ(numel(params), c.layers * 2 * (c.dim * a + a + a * c.dim + c.dim));
  EXPECT_EQ(numel(m->parameters()), all + numel(params));
}

TEST(Peft, NoneTrainsEverything) {
  MlmEncoder m(tiny_config(), 60, 0);
  auto params = apply_peft(*m, PeftConfig{});
  ASSERT_EQ(params.size(), m->parameters().size());
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(params[i].is_same(m->parameters()[i]));
}

// The order is what every worker's strategy buckets by, so it must not depend on anything but
// the configuration.
TEST(Peft, TrainableParametersComeInRegistrationOrder) {
  ModelConfig c = tiny_config();
  c.layers = 1;
  MlmEncoder m(c, 60, 0);
  apply_peft(*m, lora(2));
  std::vector<std::string> names;
  for (const auto& p : m->named_parameters())
    if (p.value().requires_grad()) names.push_back(p.key());
  std::vector<std::string> expected;
  for (const char* proj : {"q", "k", "v", "out", "linear1", "linear2"})
    for (const char* ab : {"lora_A", "lora_B"}) expected.push_back(str_cat("layers.0.", proj, ".", ab));
  EXPECT_EQ(names, expected);

  MlmEncoder m2(c, 60, 0);
  apply_peft(*m2, adapter(4));
  names.clear();
  for (const auto& p : m2->named_parameters())
    if (p.value().requires_grad()) names.push_back(p.key());
  EXPECT_EQ(names, (std::vector<std::string>{"layers.0.adapter1.down.weight", "layers.0.adapter1.down.bias",
                                              "layers.0.adapter1.up.weight", "layers.0.adapter1.up.bias",
                                              "layers.0.adapter2.down.weight", "layers.0.adapter2.down.bias",
                                              "layers.0.adapter2.up.weight", "layers.0.adapter2.up.bias"}));
}

// What PEFT is for: a backbone trained on one task (the toy language with stride 1) adapts to
// another (stride 2) by training only the added parameters. A few AdamW steps: the loss falls,
// gradients reach only the trainable parameters, every frozen parameter stays bit-identical.
class PeftTraining : public testing::TestWithParam<PeftConfig> {};

double train(MlmEncoder& m, const std::vector<at::Tensor>& params, int stride, int steps, double lr,
             double* first_loss = nullptr) {
  SpecialIds ids;
  ids.vocab_size = 60;
  MlmBatcher batcher(toy_sequences(256, 60, stride), ids, 0.15, 16, 1);
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(lr).weight_decay(0.01));
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    MlmBatch b = batcher.next();
    at::Tensor loss = m->loss(b.ids, b.labels);
    opt.zero_grad();
    loss.backward();
    opt.step();
    if (step < 10) first += loss.item<double>() / 10;
    if (step >= steps - 10) last += loss.item<double>() / 10;
  }
  if (first_loss) *first_loss = first;
  return last;
}

TEST_P(PeftTraining, LossFallsAndFrozenParametersNeverChange) {
  at::manual_seed(0);
  MlmEncoder m(tiny_config(), 60, SpecialIds{}.pad);
  const double pretrained = train(m, m->parameters(), /*stride=*/1, 300, 3e-3);

  const auto trainable = apply_peft(*m, GetParam());
  std::vector<at::Tensor> frozen;
  for (auto& p : m->parameters())
    if (!p.requires_grad()) frozen.push_back(p);
  ASSERT_FALSE(frozen.empty());
  const auto frozen_before = clones(frozen);
  m->zero_grad(/*set_to_none=*/true);  // pretraining's gradients

  double first = 0;
  const double last = train(m, trainable, /*stride=*/2, 150, 1e-2, &first);
  EXPECT_LT(last, first * 0.7) << GetParam().kind << ": pretrained " << pretrained << ", new task first " << first
                               << " last " << last;
  for (const auto& p : trainable) EXPECT_TRUE(p.grad().defined());
  for (size_t i = 0; i < frozen.size(); ++i) {
    EXPECT_FALSE(frozen[i].grad().defined()) << "frozen parameter " << i;
    EXPECT_TRUE(at::equal(frozen[i], frozen_before[i])) << "frozen parameter " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, PeftTraining, testing::Values(lora(4), adapter(8)),
                         [](const auto& info) { return info.param.kind; });

// PEFT on a translation model: the model computes what it did before injection; only the
// added values train (LoRA: each of an encoder layer's 6 Linears and a decoder layer's 10;
// adapters: 2 per encoder layer, 3 per decoder layer); after training on a copy task the loss
// has fallen and every frozen tensor (embeddings, base weights, norms) is bit-identical to
// before.
class Seq2SeqPeft : public testing::TestWithParam<PeftConfig> {};

TEST_P(Seq2SeqPeft, TrainsOnlyItsUpdates) {
  const PeftConfig peft = GetParam();
  at::manual_seed(1);
  ModelConfig c = tiny_config();
  SpecialIds ids;
  ids.vocab_size = 60;
  Seq2Seq m(c, /*decoder_layers=*/2, 60, ids);
  const auto seqs = toy_sequences(64, 60, 1);
  std::vector<const std::vector<int>*> src, tgt;
  for (const auto& s : seqs) {
    src.push_back(&s);
    tgt.push_back(&s);
  }
  const Seq2SeqBatch b = make_seq2seq_batch(src, tgt, ids);
  at::Tensor before;
  {
    at::NoGradGuard no_grad;
    m->eval();
    before = m->forward(b.src, b.tgt_in);
  }
  const auto trainable = apply_peft(*m, peft);
  {
    at::NoGradGuard no_grad;
    EXPECT_TRUE(at::allclose(m->forward(b.src, b.tgt_in), before, 1e-5, 1e-6));
    m->train();
  }
  if (peft.kind == "lora")  // encoder: 2 layers x 6 Linears; decoder: 2 layers x 10; each lora_A and lora_B
    EXPECT_EQ(trainable.size(), 2u * (2 * 6 + 2 * 10));
  else  // 2 x 2 + 2 x 3 adapters, each down and up, weight and bias
    EXPECT_EQ(trainable.size(), 4u * (2 * 2 + 2 * 3));
  std::vector<at::Tensor> frozen;
  for (auto& p : m->parameters())
    if (!p.requires_grad()) frozen.push_back(p);
  const auto frozen_before = clones(frozen);
  torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(2e-2));
  double first = 0, last = 0;
  for (int step = 0; step < 80; ++step) {
    opt.zero_grad();
    at::Tensor loss = m->loss(b.src, b.tgt_in, b.tgt_out);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  // A random backbone: the added values alone learn slowly (LoRA by ~15 % here, adapters ~8 %).
  EXPECT_LT(last, first * 0.95) << "first " << first << " last " << last;
  for (size_t i = 0; i < frozen.size(); ++i) EXPECT_TRUE(at::equal(frozen[i], frozen_before[i])) << "frozen " << i;
  EXPECT_THROW(apply_peft(*m, peft), Error);  // once per model
}

INSTANTIATE_TEST_SUITE_P(Kinds, Seq2SeqPeft, testing::Values(lora(4), adapter(8)),
                         [](const testing::TestParamInfo<PeftConfig>& i) { return i.param.kind; });

template <typename F>
std::string config_error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no ConfigError)";
}

TEST(Peft, ConfigErrorsNameTheKey) {
  const ModelConfig c = tiny_config();
  PeftConfig bad_kind;
  bad_kind.kind = "prefix";
  EXPECT_NE(config_error_of([&] { check_peft(c, bad_kind); }).find("'peft.kind'"), std::string::npos);
  ModelConfig other = c;
  other.kind = "decoder";
  const std::string e = config_error_of([&] { check_peft(other, lora(4)); });
  EXPECT_NE(e.find("'peft.kind'"), std::string::npos) << e;
  EXPECT_NE(e.find("\"decoder\""), std::string::npos) << e;
  EXPECT_NO_THROW(check_peft(other, PeftConfig{}));  // none fits any model
  EXPECT_NE(config_error_of([&] { check_peft(c, lora(33)); }).find("'peft.rank'"), std::string::npos);
  EXPECT_NO_THROW(check_peft(c, lora(32)));
  EXPECT_NE(config_error_of([&] { check_peft(c, lora(4, 0)); }).find("'peft.alpha'"), std::string::npos);
  EXPECT_NE(config_error_of([&] { check_peft(c, adapter(0)); }).find("'peft.adapter_dim'"), std::string::npos);
  EXPECT_NE(config_error_of([&] { check_peft(c, adapter(33)); }).find("'peft.adapter_dim'"), std::string::npos);
  // apply_peft checks too, before touching the model.
  MlmEncoder m(c, 60, 0);
  EXPECT_THROW(apply_peft(*m, lora(100)), ConfigError);
  EXPECT_EQ(m->trainable_parameters().size(), m->parameters().size());
}

TEST(Peft, AppliesOnce) {
  MlmEncoder m(tiny_config(), 60, 0);
  apply_peft(*m, lora(2));
  EXPECT_THROW(apply_peft(*m, adapter(4)), Error);
}

}  // namespace
}  // namespace model
}  // namespace nebula
