#include "model/seq2seq.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/modules/container/modulelist.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "nebula/error.h"

namespace nebula::model {
namespace {

// GNMT (Wu et al. 2016): lp(n) = ((5 + n) / 6)^α.
double length_penalty(int64_t n, double alpha) { return std::pow((5.0 + static_cast<double>(n)) / 6.0, alpha); }

// Checks that `ours` and `theirs` hold the same names with the same shapes; `what` is
// "parameter" or "buffer".
void check_same_layout(const torch::OrderedDict<std::string, at::Tensor>& ours,
                       const torch::OrderedDict<std::string, at::Tensor>& theirs, const char* what) {
  const char* hint =
      "the encoder's [model] dims (dim, layers, heads, ffn, max_len) and the vocabulary must match the pre-trained "
      "model's, and the pre-trained encoder must not have PEFT applied";
  for (const auto& item : ours) {
    const at::Tensor* t = theirs.find(item.key());
    if (t == nullptr)
      throw ConfigError(str_cat("encoder ", what, " '", item.key(), "' of shape ", item.value().sizes(),
                                " is missing from the pre-trained encoder: ", hint));
    if (t->sizes() != item.value().sizes())
      throw ConfigError(str_cat("encoder ", what, " '", item.key(), "' has shape ", item.value().sizes(),
                                " here but ", t->sizes(), " in the pre-trained encoder: ", hint));
  }
  for (const auto& item : theirs)
    if (ours.find(item.key()) == nullptr)
      throw ConfigError(str_cat("pre-trained encoder ", what, " '", item.key(), "' of shape ", item.value().sizes(),
                                " has no counterpart in this encoder: ", hint));
}

}  // namespace

Seq2SeqImpl::Seq2SeqImpl(const ModelConfig& c, int64_t decoder_layers, int64_t vocab_size, SpecialIds ids)
    : config_(c), ids_(ids), vocab_size_(vocab_size) {
  NEBULA_CHECK(decoder_layers >= 1, "decoder_layers ", decoder_layers);
  NEBULA_CHECK(ids.vocab_size == 0 || ids.vocab_size == vocab_size, "SpecialIds.vocab_size ", ids.vocab_size,
               " but vocab_size ", vocab_size);
  NEBULA_CHECK(vocab_size >= 2 && ids.bos >= 0 && ids.bos < vocab_size && ids.eos >= 0 && ids.eos < vocab_size &&
                   ids.bos != ids.eos && ids.pad != ids.bos && ids.pad != ids.eos,
               "vocab ", vocab_size, " pad ", ids.pad, " bos ", ids.bos, " eos ", ids.eos);
  NEBULA_CHECK(c.max_len >= 2, "max_len ", c.max_len, ": a target needs BOS and EOS");
  ids_.vocab_size = vocab_size;
  encoder_ = register_module("encoder", MlmEncoder(c, vocab_size, ids.pad));  // checks pad, dims
  positions_ = register_module("decoder_positions", torch::nn::Embedding(c.max_len, c.dim));
  auto list = register_module("decoder", torch::nn::ModuleList());
  for (int64_t i = 0; i < decoder_layers; ++i) {
    layers_.push_back(DecoderLayer(c.dim, c.heads, c.ffn, c.dropout));
    list->push_back(layers_.back());
    layer_built(*layers_.back());
  }
  norm_ = register_module("decoder_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
  at::NoGradGuard no_grad;
  positions_->weight.normal_(0, 0.02);  // as the encoder's
  layer_built(*positions_);
  layer_built(*norm_);
}

std::vector<torch::nn::Module*> Seq2SeqImpl::units() const {
  std::vector<torch::nn::Module*> out = encoder_->units();
  out.push_back(positions_.ptr().get());
  for (const DecoderLayer& layer : layers_) out.push_back(layer.ptr().get());
  out.push_back(norm_.ptr().get());
  return out;
}

at::Tensor Seq2SeqImpl::encode(const at::Tensor& src) { return encoder_->encode(src); }

at::Tensor Seq2SeqImpl::decode(const at::Tensor& memory, const at::Tensor& src, const at::Tensor& tgt_in) {
  NEBULA_CHECK(!tensor_, "Seq2Seq::decode gives the whole vocabulary's logits: not while split for tensor "
                         "parallelism (run it with the slices gathered: parallel::TensorSplit::with_whole)");
  return project(decode_hidden(memory, src, tgt_in));
}

std::vector<TensorSlice> Seq2SeqImpl::split_for_tensor(TensorGroup& group) {
  NEBULA_CHECK(!gather_ && !tensor_, "split_for_tensor on a Seq2Seq ", gather_ ? "under ZeRO-3" : "split already");
  std::vector<TensorSlice> out = encoder_->split_for_tensor(group);
  for (DecoderLayer& layer : layers_) layer->split_for_tensor(group, out);
  tensor_ = &group;
  return out;
}

void Seq2SeqImpl::set_tensor_group(TensorGroup* group) {
  tensor_ = group;
  encoder_->set_tensor_group(group);
  for (DecoderLayer& layer : layers_) layer->set_tensor_group(group);
}

at::Tensor Seq2SeqImpl::project(const at::Tensor& hidden) { return encoder_->project(hidden); }

at::Tensor Seq2SeqImpl::decode_hidden(const at::Tensor& memory, const at::Tensor& src, const at::Tensor& tgt_in) {
  NEBULA_CHECK(src.dim() == 2 && memory.dim() == 3 && memory.size(0) == src.size(0) &&
                   memory.size(1) == src.size(1) && tgt_in.dim() == 2 && tgt_in.size(0) == src.size(0) &&
                   tgt_in.size(1) >= 1 && tgt_in.size(1) <= config_.max_len,
               "decode with memory ", memory.sizes(), ", src ", src.sizes(), ", tgt_in ", tgt_in.sizes(),
               ", max_len ", config_.max_len);
  at::Tensor pos = at::arange(tgt_in.size(1), tgt_in.options());
  const torch::nn::Embedding positions = positions_;
  at::Tensor h = encoder_->embed_tokens(tgt_in) +  // tied: the encoder's token embedding
                 run_layer(gather_, *positions_, {}, [positions, pos](const std::vector<at::Tensor>&) {
                   return torch::nn::Embedding(positions)(pos).unsqueeze(0);
                 });
  const at::Tensor tgt_pad = tgt_in.eq(ids_.pad), src_pad = src.eq(ids_.pad);
  for (const DecoderLayer& layer : layers_)
    h = run_layer(gather_, *layer.ptr(), {h, memory}, [layer, tgt_pad, src_pad](const std::vector<at::Tensor>& in) {
      return DecoderLayer(layer)(in[0], in[1], tgt_pad, src_pad);
    });
  const torch::nn::LayerNorm norm = norm_;
  return run_layer(gather_, *norm_, {h}, [norm](const std::vector<at::Tensor>& in) {
    return torch::nn::LayerNorm(norm)(in[0]);
  });
}

at::Tensor Seq2SeqImpl::forward(const at::Tensor& src, const at::Tensor& tgt_in) {
  return decode(encode(src), src, tgt_in);
}

at::Tensor Seq2SeqImpl::target_logits(const at::Tensor& src, const at::Tensor& tgt_in, const at::Tensor& tgt_out) {
  NEBULA_CHECK(tgt_out.sizes() == tgt_in.sizes(), "tgt_out ", tgt_out.sizes(), " for tgt_in ", tgt_in.sizes());
  const at::Tensor h = decode_hidden(encode(src), src, tgt_in);
  const at::Tensor rows = tgt_out.reshape({-1}).ne(kIgnoreIndex).nonzero().squeeze(1);
  return project(h.reshape({-1, h.size(-1)}).index_select(0, rows));
}

at::Tensor Seq2SeqImpl::loss(const at::Tensor& src, const at::Tensor& tgt_in, const at::Tensor& tgt_out,
                             double label_smoothing) {
  NEBULA_CHECK(label_smoothing >= 0 && label_smoothing < 1, "label_smoothing ", label_smoothing);
  const at::Tensor logits = target_logits(src, tgt_in, tgt_out);
  const at::Tensor flat = tgt_out.reshape({-1});
  if (tensor_)
    return vocab_parallel_cross_entropy(logits, flat.index_select(0, flat.ne(kIgnoreIndex).nonzero().squeeze(1)),
                                        encoder_->vocab_rows().begin, *tensor_, label_smoothing, vocab_size_);
  return at::cross_entropy_loss(logits, flat.index_select(0, flat.ne(kIgnoreIndex).nonzero().squeeze(1)),
                                /*weight=*/{}, at::Reduction::Mean, kIgnoreIndex, label_smoothing);
}

void Seq2SeqImpl::init_encoder_from(MlmEncoderImpl& pretrained) {
  const auto our_params = encoder_->named_parameters(), their_params = pretrained.named_parameters();
  const auto our_buffers = encoder_->named_buffers(), their_buffers = pretrained.named_buffers();
  check_same_layout(our_params, their_params, "parameter");  // everything checked before any write
  check_same_layout(our_buffers, their_buffers, "buffer");
  at::NoGradGuard no_grad;
  for (const auto& item : our_params) item.value().copy_(*their_params.find(item.key()));
  for (const auto& item : our_buffers) item.value().copy_(*their_buffers.find(item.key()));
}

void Seq2SeqImpl::check_decode_args(const at::Tensor& src, int64_t max_len) const {
  NEBULA_CHECK(src.dim() == 2 && src.size(0) >= 1 && src.size(1) >= 1, "src of shape ", src.sizes());
  NEBULA_CHECK(max_len >= 1 && max_len <= config_.max_len - 1, "max_len ", max_len,
               " generated tokens: must be in [1, ", config_.max_len - 1, "] (the model's max_len − 1)");
}

std::vector<std::vector<int>> Seq2SeqImpl::greedy(const at::Tensor& src, int64_t max_len) {
  check_decode_args(src, max_len);
  at::NoGradGuard no_grad;
  EvalModeGuard eval_mode(*this);
  const int64_t batch = src.size(0);
  const at::Tensor memory = encode(src);
  at::Tensor ys = at::full({batch, 1}, ids_.bos, src.options().dtype(at::kLong));
  std::vector<std::vector<int>> out(batch);
  std::vector<bool> done(batch, false);
  int64_t live = batch;
  for (int64_t step = 0; step < max_len && live > 0; ++step) {
    at::Tensor next = project(decode_hidden(memory, src, ys).select(1, -1)).argmax(-1).to(at::kCPU);  // [batch]
    auto tok = next.accessor<int64_t, 1>();
    for (int64_t i = 0; i < batch; ++i) {
      if (done[i]) {
        tok[i] = ids_.pad;  // finished rows only carry padding along
      } else if (tok[i] == ids_.eos) {
        done[i] = true;
        --live;
      } else {
        out[i].push_back(static_cast<int>(tok[i]));
      }
    }
    ys = at::cat({ys, next.to(ys.device()).unsqueeze(1)}, 1);
  }
  return out;
}

std::vector<std::vector<Seq2SeqImpl::Hypothesis>> Seq2SeqImpl::beam_search_nbest(const at::Tensor& src, int64_t beam,
                                                                             int64_t max_len, double alpha) {
  check_decode_args(src, max_len);
  NEBULA_CHECK(beam >= 1 && alpha >= 0, "beam ", beam, ", length_penalty ", alpha);
  at::NoGradGuard no_grad;
  EvalModeGuard eval_mode(*this);
  const int64_t batch = src.size(0), k = beam, vocab = vocab_size_, rows = batch * k;
  constexpr double kDead = -std::numeric_limits<double>::infinity();  // an empty beam slot

  // Row r·k + j holds hypothesis j of sentence r.
  const at::Tensor src_rep = src.repeat_interleave(k, 0), memory = encode(src).repeat_interleave(k, 0);
  at::Tensor seqs = at::full({rows, 1}, ids_.bos, src.options().dtype(at::kLong));
  std::vector<std::vector<int>> tokens(rows);  // seqs without BOS
  std::vector<double> scores(rows, kDead);     // summed log-probabilities
  for (int64_t r = 0; r < batch; ++r) scores[r * k] = 0;  // one live hypothesis to start from

  std::vector<std::vector<Hypothesis>> finished(batch);
  std::vector<bool> done(batch, false);
  const int64_t candidates = std::min(2 * k, k * vocab);

  for (int64_t step = 0; step < max_len; ++step) {
    const bool last = step == max_len - 1;
    // Double precision: no two distinct logits become equal, so beam 1 picks greedy's argmax.
    at::Tensor logp =
        project(decode_hidden(memory, src_rep, seqs).select(1, -1)).to(at::kCPU, at::kDouble).log_softmax(-1);
    at::Tensor total = (logp + at::tensor(scores, logp.options()).unsqueeze(1)).view({batch, k * vocab});
    auto [top_values, top_indices] = total.topk(candidates, -1);  // sorted, best first
    auto value = top_values.accessor<double, 2>();
    auto index = top_indices.accessor<int64_t, 2>();

    std::vector<int64_t> from(rows), next(rows, ids_.pad);
    std::vector<std::vector<int>> new_tokens(rows);
    std::vector<double> new_scores(rows, kDead);
    for (int64_t r = 0; r < batch; ++r) {
      int64_t live = 0;
      for (int64_t c = 0; c < candidates && !done[r]; ++c) {
        if (value[r][c] == kDead) break;  // sorted: only dead slots' extensions follow
        const int64_t row = r * k + index[r][c] / vocab, tok = index[r][c] % vocab;
        if (tok == ids_.eos || last) {
          // Only the first k candidates may finish (an EOS further down is dropped, as in fairseq).
          if (c < k) {
            Hypothesis& h = finished[r].emplace_back();
            h.tokens = tokens[row];
            h.eos = tok == ids_.eos;
            if (!h.eos) h.tokens.push_back(static_cast<int>(tok));
            h.score = value[r][c] / length_penalty(step + 1, alpha);
          }
        } else if (live < k) {
          const int64_t slot = r * k + live++;
          from[slot] = row;
          next[slot] = tok;
          new_scores[slot] = value[r][c];
          new_tokens[slot] = tokens[row];
          new_tokens[slot].push_back(static_cast<int>(tok));
        }
        if (c + 1 >= k && live == k) break;
      }
      for (int64_t slot = r * k + live; slot < (r + 1) * k; ++slot) from[slot] = r * k;  // dead slots
      if (static_cast<int64_t>(finished[r].size()) >= k || live == 0) done[r] = true;
    }
    if (std::all_of(done.begin(), done.end(), [](bool d) { return d; })) break;
    const at::Tensor from_t = at::tensor(from, seqs.options()), next_t = at::tensor(next, seqs.options());
    seqs = at::cat({seqs.index_select(0, from_t), next_t.unsqueeze(1)}, 1);
    tokens = std::move(new_tokens);
    scores = std::move(new_scores);
  }

  for (auto& row : finished)
    std::stable_sort(row.begin(), row.end(),
                     [](const Hypothesis& a, const Hypothesis& b) { return a.score > b.score; });
  return finished;
}

std::vector<std::vector<int>> Seq2SeqImpl::beam_search(const at::Tensor& src, int64_t beam, int64_t max_len,
                                                       double length_penalty) {
  std::vector<std::vector<int>> out;
  for (auto& row : beam_search_nbest(src, beam, max_len, length_penalty)) {
    NEBULA_CHECK(!row.empty(), "beam search finished no hypothesis");  // cannot happen: step max_len finishes some
    out.push_back(std::move(row.front().tokens));
  }
  return out;
}

}  // namespace nebula::model
