// An encoder-decoder Transformer for machine translation (Vaswani et al. 2017, post-LN):
//
//   memory = encoder(src)                                        an MlmEncoder (model/mlm_encoder.h)
//   h      = E[tgt_in]·√dim + P_dec[t]                           E: the encoder's token embedding
//   h      = LayerNorm(DecoderLayer_L(… DecoderLayer_1(h, memory) …))      (model/transformer.h)
//   logits = h · Eᵀ                                              [batch, T, vocab]
//
// The encoder is an MlmEncoder, registered as submodule "encoder", so a pre-trained MLM encoder
// drops in (init_encoder_from). The vocabulary is one shared SentencePiece model for all
// languages, so the token embedding E is tied three ways: encoder input, decoder input and
// output projection. The decoder has its own learned positions P_dec (max_len of them) and its
// own final LayerNorm. Parameter names: "encoder.*" (exactly MlmEncoder's), "decoder_positions.
// weight", "decoder.<i>.*" (DecoderLayer's), "decoder_norm.*".
//
// Decoding (greedy, beam_search) runs without gradients and in eval mode (dropout off), then
// restores the module's previous train/eval mode. It recomputes the decoder over the whole
// prefix at each step (no key/value cache: sequences are ≤ max_len, a few dozen tokens).
// Hypotheses are scored by GNMT's length-normalised log-probability
//   score(y) = Σ_t log p(y_t | y_<t, src) / lp(|y|),   lp(n) = ((5 + n) / 6)^α
// where y is the generated tokens including the final EOS (if it was reached) and α the
// length_penalty (0 = plain sum of log-probabilities).
//
// Not thread-safe (like any torch::nn::Module): one thread at a time, decoding included.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <vector>

#include "model/mlm_batch.h"  // SpecialIds
#include "model/mlm_encoder.h"
#include "model/tensor_parallel.h"
#include "model/transformer.h"
#include "nebula/config.h"

namespace nebula::model {

class Seq2SeqImpl : public torch::nn::Module {
 public:
  // config: dim, heads, ffn, max_len, dropout for both halves; config.layers encoder layers.
  // decoder_layers ≥ 1. ids.pad, ids.bos and ids.eos are used; ids.vocab_size must be 0 or
  // vocab_size.
  Seq2SeqImpl(const ModelConfig& config, int64_t decoder_layers, int64_t vocab_size, SpecialIds ids);

  // src: [batch, S] int64 padded with ids.pad, S ≤ max_len. Returns memory [batch, S, dim].
  at::Tensor encode(const at::Tensor& src);
  // memory: encode(src); src gives the memory's padding. tgt_in: [batch, T] int64 padded with
  // ids.pad, T ≤ max_len. Returns logits [batch, T, vocab]; position t sees tgt_in[:, ≤ t] only.
  at::Tensor decode(const at::Tensor& memory, const at::Tensor& src, const at::Tensor& tgt_in);
  // decode() before the output projection: the final decoder states [batch, T, dim].
  at::Tensor decode_hidden(const at::Tensor& memory, const at::Tensor& src, const at::Tensor& tgt_in);
  // The output projection (tied to the token embedding): [..., dim] → [..., vocab].
  at::Tensor project(const at::Tensor& hidden);
  // decode(encode(src), src, tgt_in).
  at::Tensor forward(const at::Tensor& src, const at::Tensor& tgt_in);
  // forward()'s logits at the target positions only (tgt_out != kIgnoreIndex; padding skipped):
  // [N, vocab], sequence by sequence, position by position. With a large vocabulary most of a
  // step's work is this projection, so padded positions are not projected at all.
  at::Tensor target_logits(const at::Tensor& src, const at::Tensor& tgt_in, const at::Tensor& tgt_out);
  // Mean cross-entropy of forward(src, tgt_in) over positions whose tgt_out != kIgnoreIndex
  // (make_seq2seq_batch's tensors), computed from target_logits. label_smoothing in [0, 1):
  // torch's definition.
  at::Tensor loss(const at::Tensor& src, const at::Tensor& tgt_in, const at::Tensor& tgt_out,
                  double label_smoothing = 0);

