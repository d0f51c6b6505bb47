// SentencePiece (unigram) tokenizer: training and encoding for the model layer.
//
// Special ids are fixed by train(): pad 0, unk 1, bos 2 (<s>), eos 3 (</s>), and the
// user-defined "<mask>" piece 4 (used by masked-LM pre-training). A model trained
// elsewhere may use other ids; the accessors report what the loaded model says.
//
// Thread safety: a Tokenizer is immutable after load(). Copies share one processor
// (a std::shared_ptr, so copying is cheap); encode/decode and the accessors are const
// and SentencePiece's processor is safe for concurrent const use, so any number of
// threads may use one Tokenizer (or its copies) at once. train() sets SentencePiece's
// process-wide log level and random seed; do not run two trainings concurrently.
//
// SentencePiece itself lives in a small shared object (libnebula_sentencepiece.so, see
// sentencepiece_shim.cc) loaded into its own symbol namespace: Debian's libsentencepiece
// and LibTorch's libprotobuf crash each other when linked into one program. It is looked
// for in $NEBULA_SENTENCEPIECE_SHIM, next to the running executable, then in the build tree.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace nebula::data {

class Tokenizer {
 public:
  // Trains a unigram model on `sentences` and writes model_prefix + ".model" and
  // model_prefix + ".vocab". The sentences go through a temporary file next to
  // model_prefix (removed afterwards); newlines inside a sentence become spaces and
  // empty sentences are dropped. Settings: 1 thread, fixed seed (deterministic for the
  // same input), at most 200000 sentences sampled (shuffled) from the input,
  // character_coverage 0.9995, ids as above, SentencePiece's own logging off.
  // Throws DataError if there are no sentences, if the files cannot be written, or if
  // SentencePiece refuses the input; when vocab_size is too large for the data the
  // message says so and gives SentencePiece's suggested maximum.
  static void train(const std::vector<std::string>& sentences, const std::string& model_prefix, int vocab_size);

  // Loads a .model file. DataError naming the path when it is missing or corrupt.
  static Tokenizer load(const std::string& model_path);

  // Ids of `text` (no bos/eos added). Characters outside the model become unk_id().
  std::vector<int> encode(std::string_view text) const;
  // Text of `ids`; control ids (pad, bos, eos) produce nothing. An id outside
  // [0, vocab_size()) throws DataError.
  std::string decode(const std::vector<int>& ids) const;

  int vocab_size() const { return vocab_size_; }
  int pad_id() const { return pad_id_; }
  int unk_id() const { return unk_id_; }
  int bos_id() const { return bos_id_; }
  int eos_id() const { return eos_id_; }
  int mask_id() const { return mask_id_; }  // -1 if the model has no "<mask>" piece

  const std::string& model_path() const { return model_path_; }

 private:
  Tokenizer() = default;

  std::shared_ptr<void> sp_;  // the shim's processor: shared, immutable
  std::string model_path_;
  int vocab_size_ = 0;
  int pad_id_ = -1, unk_id_ = -1, bos_id_ = -1, eos_id_ = -1, mask_id_ = -1;
};

}  // namespace nebula::data
