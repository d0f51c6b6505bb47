// Translation models as files and as a service: loading a seq2seq model.safetensors by the
// shape its metadata records, and translating sentences with it (what the BLEU evaluation,
// the distillation teacher and `nebula translate` share).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "model/safetensors.h"
#include "model/seq2seq.h"
#include "nebula/config.h"

namespace nebula::train {

// The special ids of a tokenizer trained by nebula (pad, unk, bos, eos, <mask>).
model::SpecialIds special_ids(const data::Tokenizer& tok);

// The [model] shape a model file's metadata records (dim, layers, heads, ffn, max_len,
// decoder_layers); keys it lacks keep `base`'s values. DataError naming the file and key for a
// value that is not a positive integer.
ModelConfig model_config_from(const std::map<std::string, std::string>& metadata, const ModelConfig& base,
                              const std::string& path);

struct LoadedTranslator {
  model::Seq2Seq model{nullptr};
  ModelConfig config;
  std::map<std::string, std::string> metadata;
};
// Loads a seq2seq model.safetensors written by nebula. DataError naming the file if it is not a
// seq2seq model or its vocabulary differs from `tok`'s.
LoadedTranslator load_translator(const std::string& path, const data::Tokenizer& tok);
// The same from a file already read (e.g. for the tokenizer path in its metadata).
LoadedTranslator load_translator(const model::TensorFile& file, const std::string& path, const data::Tokenizer& tok);

// Translates each sentence (beam search with length_penalty α, see Seq2SeqImpl; beam 1 =
// greedy), batched by length, in the input's order. Sentences longer than the model's max_len
// are cut, as in training.
std::vector<std::string> translate(model::Seq2SeqImpl& model, const data::Tokenizer& tok,
                                   const std::vector<std::string>& sentences, int64_t beam,
                                   double length_penalty = 0.6, int64_t batch_size = 32);

}  // namespace nebula::train
