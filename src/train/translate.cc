#include "train/translate.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>

#include "model/safetensors.h"
#include "nebula/error.h"
#include "train/site_data.h"

namespace nebula::train {

model::SpecialIds special_ids(const data::Tokenizer& tok) {
  return {tok.pad_id(), tok.unk_id(), tok.bos_id(), tok.eos_id(), tok.mask_id(), 5, tok.vocab_size()};
}

ModelConfig model_config_from(const std::map<std::string, std::string>& meta, const ModelConfig& base,
                              const std::string& path) {
  ModelConfig c = base;
  auto read = [&](const char* key, int64_t& out) {
    auto it = meta.find(key);
    if (it == meta.end()) return;
    try {
      size_t used = 0;
      const long long v = std::stoll(it->second, &used);
      if (used == it->second.size() && v > 0) {
        out = v;
        return;
      }
    } catch (const std::exception&) {
    }
    throw DataError(str_cat(path, ": metadata '", key, "' = \"", it->second, "\" is not a positive integer"));
  };
  read("dim", c.dim);
  read("layers", c.layers);
  read("heads", c.heads);
  read("ffn", c.ffn);
  read("max_len", c.max_len);
  read("decoder_layers", c.decoder_layers);
  if (c.dim % c.heads != 0)
    throw DataError(str_cat(path, ": metadata dim ", c.dim, " is not divisible by heads ", c.heads));
  return c;
}

LoadedTranslator load_translator(const std::string& path, const data::Tokenizer& tok) {
  return load_translator(model::load_safetensors(path), path, tok);
}

LoadedTranslator load_translator(const model::TensorFile& file, const std::string& path, const data::Tokenizer& tok) {
  LoadedTranslator out;
  out.metadata = file.metadata;
  auto kind = out.metadata.find("kind");
  if (kind == out.metadata.end() || kind->second != "seq2seq")
    throw DataError(str_cat(path, ": not a translation model (metadata kind = \"",
                            kind == out.metadata.end() ? "" : kind->second,
                            "\"; a seq2seq job writes RUN_DIR/model.safetensors)"));
  if (auto v = out.metadata.find("vocab"); v != out.metadata.end() && v->second != std::to_string(tok.vocab_size()))
    throw DataError(str_cat(path, ": trained with a ", v->second, "-piece vocabulary, but ", tok.model_path(), " has ",
                            tok.vocab_size(), ": use the tokenizer the model was trained with (metadata 'tokenizer')"));
  out.config = model_config_from(out.metadata, ModelConfig{}, path);
  out.model = model::Seq2Seq(out.config, out.config.decoder_layers, tok.vocab_size(), special_ids(tok));
  model::load_module(*out.model, file, path);
  out.model->eval();
  return out;
}

std::vector<std::string> translate(model::Seq2SeqImpl& model, const data::Tokenizer& tok,
                                   const std::vector<std::string>& sentences, int64_t beam, double length_penalty,
                                   int64_t batch_size) {
  NEBULA_CHECK(batch_size >= 1, "translation batch ", batch_size);
  const auto encoded = encode_all(tok, sentences, model.max_len());
  // Batches of sentences of similar length: a batch decodes until its longest hypothesis ends,
  // so mixing a long sentence into short ones would keep them all going (and padding them).
  std::vector<size_t> order(encoded.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return encoded[a].size() < encoded[b].size(); });
  std::vector<std::vector<int>> src;
  src.reserve(order.size());
  for (size_t i : order) src.push_back(encoded[i]);
  std::vector<std::string> out(sentences.size());
  for (size_t b = 0; b < src.size(); b += static_cast<size_t>(batch_size)) {
    at::Tensor ids = model::pad_sequences(src, tok.pad_id(), b, b + static_cast<size_t>(batch_size));
    size_t i = b;
    for (const auto& hyp : model.beam_search(ids, beam, model.max_len() - 1, length_penalty)) out[order[i++]] = tok.decode(hyp);
  }
  return out;
}

}  // namespace nebula::train