  // Copies every parameter and buffer of `pretrained` into the encoder, by name, without
  // gradient tracking. All checked before anything is written: a name missing on either side
  // or a shape that differs throws ConfigError naming the parameter and both shapes (the
  // encoder's [model] dims and the vocabulary must match the pre-trained model's; a model with
  // PEFT applied has other names). Parameters stay separate tensors: nothing is shared.
  void init_encoder_from(MlmEncoderImpl& pretrained);

  // Greedy decoding of each row of src ([batch, S], as for encode): the argmax token at each
  // step, until EOS or max_len generated tokens (EOS included). 1 ≤ max_len ≤ config max_len − 1
  // (training targets BOS y EOS fit in max_len, so y EOS has at most max_len − 1 tokens).
  // Returns one token list per row, without BOS and EOS.
  std::vector<std::vector<int>> greedy(const at::Tensor& src, int64_t max_len);
  // One finished hypothesis of beam_search_nbest.
  struct Hypothesis {
    std::vector<int> tokens;  // generated tokens, without BOS and EOS
    double score = 0;         // Σ log p / lp(n) (see the top of this file)
    bool eos = false;         // ended at EOS (else it stopped at max_len tokens; then n = max_len)
  };
  // Beam search with `beam` hypotheses per row (all rows at once): each step extends every live
  // hypothesis by every token and keeps the best 2·beam extensions by summed log-probability;
  // those among the first `beam` that end in EOS are finished (scored as above), the best
  // `beam` others live on. A row stops once it has `beam` finished hypotheses (fairseq's rule);
  // at max_len, the first `beam` extensions are finished whatever their last token. So α only
  // decides which finished hypothesis wins, never which are found. Returns every finished
  // hypothesis of each row, best score first (ties: the one finished first), at least one per
  // row. beam ≥ 1, length_penalty (α) ≥ 0, max_len as for greedy.
  std::vector<std::vector<Hypothesis>> beam_search_nbest(const at::Tensor& src, int64_t beam, int64_t max_len,
                                                         double length_penalty = 0.6);
  // The best hypothesis of beam_search_nbest for each row, without BOS and EOS. beam = 1 gives
  // exactly greedy()'s output.
  std::vector<std::vector<int>> beam_search(const at::Tensor& src, int64_t beam, int64_t max_len,
                                            double length_penalty = 0.6);

  MlmEncoder& encoder() { return encoder_; }
  const std::vector<DecoderLayer>& decoder_layers() const { return layers_; }
  // What ZeRO-3 cuts into units, in parameter order: the encoder's (MlmEncoder::units), the
  // decoder's position embedding, its layers and its final norm.
  std::vector<torch::nn::Module*> units() const;
  const SpecialIds& special_ids() const { return ids_; }
  int64_t vocab_size() const { return vocab_size_; }
  int64_t max_len() const { return config_.max_len; }

  // Tensor parallelism (model/tensor_parallel.h): the encoder's slices (MlmEncoder::
  // split_for_tensor: its layers and the vocabulary rows of the token embedding, tied three
  // ways) and every decoder layer's; the decoder's positions and norms stay whole. From then on
  // project() gives this worker's vocabulary rows' logits and loss() is vocabulary-parallel;
  // decode(), forward() and the decoders need the whole model (TensorSplit::with_whole).
  std::vector<TensorSlice> split_for_tensor(TensorGroup& group);
  void set_tensor_group(TensorGroup* group);

  // ZeRO-3 (model/layer_gather.h): the encoder's and the decoder's layers run through `gather`
  // (null: directly). Not owned; it must outlive its use.
  void set_layer_gather(LayerGather* gather) {
    gather_ = gather;
    encoder_->set_layer_gather(gather);
  }

 private:
  void check_decode_args(const at::Tensor& src, int64_t max_len) const;

  ModelConfig config_;
  LayerGather* gather_ = nullptr;
  TensorGroup* tensor_ = nullptr;  // not owned
  SpecialIds ids_;
  int64_t vocab_size_;
  MlmEncoder encoder_{nullptr};
  torch::nn::Embedding positions_{nullptr};  // the decoder's
  std::vector<DecoderLayer> layers_;         // registered as "decoder.<i>"
  torch::nn::LayerNorm norm_{nullptr};
};
TORCH_MODULE(Seq2Seq);

}  // namespace nebula::model
