#include "model/mlm_batch.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>
#include <sstream>

#include "model/mlm_encoder.h"
#include "nebula/error.h"

namespace nebula::model {

at::Tensor pad_sequences(const std::vector<std::vector<int>>& sequences, int64_t pad, size_t begin, size_t end) {
  end = std::min(end, sequences.size());
  NEBULA_CHECK(begin <= end, "rows [", begin, ", ", end, ") of ", sequences.size());
  size_t len = 1;
  for (size_t i = begin; i < end; ++i) len = std::max(len, sequences[i].size());
  at::Tensor ids = at::full({static_cast<int64_t>(end - begin), static_cast<int64_t>(len)}, pad, at::kLong);
  auto a = ids.accessor<int64_t, 2>();
  for (size_t i = begin; i < end; ++i)
    for (size_t j = 0; j < sequences[i].size(); ++j) a[static_cast<int64_t>(i - begin)][static_cast<int64_t>(j)] = sequences[i][j];
  return ids;
}

MlmBatcher::MlmBatcher(std::vector<std::vector<int>> sequences, SpecialIds ids, double mask_prob,
                       int64_t batch_size, uint64_t seed)
    : sequences_(std::move(sequences)),
      ids_(ids),
      mask_prob_(mask_prob),
      batch_size_(batch_size),
      passes_(sequences_.size(), seed) {
  NEBULA_CHECK(!sequences_.empty(), "no sequences to make batches from");
  NEBULA_CHECK(batch_size_ > 0 && ids_.vocab_size > ids_.first_ordinary, "batch ", batch_size_, " vocab ",
               ids_.vocab_size);
}

ShuffledPasses::ShuffledPasses(size_t n, uint64_t seed) : rng(seed), order(n) {
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
}

size_t ShuffledPasses::next() {
  if (cursor == order.size()) {
    std::shuffle(order.begin(), order.end(), rng);
    cursor = 0;
  }
  return order[cursor++];
}

BatcherState ShuffledPasses::state() const {
  std::ostringstream text;
  text << rng;
  return {text.str(), std::vector<int64_t>(order.begin(), order.end()), static_cast<int64_t>(cursor)};
}

void ShuffledPasses::restore(const BatcherState& s) {
  if (s.order.size() != order.size() || s.cursor < 0 || static_cast<size_t>(s.cursor) > order.size())
    throw DataError(str_cat("the saved data position is a pass over ", s.order.size(), " examples (cursor ", s.cursor,
                            "); this worker has ", order.size(), ": the data changed since the checkpoint"));
  std::vector<bool> seen(order.size(), false);
  for (int64_t i : s.order) {
    if (i < 0 || static_cast<size_t>(i) >= order.size() || seen[static_cast<size_t>(i)])
      throw DataError(str_cat("the saved data order is not a permutation (example ", i, ")"));
    seen[static_cast<size_t>(i)] = true;
  }
  std::istringstream text(s.rng);
  std::mt19937_64 r;
  if (!(text >> r)) throw DataError("the saved random generator state is unreadable");
  rng = r;
  order.assign(s.order.begin(), s.order.end());
  cursor = static_cast<size_t>(s.cursor);
}

PairBatcher::PairBatcher(std::vector<std::vector<int>> en, std::vector<std::vector<int>> other, int64_t pad,
                         int64_t batch_size, uint64_t seed)
    : en_(std::move(en)), other_(std::move(other)), pad_(pad), batch_size_(batch_size), passes_(en_.size(), seed) {
  NEBULA_CHECK(!en_.empty() && en_.size() == other_.size(), "pair batches need aligned pairs: ", en_.size(),
               " English and ", other_.size(), " other sentences");
  NEBULA_CHECK(batch_size_ > 0, "pair batch size ", batch_size_);
}

PairBatch PairBatcher::next() {
  std::vector<std::vector<int>> en, other;
  for (int64_t i = 0; i < batch_size_; ++i) {
    const size_t k = passes_.next();
    en.push_back(en_[k]);
    other.push_back(other_[k]);
  }
  return {pad_sequences(en, pad_), pad_sequences(other, pad_)};
}

MlmBatch MlmBatcher::next() {
  std::vector<const std::vector<int>*> batch;
  for (int64_t i = 0; i < batch_size_; ++i) batch.push_back(&sequences_[passes_.next()]);
  return make(batch);
}

MlmBatch MlmBatcher::make(const std::vector<const std::vector<int>*>& batch) {
  size_t seq = 0;
  for (const auto* s : batch) seq = std::max(seq, s->size());
  const int64_t b = static_cast<int64_t>(batch.size()), t = static_cast<int64_t>(seq);
  at::Tensor ids = at::full({b, t}, ids_.pad, at::kLong);
  at::Tensor labels = at::full({b, t}, kIgnoreIndex, at::kLong);
  auto id = ids.accessor<int64_t, 2>();
  auto label = labels.accessor<int64_t, 2>();
  std::uniform_real_distribution<double> u(0, 1);
  std::uniform_int_distribution<int64_t> random_token(ids_.first_ordinary, ids_.vocab_size - 1);
  MlmBatch out;
  for (int64_t i = 0; i < b; ++i) {
    const auto& s = *batch[i];
    std::vector<int64_t> candidates;
    for (size_t j = 0; j < s.size(); ++j) {
      id[i][j] = s[j];
      if (s[j] >= ids_.first_ordinary || s[j] == ids_.unk) candidates.push_back(static_cast<int64_t>(j));
    }
    out.tokens += static_cast<int64_t>(s.size());
    std::vector<int64_t> chosen;
    for (int64_t j : candidates)
      if (u(passes_.rng) < mask_prob_) chosen.push_back(j);
    if (chosen.empty() && !candidates.empty())
      chosen.push_back(candidates[std::uniform_int_distribution<size_t>(0, candidates.size() - 1)(passes_.rng)]);
    for (int64_t j : chosen) {
      label[i][j] = s[j];
      double r = u(passes_.rng);
      if (r < 0.8) id[i][j] = ids_.mask;
      else if (r < 0.9) id[i][j] = random_token(passes_.rng);
      ++out.predicted;
    }
  }
  out.ids = ids;
  out.labels = labels;
  return out;
}

}  // namespace nebula::model
