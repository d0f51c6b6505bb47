#include "model/seq2seq_batch.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>

#include "model/mlm_encoder.h"  // kIgnoreIndex
#include "nebula/error.h"

namespace nebula::model {
namespace {

void check_sequence(const std::vector<int>* s, const SpecialIds& ids, const char* side, size_t i, size_t min_len) {
  NEBULA_CHECK(s != nullptr && s->size() >= min_len && s->front() == ids.bos && s->back() == ids.eos, side, " ", i,
               ": expected BOS … EOS (", ids.bos, " … ", ids.eos, ") of at least ", min_len, " tokens");
}

}  // namespace

Seq2SeqBatch make_seq2seq_batch(const std::vector<const std::vector<int>*>& src,
                                const std::vector<const std::vector<int>*>& tgt, const SpecialIds& ids) {
  NEBULA_CHECK(!src.empty() && src.size() == tgt.size(), src.size(), " sources and ", tgt.size(), " targets");
  size_t s_len = 0, t_len = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    check_sequence(src[i], ids, "source", i, 2);
    check_sequence(tgt[i], ids, "target", i, 2);
    s_len = std::max(s_len, src[i]->size());
    t_len = std::max(t_len, tgt[i]->size() - 1);
  }
  const int64_t b = static_cast<int64_t>(src.size());
  Seq2SeqBatch out;
  out.src = at::full({b, static_cast<int64_t>(s_len)}, ids.pad, at::kLong);
  out.tgt_in = at::full({b, static_cast<int64_t>(t_len)}, ids.pad, at::kLong);
  out.tgt_out = at::full({b, static_cast<int64_t>(t_len)}, kIgnoreIndex, at::kLong);
  auto s_acc = out.src.accessor<int64_t, 2>();
  auto in_acc = out.tgt_in.accessor<int64_t, 2>();
  auto out_acc = out.tgt_out.accessor<int64_t, 2>();
  for (int64_t i = 0; i < b; ++i) {
    const auto& s = *src[i];
    const auto& t = *tgt[i];
    for (size_t j = 0; j < s.size(); ++j) s_acc[i][j] = s[j];
    for (size_t j = 0; j + 1 < t.size(); ++j) {
      in_acc[i][j] = t[j];
      out_acc[i][j] = t[j + 1];
    }
    out.target_tokens += static_cast<int64_t>(t.size()) - 1;
  }
  return out;
}

Seq2SeqBatcher::Seq2SeqBatcher(std::vector<Pair> pairs, SpecialIds ids, int64_t batch_size, uint64_t seed)
    : pairs_(std::move(pairs)), ids_(ids), batch_size_(batch_size), passes_(pairs_.size(), seed) {
  NEBULA_CHECK(!pairs_.empty(), "no sentence pairs to make batches from");
  NEBULA_CHECK(batch_size_ > 0, "batch ", batch_size_);
  for (size_t i = 0; i < pairs_.size(); ++i) {  // fail here, not at some later batch
    check_sequence(&pairs_[i].first, ids_, "source", i, 2);
    check_sequence(&pairs_[i].second, ids_, "target", i, 2);
  }
}

std::vector<size_t> Seq2SeqBatcher::next_indices() {
  std::vector<size_t> batch;
  for (int64_t i = 0; i < batch_size_; ++i) batch.push_back(passes_.next());
  return batch;
}

Seq2SeqBatch Seq2SeqBatcher::next() { return make(next_indices()); }

Seq2SeqBatch Seq2SeqBatcher::make(const std::vector<size_t>& indices) const {
  std::vector<const std::vector<int>*> src, tgt;
  for (size_t i : indices) {
    NEBULA_CHECK(i < pairs_.size(), "pair ", i, " of ", pairs_.size());
    src.push_back(&pairs_[i].first);
    tgt.push_back(&pairs_[i].second);
  }
  return make_seq2seq_batch(src, tgt, ids_);
}

}  // namespace nebula::model
