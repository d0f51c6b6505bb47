// The own encoder and decoder layers against PyTorch's (llm.c style: the same computation two
// ways, within a stated tolerance). Weights are copied from ours into torch's modules, so any difference is in
// the math: projections, head split, scaling, masking, softmax, residuals, GELU, LayerNorms.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/transformer.h>
#include <torch/nn/modules/transformerlayer.h>

#include "model/transformer.h"
#include "nebula/error.h"

namespace nebula::model {
namespace {

constexpr int64_t kDim = 16, kHeads = 4, kFfn = 32, kBatch = 3, kSeq = 7;
constexpr double kTol = 1e-5;

using P = EncoderLayerImpl::Projection;

// Ours, with every parameter moved off its initial value (norms off 1/0, biases off 0), so
// that a weight copied to the wrong place cannot go unnoticed.
EncoderLayer randomized_layer(double dropout = 0) {
  EncoderLayer layer(kDim, kHeads, kFfn, dropout);
  torch::NoGradGuard no_grad;
  for (auto& p : layer->parameters()) p.add_(at::randn_like(p) * 0.2);
  return layer;
}

torch::nn::TransformerEncoderLayer torch_copy_of(EncoderLayer& ours, double dropout = 0) {
  torch::nn::TransformerEncoderLayer t(
      torch::nn::TransformerEncoderLayerOptions(kDim, kHeads).dim_feedforward(kFfn).dropout(dropout).activation(
          torch::kGELU));
  torch::NoGradGuard no_grad;
  auto lin = [&](P p) { return ours->linear(p); };
  t->self_attn->in_proj_weight.copy_(at::cat({lin(P::kQuery)->weight, lin(P::kKey)->weight, lin(P::kValue)->weight}));
  t->self_attn->in_proj_bias.copy_(at::cat({lin(P::kQuery)->bias, lin(P::kKey)->bias, lin(P::kValue)->bias}));
  t->self_attn->out_proj->weight.copy_(lin(P::kOut)->weight);
  t->self_attn->out_proj->bias.copy_(lin(P::kOut)->bias);
  t->linear1->weight.copy_(lin(P::kFfnIn)->weight);
  t->linear1->bias.copy_(lin(P::kFfnIn)->bias);
  t->linear2->weight.copy_(lin(P::kFfnOut)->weight);
  t->linear2->bias.copy_(lin(P::kFfnOut)->bias);
  t->norm1->weight.copy_(ours->norm1()->weight);
  t->norm1->bias.copy_(ours->norm1()->bias);
  t->norm2->weight.copy_(ours->norm2()->weight);
  t->norm2->bias.copy_(ours->norm2()->bias);
  return t;
}

// Row 0 unpadded, row 1 padded at the end, row 2 at the start: every query attends somewhere.
at::Tensor padding_mask() {
  at::Tensor m = at::zeros({kBatch, kSeq}, at::kBool);
  m[1].narrow(0, 4, 3).fill_(true);
  m[2].narrow(0, 0, 2).fill_(true);
  return m;
}

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

TEST(EncoderLayer, AttentionEqualsTorchMultiheadAttention) {
  at::manual_seed(1);
  EncoderLayer ours = randomized_layer();
  auto theirs = torch_copy_of(ours);
  at::Tensor x = at::randn({kBatch, kSeq, kDim}), mask = padding_mask();
  for (const at::Tensor& m : {at::Tensor(), mask}) {
    at::Tensor a = ours->attention(x, m);
    at::Tensor xt = x.transpose(0, 1);  // torch's module is sequence-first
    at::Tensor b = std::get<0>(theirs->self_attn(xt, xt, xt, m)).transpose(0, 1);
    EXPECT_LT(max_diff(a, b), kTol) << (m.defined() ? "with" : "without") << " padding mask";
  }
}

TEST(EncoderLayer, ForwardAndGradientsEqualTorchTransformerEncoderLayer) {
  at::manual_seed(2);
  EncoderLayer ours = randomized_layer();
  auto theirs = torch_copy_of(ours);
  at::Tensor mask = padding_mask(), probe = at::randn({kBatch, kSeq, kDim});
  at::Tensor x1 = at::randn({kBatch, kSeq, kDim}).requires_grad_(), x2 = x1.detach().clone().requires_grad_();

  at::Tensor a = ours->forward(x1, mask);
  at::Tensor b = theirs->forward(x2.transpose(0, 1), /*src_mask=*/{}, mask).transpose(0, 1);
  EXPECT_LT(max_diff(a, b), kTol);
  (a * probe).sum().backward();
  (b * probe).sum().backward();
  EXPECT_LT(max_diff(x1.grad(), x2.grad()), kTol);
  at::Tensor qkv_grad = at::cat({ours->linear(P::kQuery)->weight.grad(), ours->linear(P::kKey)->weight.grad(),
                                 ours->linear(P::kValue)->weight.grad()});
  EXPECT_LT(max_diff(qkv_grad, theirs->self_attn->in_proj_weight.grad()), kTol);
  EXPECT_LT(max_diff(ours->linear(P::kOut)->weight.grad(), theirs->self_attn->out_proj->weight.grad()), kTol);
  EXPECT_LT(max_diff(ours->linear(P::kFfnIn)->weight.grad(), theirs->linear1->weight.grad()), kTol);
  EXPECT_LT(max_diff(ours->norm2()->weight.grad(), theirs->norm2->weight.grad()), kTol);
}

TEST(EncoderLayer, EvalModeDisablesDropoutLikeTorch) {
  at::manual_seed(3);
  EncoderLayer ours = randomized_layer(/*dropout=*/0.5);
  auto theirs = torch_copy_of(ours, 0.5);
  ours->eval();
  theirs->eval();
  at::Tensor x = at::randn({kBatch, kSeq, kDim}), mask = padding_mask();
  EXPECT_LT(max_diff(ours->forward(x, mask), theirs->forward(x.transpose(0, 1), {}, mask).transpose(0, 1)), kTol);
  ours->train();
  EXPECT_FALSE(at::allclose(ours->forward(x, mask), ours->forward(x, mask))) << "dropout inactive in training";
}

TEST(EncoderLayer, FullyPaddedSequenceGivesNoNaN) {
  at::manual_seed(4);
  EncoderLayer layer = randomized_layer();
  at::Tensor mask = padding_mask();
  mask[0].fill_(true);  // a sequence that is nothing but padding
  at::Tensor x = at::randn({kBatch, kSeq, kDim}).requires_grad_();
  at::Tensor y = layer->forward(x, mask);
  EXPECT_TRUE(at::isfinite(y).all().item<bool>());
  y.sum().backward();
  EXPECT_TRUE(at::isfinite(x.grad()).all().item<bool>());
  for (const auto& p : layer->named_parameters())
    EXPECT_TRUE(at::isfinite(p.value().grad()).all().item<bool>()) << p.key();
  // The other sequences are unaffected by row 0 being padding.
  at::Tensor mask2 = padding_mask();
  EXPECT_LT(max_diff(y.narrow(0, 1, 2), layer->forward(x, mask2).narrow(0, 1, 2)), 1e-6);
}

TEST(EncoderLayer, RejectsBadShapes) {
  EXPECT_THROW(EncoderLayer(10, 4, 8, 0.0), Error);  // dim not a multiple of heads
  EncoderLayer layer(kDim, kHeads, kFfn, 0.0);
  EXPECT_THROW(layer->forward(at::randn({2, 3, kDim + 1})), Error);
  EXPECT_THROW(layer->forward(at::randn({2, 3, kDim}), at::zeros({2, 3})), Error);  // float mask
}

using D = DecoderLayerImpl::Projection;

void copy_attention(torch::nn::MultiheadAttention& mha, DecoderLayer& ours, D first) {
  auto lin = [&](int i) { return ours->linear(static_cast<D>(first + i)); };
  mha->in_proj_weight.copy_(at::cat({lin(0)->weight, lin(1)->weight, lin(2)->weight}));
  mha->in_proj_bias.copy_(at::cat({lin(0)->bias, lin(1)->bias, lin(2)->bias}));
  mha->out_proj->weight.copy_(lin(3)->weight);
  mha->out_proj->bias.copy_(lin(3)->bias);
}

TEST(DecoderLayer, ForwardAndGradientsEqualTorchTransformerDecoderLayer) {
  at::manual_seed(5);
  DecoderLayer ours(kDim, kHeads, kFfn, 0.0);
  torch::nn::TransformerDecoderLayer theirs(
      torch::nn::TransformerDecoderLayerOptions(kDim, kHeads).dim_feedforward(kFfn).dropout(0.0).activation(
          torch::kGELU));
  {
    torch::NoGradGuard no_grad;
    for (auto& p : ours->parameters()) p.add_(at::randn_like(p) * 0.2);
    copy_attention(theirs->self_attn, ours, D::kSelfQuery);
    copy_attention(theirs->multihead_attn, ours, D::kCrossQuery);
    theirs->linear1->weight.copy_(ours->linear(D::kFfnIn)->weight);
    theirs->linear1->bias.copy_(ours->linear(D::kFfnIn)->bias);
    theirs->linear2->weight.copy_(ours->linear(D::kFfnOut)->weight);
    theirs->linear2->bias.copy_(ours->linear(D::kFfnOut)->bias);
    for (auto [t, o] : {std::pair{theirs->norm1, ours->norm1()}, {theirs->norm2, ours->norm2()},
                        {theirs->norm3, ours->norm3()}}) {
      t->weight.copy_(o->weight);
      t->bias.copy_(o->bias);
    }
  }
  constexpr int64_t kTgt = 5;
  at::Tensor memory_mask = padding_mask(), tgt_mask = at::zeros({kBatch, kTgt}, at::kBool);
  tgt_mask[1].narrow(0, 3, 2).fill_(true);  // padding at the end, as in a batch of targets
  at::Tensor memory = at::randn({kBatch, kSeq, kDim}), probe = at::randn({kBatch, kTgt, kDim});
  at::Tensor x1 = at::randn({kBatch, kTgt, kDim}).requires_grad_(), x2 = x1.detach().clone().requires_grad_();

  at::Tensor a = ours->forward(x1, memory, tgt_mask, memory_mask);
  at::Tensor causal = torch::nn::TransformerImpl::generate_square_subsequent_mask(kTgt);  // -inf above the diagonal
  at::Tensor b = theirs->forward(x2.transpose(0, 1), memory.transpose(0, 1), causal, /*memory_mask=*/{}, tgt_mask,
                                 memory_mask)
                     .transpose(0, 1);
  EXPECT_LT(max_diff(a, b), kTol);
  (a * probe).sum().backward();
  (b * probe).sum().backward();
  EXPECT_LT(max_diff(x1.grad(), x2.grad()), kTol);
  EXPECT_LT(max_diff(at::cat({ours->linear(D::kCrossQuery)->weight.grad(), ours->linear(D::kCrossKey)->weight.grad(),
                              ours->linear(D::kCrossValue)->weight.grad()}),
                     theirs->multihead_attn->in_proj_weight.grad()),
            kTol);
  EXPECT_LT(max_diff(ours->linear(D::kSelfOut)->weight.grad(), theirs->self_attn->out_proj->weight.grad()), kTol);
  EXPECT_LT(max_diff(ours->norm3()->weight.grad(), theirs->norm3->weight.grad()), kTol);
}

TEST(MultiHeadAttention, CausalQueryIgnoresLaterKeys) {
  at::manual_seed(6);
  at::Tensor q = at::randn({2, 4, kDim}), k = at::randn({2, 4, kDim}), v = at::randn({2, 4, kDim});
  at::Tensor a = multi_head_attention(q, k, v, kHeads, {}, /*causal=*/true, 0.0);
  k[0][2].add_(1.0);  // a later key and value of row 0 change: queries 0 and 1 of row 0 must not see it
  v[0][3].add_(1.0);
  at::Tensor b = multi_head_attention(q, k, v, kHeads, {}, /*causal=*/true, 0.0);
  EXPECT_TRUE(at::equal(a[0].narrow(0, 0, 2), b[0].narrow(0, 0, 2)));
  EXPECT_GT(max_diff(a[0].narrow(0, 2, 2), b[0].narrow(0, 2, 2)), 1e-3);
  EXPECT_TRUE(at::equal(a[1], b[1]));
  EXPECT_THROW(multi_head_attention(q, k.narrow(1, 0, 3), v.narrow(1, 0, 3), kHeads, {}, true, 0.0), Error);
}

}  // namespace
}  // namespace nebula::model
