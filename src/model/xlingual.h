// Cross-lingual evaluation of a pre-trained MlmEncoder (issue [5/7]), and the contrastive
// objective that trains for it:
//
//  * MLM accuracy: of the masked positions of held-out sentences, the share whose arg-max
//    prediction is the original token (masking as in training, with a fixed seed, so two
//    evaluations of the same model give the same number);
//  * parallel-sentence retrieval, Tatoeba style (XTREME): every sentence is embedded as the
//    mean of the encoder's final hidden states over its non-pad tokens, L2-normalised, then
//    centred on the mean of its side (English, or the other language) and normalised again
//    (MLM representations are anisotropic: a shared direction would dominate every cosine); each
//    English sentence's nearest neighbour by cosine among the other side's sentences must be
//    its own translation, and the same from the other side to English. Chance is 1/N for N
//    pairs.
//
// Both return counts (correct, total), so that several workers' or sites' results add up
// exactly before the division.
//
// The evaluations are not thread-safe (they use the module) and run under no_grad and eval mode,
// restoring the mode; translation_ranking_loss is a function of its tensors.
#pragma once

#include <cstdint>
#include <vector>

#include "model/mlm_batch.h"
#include "model/mlm_encoder.h"

namespace nebula::model {

struct Accuracy {
  int64_t correct = 0;
  int64_t total = 0;
  double value() const { return total ? static_cast<double>(correct) / static_cast<double>(total) : 0.0; }
};

// [n, dim] float32, each row of unit length. `sequences` as MlmBatcher takes them.
at::Tensor sentence_embeddings(MlmEncoderImpl& model, const std::vector<std::vector<int>>& sequences,
                               int64_t pad_id, int64_t batch_size = 64);

// The contrastive translation-ranking loss (InfoXLM's cross-lingual contrast, LaBSE's
// in-batch negatives): en[i] and other[i] ([n, dim], unit rows, MlmEncoderImpl::embed) are
// translations; each row must pick its own translation among the other side's n rows, both
// ways. The mean of the two cross-entropies of similarity / temperature against the diagonal.
at::Tensor translation_ranking_loss(const at::Tensor& en, const at::Tensor& other, double temperature);

// en[i] and other[i] are translations of each other. total = 2·n (both directions).
Accuracy retrieval_accuracy(MlmEncoderImpl& model, const std::vector<std::vector<int>>& en,
                            const std::vector<std::vector<int>>& other, int64_t pad_id);

// Masks `sequences` with MlmBatcher(ids, mask_prob, seed) and counts correct predictions.
Accuracy mlm_accuracy(MlmEncoderImpl& model, const std::vector<std::vector<int>>& sequences, const SpecialIds& ids,
                      double mask_prob, uint64_t seed, int64_t batch_size = 64);

}  // namespace nebula::model
