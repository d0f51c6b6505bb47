// Translation batches from tokenized (source, target) pairs, for model/seq2seq.h. Both sides
// arrive as BOS … EOS (as train/site_data.cc's encode_all makes them). Teacher forcing: the
// decoder reads the target without its last token and predicts it without its first,
//   tgt     = BOS y1 … yn EOS
//   tgt_in  = BOS y1 … yn        (padded with pad)
//   tgt_out =     y1 … yn EOS    (padded with kIgnoreIndex: no loss there)
// so tgt_out[t] is the token after tgt_in[:, ≤ t]. Seq2SeqBatcher uses its own std::mt19937_64,
// so a (seed, data) pair gives the same batches on every machine. Not thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "model/mlm_batch.h"  // SpecialIds

namespace nebula::model {

struct Seq2SeqBatch {
  at::Tensor src;             // [batch, S] int64, padded with pad
  at::Tensor tgt_in;          // [batch, T] int64, padded with pad; T = longest target − 1
  at::Tensor tgt_out;         // [batch, T] int64, padded with kIgnoreIndex
  int64_t target_tokens = 0;  // labels (positions ≠ kIgnoreIndex): the batch's weight in a global mean
};

// One batch of exactly these pairs, in this order. src[i] and tgt[i] are one pair; every
// sequence starts with ids.bos and ends with ids.eos (checked), targets have ≥ 2 tokens.
Seq2SeqBatch make_seq2seq_batch(const std::vector<const std::vector<int>*>& src,
                                const std::vector<const std::vector<int>*>& tgt, const SpecialIds& ids);

class Seq2SeqBatcher {
 public:
  using Pair = std::pair<std::vector<int>, std::vector<int>>;  // (source ids, target ids)

  // `pairs` as make_seq2seq_batch expects them; not empty; batch_size ≥ 1.
  Seq2SeqBatcher(std::vector<Pair> pairs, SpecialIds ids, int64_t batch_size, uint64_t seed);

  // The next batch_size pairs of a shuffled pass; reshuffles at each new pass.
  Seq2SeqBatch next();
  // The pairs next() would batch (and moves past them).
  std::vector<size_t> next_indices();
  // The batch of exactly these pairs (indices into the constructor's vector).
  Seq2SeqBatch make(const std::vector<size_t>& indices) const;

  size_t size() const { return pairs_.size(); }
  const Pair& pair(size_t i) const { return pairs_.at(i); }
  BatcherState state() const { return passes_.state(); }
  void restore(const BatcherState& s) { passes_.restore(s); }

 private:
  std::vector<Pair> pairs_;
  SpecialIds ids_;
  int64_t batch_size_;
  ShuffledPasses passes_;
};

}  // namespace nebula::model
