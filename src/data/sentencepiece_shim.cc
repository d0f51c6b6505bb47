// A C interface to SentencePiece, built as its own shared object and loaded by tokenizer.cc
// with dlopen(RTLD_LOCAL | RTLD_DEEPBIND). Why: Debian's libsentencepiece carries its own copy
// of protobuf-lite and exports those symbols, while LibTorch loads libprotobuf.so.32; linked
// into one program the two bind to each other's symbols and the process crashes while the
// libraries initialise. Loaded this way, SentencePiece resolves protobuf to its own copy and
// nothing else ever sees it. Only plain C types cross this boundary.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace {
void set_error(char* err, int errlen, const std::string& msg) {
  if (!err || errlen <= 0) return;
  std::strncpy(err, msg.c_str(), static_cast<size_t>(errlen) - 1);
  err[errlen - 1] = '\0';
}
}  // namespace

extern "C" {

// Trains with `n` key/value arguments (SentencePieceTrainer's map form). 0 on success.
int nebula_spm_train(const char* const* keys, const char* const* values, int n, unsigned seed, char* err,
                     int errlen) {
  std::unordered_map<std::string, std::string> args;
  for (int i = 0; i < n; ++i) args[keys[i]] = values[i];
  sentencepiece::SetRandomGeneratorSeed(seed);
  auto status = sentencepiece::SentencePieceTrainer::Train(args);
  if (!status.ok()) {
    set_error(err, errlen, status.message());
    return -1;
  }
  return 0;
}

// A processor from a serialized model, or null with `err` set.
void* nebula_spm_load(const char* bytes, size_t len, char* err, int errlen) {
  auto* sp = new sentencepiece::SentencePieceProcessor();
  auto status = sp->LoadFromSerializedProto(std::string_view(bytes, len));
  if (!status.ok()) {
    set_error(err, errlen, status.message());
    delete sp;
    return nullptr;
  }
  return sp;
}

void nebula_spm_free(void* sp) { delete static_cast<sentencepiece::SentencePieceProcessor*>(sp); }

// out: piece count, pad, unk, bos, eos, and the id of "<mask>" (-1 if the model has none).
void nebula_spm_info(const void* handle, int out[6]) {
  const auto* sp = static_cast<const sentencepiece::SentencePieceProcessor*>(handle);
  out[0] = sp->GetPieceSize();
  out[1] = sp->pad_id();
  out[2] = sp->unk_id();
  out[3] = sp->bos_id();
  out[4] = sp->eos_id();
  const int mask = sp->PieceToId("<mask>");
  out[5] = (mask == sp->unk_id() || sp->IdToPiece(mask) != "<mask>") ? -1 : mask;
}

// Writes up to `cap` ids; returns how many there are (call again with more room if > cap),
// or -1 with `err` set.
long nebula_spm_encode(const void* handle, const char* text, size_t len, int* out, size_t cap, char* err,
                       int errlen) {
  const auto* sp = static_cast<const sentencepiece::SentencePieceProcessor*>(handle);
  std::vector<int> ids;
  auto status = sp->Encode(std::string_view(text, len), &ids);
  if (!status.ok()) {
    set_error(err, errlen, status.message());
    return -1;
  }
  std::memcpy(out, ids.data(), std::min(cap, ids.size()) * sizeof(int));
  return static_cast<long>(ids.size());
}

// Writes up to `cap` bytes of text; returns its length (call again if > cap), or -1.
long nebula_spm_decode(const void* handle, const int* ids, size_t n, char* out, size_t cap, char* err,
                       int errlen) {
  const auto* sp = static_cast<const sentencepiece::SentencePieceProcessor*>(handle);
  std::string text;
  auto status = sp->Decode(std::vector<int>(ids, ids + n), &text);
  if (!status.ok()) {
    set_error(err, errlen, status.message());
    return -1;
  }
  std::memcpy(out, text.data(), std::min(cap, text.size()));
  return static_cast<long>(text.size());
}

}  // extern "C"
