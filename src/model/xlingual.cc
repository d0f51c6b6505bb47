#include "model/xlingual.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>

#include "nebula/error.h"

namespace nebula::model {
namespace {

// Eval mode and no_grad for the scope; the module's previous mode afterwards.
struct EvalScope {
  explicit EvalScope(torch::nn::Module& m) : eval_mode(m) {}
  EvalModeGuard eval_mode;
  at::NoGradGuard no_grad;
};

}  // namespace

at::Tensor sentence_embeddings(MlmEncoderImpl& model, const std::vector<std::vector<int>>& sequences,
                               int64_t pad_id, int64_t batch_size) {
  EvalScope scope(model);
  std::vector<at::Tensor> out;
  for (size_t b = 0; b < sequences.size(); b += static_cast<size_t>(batch_size)) {
    const size_t e = std::min(sequences.size(), b + static_cast<size_t>(batch_size));
    out.push_back(model.embed(pad_sequences(sequences, pad_id, b, e)).cpu());
  }
  if (out.empty()) return at::empty({0, model.config().dim});
  return at::cat(out);
}

at::Tensor translation_ranking_loss(const at::Tensor& en, const at::Tensor& other, double temperature) {
  NEBULA_CHECK(en.dim() == 2 && en.sizes() == other.sizes() && en.size(0) >= 1, "translation ranking needs two [n, dim] ",
               "embeddings of the same shape, got ", en.sizes(), " and ", other.sizes());
  NEBULA_CHECK(temperature > 0, "translation ranking: temperature ", temperature);
  const at::Tensor logits = at::matmul(en, other.t()) / temperature;  // [n, n]; the pairs on the diagonal
  const at::Tensor truth = at::arange(en.size(0), at::TensorOptions().dtype(at::kLong).device(en.device()));
  return 0.5 * (at::cross_entropy_loss(logits, truth) + at::cross_entropy_loss(logits.t(), truth));
}

Accuracy retrieval_accuracy(MlmEncoderImpl& model, const std::vector<std::vector<int>>& en,
                            const std::vector<std::vector<int>>& other, int64_t pad_id) {
  NEBULA_CHECK(en.size() == other.size(), "retrieval needs aligned pairs: ", en.size(), " English vs ", other.size());
  Accuracy acc;
  if (en.empty()) return acc;
  // Each side is centred on its own mean before the cosine: MLM representations share a large
  // common direction (they are anisotropic), which otherwise dominates every similarity.
  auto centred = [&](const std::vector<std::vector<int>>& side) {
    at::Tensor e = sentence_embeddings(model, side, pad_id);
    e = e - e.mean(0, true);
    return e / e.norm(2, {1}, true).clamp_min(1e-12);
  };
  at::Tensor similarity = at::matmul(centred(en), centred(other).t());  // [n, n] cosines
  at::Tensor truth = at::arange(static_cast<int64_t>(en.size()), at::kLong);
  acc.correct = similarity.argmax(1).eq(truth).sum().item<int64_t>() +  // English → other
                similarity.argmax(0).eq(truth).sum().item<int64_t>();   // other → English
  acc.total = 2 * static_cast<int64_t>(en.size());
  return acc;
}

Accuracy mlm_accuracy(MlmEncoderImpl& model, const std::vector<std::vector<int>>& sequences, const SpecialIds& ids,
                      double mask_prob, uint64_t seed, int64_t batch_size) {
  Accuracy acc;
  if (sequences.empty()) return acc;
  EvalScope scope(model);
  MlmBatcher batcher(sequences, ids, mask_prob, batch_size, seed);
  for (size_t b = 0; b < sequences.size(); b += static_cast<size_t>(batch_size)) {
    std::vector<const std::vector<int>*> chunk;
    for (size_t i = b; i < std::min(sequences.size(), b + static_cast<size_t>(batch_size)); ++i)
      chunk.push_back(&sequences[i]);
    MlmBatch batch = batcher.make(chunk);
    at::Tensor labelled = batch.labels.ne(kIgnoreIndex);
    // Every position scored shows [MASK]. Training's 80/10/10 rule leaves one in ten unchanged,
    // and a model that merely copies its input (an untrained one with tied embeddings does)
    // would score those: ~10% accuracy at step 0 for nothing.
    batch.ids.masked_fill_(labelled, ids.mask);
    at::Tensor predicted = model.forward(batch.ids).argmax(-1).cpu();
    acc.correct += predicted.eq(batch.labels).logical_and(labelled).sum().item<int64_t>();
    acc.total += labelled.sum().item<int64_t>();
  }
  return acc;
}

}  // namespace nebula::model
