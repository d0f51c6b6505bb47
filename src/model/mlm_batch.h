// Masked-language-model batches from tokenized sentences. Masking follows BERT: each
// ordinary token is chosen with probability mask_prob (at least one per sentence); a chosen
// token becomes <mask> 80% of the time, a random ordinary token 10%, stays itself 10%.
// Uses its own std::mt19937_64, so a (seed, data) pair gives the same batches on every machine.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace nebula::model {

struct SpecialIds {
  int64_t pad = 0, unk = 1, bos = 2, eos = 3, mask = 4;
  int64_t first_ordinary = 5;  // ids below this are never chosen as random replacements
  int64_t vocab_size = 0;
};

// Rows [begin, end) of `sequences` as one [end - begin, longest] int64 tensor padded with
// `pad` (end = npos: to the last row). At least one column, so that empty rows stay valid ids.
at::Tensor pad_sequences(const std::vector<std::vector<int>>& sequences, int64_t pad, size_t begin = 0,
                         size_t end = static_cast<size_t>(-1));

// Eval mode for the guard's lifetime, then the mode the module had before (also on exceptions).
class EvalModeGuard {
 public:
  explicit EvalModeGuard(torch::nn::Module& m) : module_(m), was_training_(m.is_training()) { module_.eval(); }
  ~EvalModeGuard() { module_.train(was_training_); }
  EvalModeGuard(const EvalModeGuard&) = delete;
  EvalModeGuard& operator=(const EvalModeGuard&) = delete;

 private:
  torch::nn::Module& module_;
  bool was_training_;
};

// Where a batcher is in its data, enough to continue exactly where it was (checkpoints).
struct BatcherState {
  std::string rng;               // the generator (std::mt19937_64's text form)
  std::vector<int64_t> order;    // this pass's order of the examples
  int64_t cursor = 0;            // the next position in `order`
};

// The shuffled passes both batchers make over their examples, and their state.
struct ShuffledPasses {
  ShuffledPasses(size_t n, uint64_t seed);
  size_t next();  // the next example's index; reshuffles at the end of a pass
  BatcherState state() const;
  // DataError if `s` does not describe a pass over the same number of examples.
  void restore(const BatcherState& s);

  std::mt19937_64 rng;
  std::vector<size_t> order;
  size_t cursor = 0;
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
  // The position in the data and the masking generator (one generator: it shuffles and masks).
  BatcherState state() const { return passes_.state(); }
  void restore(const BatcherState& s) { passes_.restore(s); }

 private:
  std::vector<std::vector<int>> sequences_;
  SpecialIds ids_;
  double mask_prob_;
  int64_t batch_size_;
  ShuffledPasses passes_;
};

// Batches of parallel sentences for the contrastive objective (model/xlingual.h): the next
// batch_size pairs of a shuffled pass, each side padded on its own. It has its own generator,
// so turning the objective on leaves the MLM batches as they were.
struct PairBatch {
  at::Tensor en;     // [batch, longest English] int64, padded
  at::Tensor other;  // [batch, longest translation]
};

class PairBatcher {
 public:
  // en[i] and other[i] are translations (BOS ... EOS each, at most max_len). Error if empty
  // or of different lengths.
  PairBatcher(std::vector<std::vector<int>> en, std::vector<std::vector<int>> other, int64_t pad, int64_t batch_size,
              uint64_t seed);
  PairBatch next();
  size_t size() const { return en_.size(); }
  BatcherState state() const { return passes_.state(); }
  void restore(const BatcherState& s) { passes_.restore(s); }

 private:
  std::vector<std::vector<int>> en_, other_;
  int64_t pad_, batch_size_;
  ShuffledPasses passes_;
};

}  // namespace nebula::model
