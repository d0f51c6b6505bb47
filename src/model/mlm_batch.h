// Masked-language-model batches from tokenized sentences. Masking follows BERT: each
// ordinary token is chosen with probability mask_prob (at least one per sentence); a chosen
// token becomes <mask> 80% of the time, a random ordinary token 10%, stays itself 10%.
// Uses its own std::mt19937_64, so a (seed, data) pair gives the same batches on every machine.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <random>
#include <vector>

namespace nebula::model {

struct SpecialIds {
  int64_t pad = 0, unk = 1, bos = 2, eos = 3, mask = 4;
  int64_t first_ordinary = 5;  // ids below this are never chosen as random replacements
  int64_t vocab_size = 0;
};

struct MlmBatch {
  at::Tensor ids;        // [batch, seq] int64, padded with pad
  at::Tensor labels;     // [batch, seq] int64, kIgnoreIndex where no loss
  int64_t predicted = 0; // positions with a label: the weight of this batch in a global mean
  int64_t tokens = 0;    // non-pad tokens
};

class MlmBatcher {
 public:
  // `sequences` already start with BOS and end with EOS and are at most max_len long.
  MlmBatcher(std::vector<std::vector<int>> sequences, SpecialIds ids, double mask_prob, int64_t batch_size,
             uint64_t seed);

  // The next batch_size sequences of a shuffled pass; reshuffles at each new pass.
  MlmBatch next();
  // Masks exactly these sequences (for tests and fixed evaluation sets).
  MlmBatch make(const std::vector<const std::vector<int>*>& batch);

  size_t size() const { return sequences_.size(); }

 private:
  std::vector<std::vector<int>> sequences_;
  SpecialIds ids_;
  double mask_prob_;
  int64_t batch_size_;
  std::mt19937_64 rng_;
  std::vector<size_t> order_;
  size_t cursor_ = 0;
};

}  // namespace nebula::model
